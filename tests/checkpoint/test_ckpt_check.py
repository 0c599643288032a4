"""``ckpt-check`` as a job script runs it: a subprocess, its exit status and the last line of its output."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import unprivileged
from ckpt_factory import write_evil_pt
from jit_helpers import flip_middle_byte
from transformers.trainer_utils import get_last_checkpoint

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.protocol import MANIFEST_NAME, SENTINEL_NAME

CLI_TIMEOUT_S = 60  # a hang detector: the check reads a few MB and takes well under a second
OPTIM_1 = "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt"
CD_SIGNATURE = b"PK\x01\x02"  # a zip central directory file header
CD_EXTRACT_VERSION_OFFSET = 6  # its "version needed to extract" byte
NESTING_DEPTH = 100_000  # deeper than CPython's recursion limit


def ckpt_check(*args: object, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*(prefix or []), sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False, cwd="/")


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.stdout.endswith("\n"), proc.stdout
    return proc.stdout.splitlines()[-1]


def table_rows(proc: subprocess.CompletedProcess[str]) -> list[tuple[str, str]]:
    """(step, status) of each table row, in printed order."""
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["step", "status"], proc.stdout
    return [(line.split()[0], line.split()[1]) for line in lines[1:-1]]


def as_json(proc: subprocess.CompletedProcess[str]) -> dict:
    data = json.loads(proc.stdout)
    assert data["exit_code"] == proc.returncode
    return data


def assert_usage_error(proc: subprocess.CompletedProcess[str], says: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and says in proc.stderr, proc.stderr


def reseal(ckpt: Path, **changes: object) -> None:
    """Rewrite the manifest so it matches the files now on disk."""
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["files"] = protocol.file_entries(ckpt, protocol.payload_files(ckpt))
    manifest.update(changes)
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))


def restep(src: Path, dst: Path, step: int) -> Path:
    """A copy of checkpoint ``src`` that is a whole checkpoint of ``step``, written ``step`` seconds from now:
    after everything else the test does (the file clock is coarse)."""
    shutil.copytree(src, dst, symlinks=True)
    state = json.loads((dst / "trainer_state.json").read_text())
    state["global_step"] = step
    (dst / "trainer_state.json").write_text(json.dumps(state))
    if (dst / "latest").exists():  # the DeepSpeed tag directory of that step, as DeepSpeed names it
        old_tag = (dst / "latest").read_text().strip()
        (dst / old_tag).rename(dst / f"global_step{step}")
        (dst / "latest").write_text(f"global_step{step}")
    written_at = time.time() + step
    if (dst / MANIFEST_NAME).exists():
        reseal(dst, step=step, created=written_at, deepspeed_tag=f"global_step{step}")
    os.utime(dst, (written_at, written_at))
    return dst


def tree(root: Path) -> dict[str, bytes]:
    """Every file and symlink under root (links not followed) with its content or target."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            found[rel] = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
    return found


@pytest.fixture
def world_traversable_tmp() -> Iterator[Path]:
    """A directory user nobody may enter (pytest's tmp_path sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="ckpt-check-perm-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def unprivileged_prefix() -> list[str]:
    return unprivileged.prefix()


# ---------------------------------------------------------------- no checkpoint, strays, usage errors


def test_empty_out_dir_is_a_fresh_start(tmp_path: Path) -> None:
    proc = ckpt_check(tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert last_line(proc) == ""
    assert "fresh start" in proc.stdout and proc.stderr == ""
    data = as_json(ckpt_check(tmp_path, "--json"))
    assert (data["exit_code"], data["resume_from"], data["checkpoints"]) == (3, None, [])


def make_strays(out: Path) -> None:
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("hello")
    (out / "runs").mkdir()
    (out / "checkpoint-abc").mkdir()
    (out / "checkpoint-9").write_text("a regular file named like a checkpoint")
    (out / "checkpoint-2.incomplete").mkdir()  # quarantined earlier: silent


def test_strays_only_is_a_fresh_start(tmp_path: Path) -> None:
    make_strays(tmp_path)
    proc = ckpt_check(tmp_path)
    assert proc.returncode == 3 and last_line(proc) == ""
    assert proc.stderr.splitlines() == ["ckpt-check: ignored checkpoint-9: not a directory",
                                        "ckpt-check: ignored checkpoint-abc: not checkpoint-<step>"]


@pytest.mark.deepspeed
def test_strays_beside_checkpoints_are_ignored(jit_zero2_run: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    make_strays(out)
    proc = ckpt_check(out)
    assert proc.returncode == 0, proc.stderr
    assert last_line(proc) == str(out / "checkpoint-6")
    assert table_rows(proc) == [("6", "complete"), ("3", "complete")]
    assert "Traceback" not in proc.stderr and "checkpoint-abc" in proc.stderr
    data = as_json(ckpt_check(out, "--json"))
    assert data["ignored"] == ["checkpoint-9: not a directory", "checkpoint-abc: not checkpoint-<step>"]


def test_missing_out_dir_is_a_usage_error(tmp_path: Path) -> None:
    assert_usage_error(ckpt_check(tmp_path / "no-such-dir"), "no such directory")
    assert_usage_error(ckpt_check(tmp_path / "no-such-dir", "--json"), "no such directory")


def test_a_file_instead_of_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("not a directory")
    assert_usage_error(ckpt_check(tmp_path / "out"), "not a directory")


def test_unreadable_out_dir_is_a_usage_error(world_traversable_tmp: Path) -> None:
    prefix = unprivileged_prefix()
    out = world_traversable_tmp / "out"
    out.mkdir(mode=0o700)
    (out / "checkpoint-3").mkdir()
    assert_usage_error(ckpt_check(out, prefix=prefix), "permission denied")


@pytest.mark.deepspeed
def test_unreadable_checkpoint_dir_is_a_usage_error(world_traversable_tmp: Path, jit_zero2_run: Path) -> None:
    prefix = unprivileged_prefix()
    out = world_traversable_tmp / "out"
    shutil.copytree(jit_zero2_run, out)
    for path in [out, *out.rglob("*")]:  # as the job's user sees its own files (the header checks read them)
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert ckpt_check(out, prefix=prefix).returncode == 0  # readable as it is
    (out / "checkpoint-6").chmod(0o700)
    assert_usage_error(ckpt_check(out, prefix=prefix), "Permission denied")


def test_out_dir_under_an_unsearchable_parent_says_permission_denied(world_traversable_tmp: Path) -> None:
    prefix = unprivileged_prefix()
    parent = world_traversable_tmp / "private"
    (parent / "out").mkdir(parents=True)
    parent.chmod(0o700)
    assert_usage_error(ckpt_check(parent / "out", prefix=prefix), "permission denied")


# ---------------------------------------------------------------- resumable, strict, json


@pytest.mark.deepspeed
def test_complete_run_resumes_from_the_newest(jit_zero2_run: Path) -> None:
    proc = ckpt_check(jit_zero2_run)
    assert proc.returncode == 0, proc.stderr
    assert table_rows(proc) == [("6", "complete"), ("3", "complete")]
    assert proc.stdout.splitlines()[1].endswith("ok  <- resume")
    assert last_line(proc) == str(jit_zero2_run / "checkpoint-6")
    assert proc.stderr == ""


@pytest.mark.deepspeed
def test_plain_run_is_unverified_and_strict_refuses_it(plain_zero2_run: Path) -> None:
    proc = ckpt_check(plain_zero2_run)
    assert proc.returncode == 0, proc.stderr
    assert table_rows(proc) == [("6", "unverified"), ("3", "unverified")]
    assert last_line(proc) == str(plain_zero2_run / "checkpoint-6")
    strict = ckpt_check(plain_zero2_run, "--strict")
    assert strict.returncode == 1, strict.stderr
    assert table_rows(strict) == [("6", "unverified"), ("3", "unverified")]
    assert last_line(strict) == ""


@pytest.mark.deepspeed
def test_json_output(jit_zero2_run: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    (out / "checkpoint-6" / SENTINEL_NAME).write_text("interrupted")
    proc = ckpt_check(out, "--json")
    assert proc.returncode == 0, proc.stderr
    data = as_json(proc)
    assert data["resume_from"] == str(out / "checkpoint-3")
    rows = [(c["step"], c["status"], c["kind"], c["resumable"], c["reason"]) for c in data["checkpoints"]]
    assert rows == [
        (6, "incomplete", None, False, f"{SENTINEL_NAME} present: the save did not finish"),
        (3, "complete", "periodic", True, "")]
    assert data["quarantined"] == [] and data["ignored"] == []


@pytest.mark.deepspeed
def test_no_resumable_checkpoint_exits_1(jit_zero2_run: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    (out / "checkpoint-3" / "latest").unlink()  # (changes the directory's time: before the later save of 6)
    (out / "checkpoint-6" / SENTINEL_NAME).write_text("interrupted")
    proc = ckpt_check(out)
    assert proc.returncode == 1, proc.stderr
    assert table_rows(proc) == [("6", "incomplete"), ("3", "corrupt")]
    assert last_line(proc) == ""
    assert "latest is missing" in proc.stdout


@pytest.mark.deepspeed
def test_deep_catches_a_same_size_byte_flip(jit_zero2_run: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    path = out / "checkpoint-6" / OPTIM_1
    flip_middle_byte(path, 0x80)
    shallow = ckpt_check(out)
    assert shallow.returncode == 0 and last_line(shallow) == str(out / "checkpoint-6")
    assert table_rows(shallow) == [("6", "complete"), ("3", "complete")]
    deep = ckpt_check(out, "--deep")
    assert deep.returncode == 0, deep.stderr
    assert table_rows(deep) == [("6", "corrupt"), ("3", "complete")]
    assert f"{OPTIM_1} checksum mismatch" in deep.stdout
    assert last_line(deep) == str(out / "checkpoint-3")


@pytest.mark.deepspeed
@pytest.mark.parametrize("rel", ["rng_state_1.pth", "model.safetensors", OPTIM_1])
def test_truncated_files_of_a_plain_run_are_not_resumable(plain_zero2_run: Path, rel: str,
                                                          copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(plain_zero2_run)
    for step in (6, 3):
        path = out / f"checkpoint-{step}" / rel.replace("global_step6", f"global_step{step}")
        os.truncate(path, path.stat().st_size // 2 if step == 6 else 0)
    proc = ckpt_check(out)
    assert proc.returncode == 1, proc.stderr
    assert table_rows(proc) == [("6", "incomplete"), ("3", "incomplete")]
    assert last_line(proc) == ""


# ---------------------------------------------------------------- quarantine


@pytest.mark.deepspeed
def test_quarantine_renames_broken_newer_dirs_and_transformers_agrees(
        jit_zero2_run: Path, tmp_path: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    restep(out / "checkpoint-6", out / "checkpoint-9", 9)
    (out / "checkpoint-9" / OPTIM_1.replace("global_step6", "global_step9")).unlink()  # corrupt
    (out / "checkpoint-6" / SENTINEL_NAME).write_text("interrupted")  # incomplete
    outside = restep(out / "checkpoint-3", tmp_path / "elsewhere" / "checkpoint-12", 12)
    (out / "checkpoint-12").symlink_to(outside)  # corrupt: a symlink
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-12")  # what transformers would resume from
    before, outside_before = tree(out), tree(outside)

    proc = ckpt_check(out, "--quarantine")
    assert proc.returncode == 0, proc.stderr
    # newest written first: 9 (restep: written last), the link 12, then 6 (its sentinel written before the link)
    assert table_rows(proc) == [("9", "corrupt"), ("12", "corrupt"), ("6", "incomplete"), ("3", "complete")]
    assert last_line(proc) == str(out / "checkpoint-3")
    assert proc.stderr.splitlines() == [
        f"quarantined {out / f'checkpoint-{s}'} -> {out / f'checkpoint-{s}.incomplete'}" for s in (9, 12, 6)]

    renamed = {f"checkpoint-{s}.incomplete": f"checkpoint-{s}" for s in (12, 9, 6)}
    after = {"/".join([renamed.get(rel.split("/")[0], rel.split("/")[0]), *rel.split("/")[1:]]): data
             for rel, data in tree(out).items()}
    assert after == before  # nothing deleted, nothing changed: only three names
    assert tree(outside) == outside_before
    assert (out / "checkpoint-12.incomplete").is_symlink()
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")

    again = ckpt_check(out, "--json", "--quarantine")
    data = as_json(again)
    assert (data["exit_code"], data["resume_from"], data["quarantined"]) == (0, str(out / "checkpoint-3"), [])
    assert [c["step"] for c in data["checkpoints"]] == [3]


@pytest.mark.deepspeed
def test_quarantine_json_lists_the_moves(jit_zero2_run: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    (out / "checkpoint-6" / SENTINEL_NAME).write_text("interrupted")
    (out / "checkpoint-6.incomplete").mkdir()  # an older quarantine of the same step: never overwritten
    data = as_json(ckpt_check(out, "--json", "--quarantine"))
    assert data["quarantined"] == [
        {"from": str(out / "checkpoint-6"), "to": str(out / "checkpoint-6.incomplete.1")}]
    assert (out / "checkpoint-6.incomplete.1" / SENTINEL_NAME).exists()
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")


# ---------------------------------------------------------------- untrusted files are never unpickled


@pytest.mark.deepspeed
def test_ckpt_check_never_unpickles(plain_zero2_run: Path, jit_zero2_run: Path, tmp_path: Path,
                                    copy_run: Callable[[Path], Path]) -> None:
    marker = tmp_path / "unpickled"
    plain = copy_run(plain_zero2_run)
    for rel in ("rng_state_1.pth", "scheduler.pt", "training_args.bin", OPTIM_1):
        write_evil_pt(plain / "checkpoint-6" / rel, marker)
    jit = tmp_path / "jit"
    shutil.copytree(jit_zero2_run, jit)
    write_evil_pt(jit / "checkpoint-6" / "rng_state_1.pth", marker)
    reseal(jit / "checkpoint-6")
    for args in ((plain,), (plain, "--deep"), (plain, "--json", "--strict"), (jit, "--deep")):
        proc = ckpt_check(*args)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
        assert not marker.exists(), args
    # the evil files are well-formed zips with a data.pkl: only unpickling could tell them apart
    assert table_rows(ckpt_check(plain)) == [("6", "unverified"), ("3", "unverified")]
    assert table_rows(ckpt_check(jit, "--deep")) == [("6", "complete"), ("3", "complete")]
    with zipfile.ZipFile(plain / "checkpoint-6" / "scheduler.pt") as archive:  # the payload is live
        pickle.loads(archive.read("archive/data.pkl"))  # noqa: S301 - the point of the control
    assert marker.exists()


# ---------------------------------------------------------------- crashes must not read as "none resumable"


def bump_zip_version(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[blob.index(CD_SIGNATURE) + CD_EXTRACT_VERSION_OFFSET] = 64  # one bit rotted: "needs zip version 6.4"
    path.write_bytes(bytes(blob))


def nest_json(path: Path) -> None:
    path.write_bytes(b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH)


@pytest.mark.deepspeed
@pytest.mark.parametrize(("rel", "damage"),
                         [("rng_state_1.pth", bump_zip_version), ("config.json", nest_json)],
                         ids=["zip-version-byte", "nested-json"])
def test_damaged_header_does_not_crash(plain_zero2_run: Path, copy_run: Callable[[Path], Path], rel: str,
                                       damage: Callable[[Path], None]) -> None:
    out = copy_run(plain_zero2_run)
    damage(out / "checkpoint-6" / rel)
    proc = ckpt_check(out)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0
    assert table_rows(proc) == [("6", "incomplete"), ("3", "unverified")]
    assert last_line(proc) == str(out / "checkpoint-3")


@pytest.mark.deepspeed
def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_with_the_gate(jit_zero2_run: Path) -> None:
    """The manifest's samples per optimizer step (2 ranks x 2 samples = 4): no per-device batch and accumulation
    keep them on 3 ranks, so ckpt-check --world-size 3 and the launcher's gate say no before a job starts (a
    requeue on 3 ranks of a --nodes range was passed as "convert", then its ranks refused); 1 rank still converts."""
    from slurm_jit.launch import gate

    hint = "HINT: no per-device batch does on 3 ranks: resume on a number of ranks that divides 4 (1, 2, 4)"
    proc = ckpt_check("--world-size", "3", jit_zero2_run)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("on 3 ranks:"))
    assert line.startswith("on 3 ranks: no (refused):") and line.endswith(hint), proc.stdout
    assert "4 samples per optimizer step when written" in line, line
    checked = gate.check(jit_zero2_run, world_size=3)
    assert not checked.ok and checked.message.endswith(hint), checked.message
    assert gate.check(jit_zero2_run, world_size=1).ok
    assert "on 1 ranks: yes (convert)" in ckpt_check("--world-size", "1", jit_zero2_run).stdout
