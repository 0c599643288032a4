"""Hostile and odd checkpoint directories (issue 7 items 9, 10, 11): nothing blocks, follows a link out, sizes an
allocation from a name, or crashes on an undecodable name; a crash is never a verdict. Crafted directories,
ckpt-check in-process under a time bound with a strict UTF-8 stdout (the whole file runs in about a second)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ckpt_factory
import pytest
import unprivileged
from ckpt_factory import run_ckpt_check

from slurm_jit.checkpoint import ckpt_check, protocol, structure
from slurm_jit.checkpoint.protocol import MANIFEST_NAME, Status

SUBPROCESS_TIMEOUT_S = 60  # a hang detector for the real-process runs (a check takes well under a second)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside OUT_DIR: what a link out of a checkpoint points into."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def only(out: Path) -> protocol.CheckpointInfo:
    with ckpt_factory.time_bound(ckpt_factory.CHECK_TIMEOUT_S):
        checkpoints, _ = protocol.scan(out)
    assert len(checkpoints) == 1, checkpoints
    return checkpoints[0]


def replace(path: Path, make: str, target: Path | None = None) -> Iterator[socket.socket] | None:
    path.unlink(missing_ok=True)
    if make == "fifo":
        os.mkfifo(path)
    elif make == "link" and target is not None:
        path.symlink_to(target)
    return None


def bind_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


# ---------------------------------------------------------------- item 9: nothing blocks, nothing leads out


def test_fifo_trainer_state_without_manifest_does_not_hang(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    replace(ckpt / "trainer_state.json", "fifo")
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE and run.last_line == b"", run
    info = only(out)
    assert info.status is Status.CORRUPT and "a FIFO, not a regular file" in info.reason, info.reason


def test_fifo_json_anywhere_in_a_plain_checkpoint_does_not_hang(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    os.mkfifo(ckpt / "generation_config.json")  # not one a resume reads, but the header check opens .json files
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE, run
    assert only(out).reason == "no manifest; generation_config.json: a FIFO, not a regular file: not trusted"


def test_trainer_state_linked_to_a_fifo_outside_is_not_followed(out: Path, outside: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    os.mkfifo(outside / "fifo")
    replace(ckpt / "trainer_state.json", "link", outside / "fifo")
    assert run_ckpt_check(out).code == ckpt_check.EXIT_NONE_RESUMABLE
    assert "a symlink, not a regular file" in only(out).reason


def test_trainer_state_linked_to_a_good_file_outside_is_not_trusted(out: Path, outside: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    (outside / "state.json").write_text(json.dumps({"global_step": 5}))
    replace(ckpt / "trainer_state.json", "link", outside / "state.json")
    assert only(out).status is not Status.UNVERIFIED


def test_manifest_linked_to_dev_zero_is_not_read(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5)
    replace(ckpt / MANIFEST_NAME, "link", Path("/dev/zero"))
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE, run
    info = only(out)
    assert info.status is Status.CORRUPT and "a symlink, not a regular file" in info.reason, info.reason


def test_manifest_linked_to_a_valid_manifest_outside_is_not_trusted(out: Path, outside: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5)
    (ckpt / MANIFEST_NAME).rename(outside / MANIFEST_NAME)
    replace(ckpt / MANIFEST_NAME, "link", outside / MANIFEST_NAME)
    assert only(out).status is Status.CORRUPT


def test_fifo_manifest_does_not_hang(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5)
    replace(ckpt / MANIFEST_NAME, "fifo")
    assert run_ckpt_check(out).code == ckpt_check.EXIT_NONE_RESUMABLE
    assert "a FIFO, not a regular file" in only(out).reason


def test_listed_file_replaced_by_a_fifo_does_not_hang_deep(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5)
    replace(ckpt / "scheduler.pt", "fifo")
    run = run_ckpt_check(out, "--deep")
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE, run
    assert only(out).reason == "scheduler.pt is a FIFO, not a regular file"


def test_sockets_are_reported_not_opened(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    (ckpt / "config.json").unlink()
    with bind_socket(ckpt / "config.json"):
        assert run_ckpt_check(out).code == ckpt_check.EXIT_NONE_RESUMABLE
        assert only(out).reason == "no manifest; config.json: a socket, not a regular file: not trusted"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device needs root")
def test_a_device_file_is_reported_not_opened(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    (ckpt / "trainer_state.json").unlink()
    os.mknod(ckpt / "trainer_state.json", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    assert run_ckpt_check(out).code == ckpt_check.EXIT_NONE_RESUMABLE
    assert only(out).reason == ("trainer_state.json unreadable: UntrustedFile: a character device, not a regular "
                                "file: not read")


def test_a_symlinked_directory_inside_is_not_trusted(out: Path, outside: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    (ckpt / "extra").symlink_to(outside)
    assert only(out).reason == "no manifest; extra: a symlink, not a regular file: not trusted"


@pytest.mark.parametrize("rank", [10**10 - 1, 10**200])
def test_a_huge_rank_in_a_name_allocates_nothing(out: Path, rank: int) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False, world=2)
    ckpt_factory.torch_like_zip(ckpt / f"rng_state_{rank}.pth")
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE, run
    assert only(out).reason == (f"no manifest; a file names rank {rank}, beyond the sane limit of "
                                f"{structure.MAX_WORLD_SIZE} ranks")


def test_a_huge_shard_rank_allocates_nothing(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False, world=2, deepspeed=True)
    ckpt_factory.torch_like_zip(ckpt / "global_step5" / "zero_pp_rank_99999999999_mp_rank_00_optim_states.pt")
    assert "beyond the sane limit" in only(out).reason


def test_a_huge_step_in_a_directory_name_is_ignored(out: Path) -> None:
    (out / ("checkpoint-" + "9" * 200)).mkdir()
    ckpt_factory.checkpoint(out, 5)
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_RESUMABLE, run
    assert "step out of range" in run.stderr


def test_a_newline_in_a_directory_name_cannot_fake_the_resume_line(out: Path) -> None:
    ckpt_factory.checkpoint(out, 5)
    os.rename(out / "checkpoint-5", out / "checkpoint-5\n")  # transformers' ^checkpoint-(\d+)$ matches this
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NO_CHECKPOINT, run
    assert run.last_line == b""
    assert "ignored checkpoint-5\\n: not checkpoint-<step>" in run.stderr


# ---------------------------------------------------------------- item 10: odd names, crashes, unknowns


def test_lone_surrogate_manifest_key_under_strict_utf8(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["files"]["\udc80bad"] = {"size": 1}
    manifest["files"]["\ud800unencodable"] = {"size": 1}
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))  # json writes them as \udc80 escapes
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE, run
    assert "Traceback" not in run.stderr
    assert b"\\udc80bad is missing" in run.stdout or b"'\\ud800unencodable' escapes" in run.stdout, run.stdout
    data = json.loads(run_ckpt_check(out, "--json").stdout)
    assert data["checkpoints"][0]["status"] == "corrupt"


def test_undecodable_file_name_in_a_checkpoint(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    bad = os.fsencode(ckpt) + b"/\xff\xfe.json"
    Path(os.fsdecode(bad)).write_bytes(b"{not json")
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE, run
    assert b"\\udcff\\udcfe.json: not valid JSON" in run.stdout, run.stdout


def test_undecodable_out_dir_prints_the_exact_resume_path(tmp_path: Path) -> None:
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/out-\xff"))
    ckpt_factory.checkpoint(out, 5)
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_RESUMABLE, run
    assert run.last_line == os.fsencode(out / "checkpoint-5")  # the bytes a shell needs, not an escape


def test_real_process_under_strict_utf8(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False)
    Path(os.fsdecode(os.fsencode(ckpt) + b"/\x80.json")).write_bytes(b"[")
    ckpt_factory.checkpoint(out, 3, mtime=1.0e9, run_id="run-\udc80")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C"}
    for args in ([], ["--json"], ["--deep", "--strict"]):
        proc = subprocess.run([sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", str(out), *args],
                              capture_output=True, env=env, timeout=SUBPROCESS_TIMEOUT_S, check=False)
        assert b"Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 1), (args, proc.stderr)


def test_an_internal_error_is_exit_2_never_a_verdict(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the only fake here: a bug in ckpt-check itself cannot be produced for real
    ckpt_factory.checkpoint(out, 5)

    def broken(*_args: object, **_kwargs: object) -> protocol.Resolution:
        raise KeyError("\udc80 a bug")

    monkeypatch.setattr(protocol, "find_resumable", broken)
    run = run_ckpt_check(out)
    assert run.code == ckpt_check.EXIT_USAGE and run.stdout == b"", run
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("ckpt-check: internal error, no verdict: KeyError") and "HINT:" in run.stderr


def test_could_not_be_checked_shows_what_is_known(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_factory.checkpoint(out, 5, manifest=False, mtime=1_700_000_000.0)

    def broken(*_args: object, **_kwargs: object) -> str:
        raise ZeroDivisionError("an unforeseen parse failure")

    monkeypatch.setattr(structure, "check", broken)
    info = only(out)
    assert info.status is Status.CORRUPT and info.reason.startswith("could not be checked: ZeroDivisionError")
    assert info.size_bytes is not None and info.size_bytes > 0
    assert info.written_at == 1_700_000_000.0
    row = run_ckpt_check(out).stdout.decode().splitlines()[1]
    assert " 0 B " not in row and "d  " in row  # its real size; its real age in days (not 20000+ since 1970)


def test_unknown_size_and_age_show_a_dash() -> None:
    info = protocol.CheckpointInfo(path=Path("/nowhere/checkpoint-1"), step=1, status=Status.CORRUPT, reason="x")
    res = protocol.Resolution(checkpoint=None, passed_over=[info], checkpoints=[info])
    row = ckpt_check._table(res, now=1_700_000_000.0)[1].split()
    assert row[:6] == ["1", "corrupt", "-", "-", "-", "-"]


# ---------------------------------------------------------------- item 11: every rank's files


def test_plain_two_rank_checkpoint_missing_the_top_ranks_rng_state(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, manifest=False, world=2)
    (ckpt / "rng_state_1.pth").unlink()  # rng_state_0.pth alone: Trainer names it so only for 2+ ranks
    assert only(out).reason == "no manifest; RNG state file of rank 1 missing (2 ranks)"


def test_manifest_world_size_requires_every_ranks_files(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, world=3, deepspeed=True)
    (ckpt / "rng_state_2.pth").unlink()
    (ckpt / "global_step5" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    files = protocol.file_entries(ckpt, protocol.payload_files(ckpt))
    ckpt_factory.edit_manifest(ckpt, files=files)  # a manifest that never listed rank 2: the names look whole
    info = only(out)
    assert info.status is Status.INCOMPLETE
    assert info.reason == "manifest verified but RNG state file of rank 2 missing (3 ranks): cannot be resumed"


def test_files_of_a_rank_beyond_the_manifest_world_size(out: Path) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5, world=2)
    ckpt_factory.edit_manifest(ckpt, world_size=1)
    assert only(out).reason == "manifest verified but files of rank 1 in a checkpoint of 1 ranks: cannot be resumed"


@pytest.mark.parametrize("world", [0, -1, True, "2", 10**9])
def test_a_malformed_manifest_world_size_is_corrupt(out: Path, world: object) -> None:
    ckpt = ckpt_factory.checkpoint(out, 5)
    ckpt_factory.edit_manifest(ckpt, world_size=world)
    assert only(out).status is Status.CORRUPT


# ---------------------------------------------------------------- the same class elsewhere in checkpoint/


def test_an_out_dir_that_cannot_be_reached_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert protocol.find_resumable(tmp_path / "missing").checkpoint is None  # missing: a fresh start
    assert protocol.find_resumable(blocked / "out").checkpoints == []  # ENOTDIR: nothing can be there either
    private = Path(tempfile.mkdtemp(prefix="ckpt-private-"))  # /tmp is world-traversable; this one is not
    try:
        ckpt_factory.checkpoint(private / "out", 5)
        private.chmod(0o700)
        prefix = unprivileged.prefix()
        code = ("import sys; from slurm_jit.checkpoint import protocol\n"
                "try:\n    protocol.find_resumable(sys.argv[1])\nexcept PermissionError:\n    sys.exit(7)\n")
        proc = subprocess.run([*prefix, sys.executable, "-c", code, str(private / "out")], capture_output=True,
                              text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False, cwd="/")
        assert proc.returncode == 7, proc.stderr  # on main: no error, a fresh start over checkpoint-5
    finally:
        shutil.rmtree(private)


def test_the_writer_refuses_a_fifo_in_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-6"
    protocol.write_sentinel(ckpt, 6, "jit")
    ckpt_factory.write_files(ckpt, 6)
    os.mkfifo(ckpt / "ema.json")  # e.g. left by a callback: hashing it would block the save forever
    with ckpt_factory.time_bound(ckpt_factory.CHECK_TIMEOUT_S):
        protocol.fsync_tree(ckpt)
        with pytest.raises(protocol.ProtocolError, match="ema.json: a FIFO, not a regular file.*HINT:"):
            protocol.file_entries(ckpt, protocol.payload_files(ckpt))
    assert (ckpt / protocol.SENTINEL_NAME).exists()  # still incomplete
