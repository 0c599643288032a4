"""The checkpoint completeness protocol on real checkpoints (2 DeepSpeed CPU ranks, ZeRO-2) and broken copies.

Each broken copy breaks only ``checkpoint-6``; ``checkpoint-3`` stays whole, so every case also checks that
``find_resumable`` passes over the newer broken one, with its reason, to the older good one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from jit_helpers import flip_middle_byte

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.protocol import MANIFEST_NAME, SENTINEL_NAME, Status

OPTIM_1 = "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt"  # rank 1's ZeRO-2 optimizer shard
INNER_DOTDOT = "global_step6/../../checkpoint-3/latest"  # leaves the checkpoint half way
NESTING_DEPTH = 100_000  # deeper than CPython's recursion limit, so json's C scanner gives up

Break = Callable[[Path], None]


# ---------------------------------------------------------------- helpers that break or rebuild a checkpoint


def reseal(ckpt: Path, **changes: object) -> None:
    """Rewrite the manifest so it matches the files now on disk (as if rank 0 had written them so)."""
    path = ckpt / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["files"] = protocol.file_entries(ckpt, protocol.payload_files(ckpt))
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def set_global_step(ckpt: Path, step: int) -> None:
    path = ckpt / "trainer_state.json"
    state = json.loads(path.read_text())
    state["global_step"] = step
    path.write_text(json.dumps(state))


def restep(src: Path, dst: Path, step: int) -> Path:
    """A copy of checkpoint ``src`` that is a whole checkpoint of ``step`` (any manifest resealed), written
    ``step`` seconds from now: after everything else the test does (the file clock is coarse)."""
    shutil.copytree(src, dst, symlinks=True)
    set_global_step(dst, step)
    if (dst / "latest").exists():  # the DeepSpeed tag directory of that step, as DeepSpeed names it
        old_tag = (dst / "latest").read_text().strip()
        (dst / old_tag).rename(dst / f"global_step{step}")
        (dst / "latest").write_text(f"global_step{step}")
    written_at = time.time() + step
    if (dst / MANIFEST_NAME).exists():
        reseal(dst, step=step, created=written_at, deepspeed_tag=f"global_step{step}")
    os.utime(dst, (written_at, written_at))
    return dst


def truncate(rel: str, size: int | None = None) -> Break:
    def apply(ckpt: Path) -> None:
        path = ckpt / rel
        os.truncate(path, path.stat().st_size // 2 if size is None else size)
    return apply


def write(rel: str, data: bytes) -> Break:
    def apply(ckpt: Path) -> None:
        (ckpt / rel).write_bytes(data)
    return apply


def delete(rel: str) -> Break:
    return lambda ckpt: (ckpt / rel).unlink()


def then_reseal(brk: Break) -> Break:
    def apply(ckpt: Path) -> None:
        brk(ckpt)
        reseal(ckpt)
    return apply


def edit_manifest(change: Callable[[dict], None]) -> Break:
    def apply(ckpt: Path) -> None:
        manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
        change(manifest)
        (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    return apply


def add_entry(rel: str, real_file: Path) -> Callable[[dict], None]:
    """A manifest entry whose size and checksum match ``real_file``: only the path check can reject it."""
    def change(manifest: dict) -> None:
        manifest["files"][rel] = {"size": real_file.stat().st_size,
                                  protocol.HASH_NAME: protocol.hash_file(real_file)}
    return change


def symlink_to_checkpoint_3(rel: str) -> Break:
    """Replace a file by a symlink to the same file of checkpoint-3 (same size: only the type differs)."""
    def apply(ckpt: Path) -> None:
        (ckpt / rel).unlink()
        (ckpt / rel).symlink_to(ckpt.parent / "checkpoint-3" / rel)
    return apply


def tag_dir_symlinked_outside(ckpt: Path) -> None:
    outside = ckpt.parent.parent / "outside-global_step6"
    shutil.move(ckpt / "global_step6", outside)
    (ckpt / "global_step6").symlink_to(outside)


def escape_file_beside(ckpt: Path) -> None:
    (ckpt.parent / "escape.bin").write_bytes(b"outside the checkpoint")
    edit_manifest(add_entry("../escape.bin", ckpt.parent / "escape.bin"))(ckpt)


def broken_run(out: Path, brk: Break) -> protocol.Resolution:
    brk(out / "checkpoint-6")
    return protocol.find_resumable(out)


def assert_passed_over(res: protocol.Resolution, out: Path, status: Status, reason: str,
                       resume_status: Status) -> None:
    newest = res.checkpoints[0]
    assert (newest.step, newest.status) == (6, status), newest
    assert re.fullmatch(reason, newest.reason), newest.reason
    assert res.checkpoint is not None and res.checkpoint.path == out / "checkpoint-3"
    assert res.checkpoint.status is resume_status
    assert [(c.step, c.reason) for c in res.passed_over] == [(6, newest.reason)]


# ---------------------------------------------------------------- whole runs


@pytest.mark.deepspeed
def test_jit_run_checkpoints_are_complete(jit_zero2_run: Path) -> None:
    res = protocol.find_resumable(jit_zero2_run, deep=True)
    assert [(c.step, c.status, c.kind, c.reason) for c in res.checkpoints] == [
        (6, Status.COMPLETE, "final", ""), (3, Status.COMPLETE, "periodic", "")]
    assert res.checkpoint is not None and res.checkpoint.path == jit_zero2_run / "checkpoint-6"
    assert res.passed_over == [] and res.ignored == []
    assert all(c.size_bytes > 1_000_000 for c in res.checkpoints)


@pytest.mark.deepspeed
def test_jit_manifest_records_the_save(jit_zero2_run: Path) -> None:
    for step, kind in ((3, "periodic"), (6, "final")):
        ckpt = jit_zero2_run / f"checkpoint-{step}"
        manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
        assert {k: manifest[k] for k in ("format", "version", "step", "kind", "world_size", "zero_stage",
                                         "deepspeed_tag", "hash")} == {
            "format": protocol.MANIFEST_FORMAT, "version": protocol.FORMAT_VERSION, "step": step,
            "kind": kind, "world_size": 2, "zero_stage": 2, "deepspeed_tag": f"global_step{step}",
            "hash": protocol.HASH_NAME}
        # every file on disk is listed, with its real size and checksum
        assert manifest["files"] == protocol.file_entries(ckpt, protocol.payload_files(ckpt))
        assert f"global_step{step}/zero_pp_rank_1_mp_rank_00_optim_states.pt" in manifest["files"]
        assert not (ckpt / SENTINEL_NAME).exists()


@pytest.mark.deepspeed
def test_plain_run_checkpoints_are_unverified(plain_zero2_run: Path) -> None:
    res = protocol.find_resumable(plain_zero2_run)
    assert [(c.step, c.status, c.kind) for c in res.checkpoints] == [
        (6, Status.UNVERIFIED, None), (3, Status.UNVERIFIED, None)]
    assert res.checkpoints[0].reason == "no manifest (plain Trainer save); structure whole"
    assert res.checkpoint is not None and res.checkpoint.path == plain_zero2_run / "checkpoint-6"


@pytest.mark.deepspeed
def test_strict_makes_unverified_not_resumable(plain_zero2_run: Path) -> None:
    res = protocol.find_resumable(plain_zero2_run, strict=True)
    assert res.checkpoint is None
    assert [c.step for c in res.passed_over] == [6, 3]


@pytest.mark.deepspeed
def test_strict_falls_back_to_an_older_complete_checkpoint(jit_zero2_run: Path, plain_zero2_run: Path,
                                                           copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    shutil.rmtree(out / "checkpoint-6")
    shutil.copytree(plain_zero2_run / "checkpoint-6", out / "checkpoint-6")
    lenient = protocol.find_resumable(out)
    assert lenient.checkpoint is not None and lenient.checkpoint.path == out / "checkpoint-6"
    assert lenient.checkpoint.status is Status.UNVERIFIED
    strict = protocol.find_resumable(out, strict=True)
    assert strict.checkpoint is not None and strict.checkpoint.path == out / "checkpoint-3"
    assert strict.checkpoint.status is Status.COMPLETE
    assert [(c.step, c.status) for c in strict.passed_over] == [(6, Status.UNVERIFIED)]


@pytest.mark.deepspeed
def test_newest_first_is_numeric_not_lexicographic(plain_zero2_run: Path,
                                                   copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(plain_zero2_run)
    restep(out / "checkpoint-3", out / "checkpoint-10", 10)  # as text "checkpoint-10" < "checkpoint-3"
    res = protocol.find_resumable(out)
    assert [c.step for c in res.checkpoints] == [10, 6, 3]
    assert res.checkpoint is not None and res.checkpoint.path == out / "checkpoint-10"
    (out / "checkpoint-10" / SENTINEL_NAME).write_text("interrupted")
    res = protocol.find_resumable(out)
    assert res.checkpoint is not None and res.checkpoint.path == out / "checkpoint-6"
    assert [(c.step, c.status) for c in res.passed_over] == [(10, Status.INCOMPLETE)]


@pytest.mark.deepspeed
def test_find_resumable_passes_over_every_newer_broken_one(jit_zero2_run: Path,
                                                           copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    restep(out / "checkpoint-6", out / "checkpoint-9", 9)
    assert protocol.inspect(out / "checkpoint-9", 9, deep=True).status is Status.COMPLETE
    (out / "checkpoint-9" / "global_step9" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (out / "checkpoint-6" / SENTINEL_NAME).write_text("interrupted")
    res = protocol.find_resumable(out)
    assert [(c.step, c.status, c.reason) for c in res.passed_over] == [
        (9, Status.CORRUPT, "global_step9/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
        (6, Status.INCOMPLETE, f"{SENTINEL_NAME} present: the save did not finish")]
    assert res.checkpoint is not None and res.checkpoint.path == out / "checkpoint-3"


def test_missing_out_dir_is_a_fresh_start(tmp_path: Path) -> None:
    res = protocol.find_resumable(tmp_path / "never-created")
    assert (res.checkpoint, res.passed_over, res.checkpoints) == (None, [], [])


# ------------------------------------------------------- broken copies of a plain (manifest-less) run

PLAIN_BREAKS: list[tuple[str, Break, Status, str]] = [
    ("sentinel", write(SENTINEL_NAME, b"x"), Status.INCOMPLETE,
     f"{SENTINEL_NAME} present: the save did not finish"),
    ("no-trainer-state", delete("trainer_state.json"), Status.INCOMPLETE,
     "no manifest and no trainer_state.json"),
    ("no-optimizer-shard-of-rank-1", delete(OPTIM_1), Status.INCOMPLETE,
     re.escape("no manifest; global_step6: optimizer shard of rank 1 missing (2 ranks)")),
    ("no-rng-state-0", delete("rng_state_0.pth"), Status.INCOMPLETE,
     re.escape("no manifest; RNG state file of rank 0 missing (2 ranks)")),
    ("no-model-states", delete("global_step6/mp_rank_00_model_states.pt"), Status.INCOMPLETE,
     "no manifest; global_step6: no model states file"),
    ("no-latest", delete("latest"), Status.INCOMPLETE,
     "no manifest; DeepSpeed tag directory without a readable 'latest' file"),
    ("latest-names-missing-tag", write("latest", b"global_step99"), Status.CORRUPT,
     "'latest' names DeepSpeed tag global_step99, not global_step6 of this checkpoint"),
    ("latest-names-dotdot-path", write("latest", b"../checkpoint-3/global_step3\n"), Status.INCOMPLETE,
     re.escape("no manifest; 'latest' names an invalid tag '../checkpoint-3/global_step3'")),
    ("latest-is-dotdot", write("latest", b".."), Status.INCOMPLETE,
     "no manifest; 'latest' names an invalid tag '..'"),
    ("tag-dir-symlinked-outside", tag_dir_symlinked_outside, Status.INCOMPLETE,
     "no manifest; 'latest' names global_step6, which is not a directory here"),
    ("rng-state-symlink", symlink_to_checkpoint_3("rng_state_1.pth"), Status.INCOMPLETE,
     "no manifest; rng_state_1.pth: a symlink, not a regular file: not trusted"),
    ("truncated-rng-state", truncate("rng_state_1.pth"), Status.INCOMPLETE,
     re.escape("no manifest; rng_state_1.pth: not a whole torch zip archive (truncated?)") + ".*"),
    ("truncated-optimizer-shard", truncate(OPTIM_1), Status.INCOMPLETE,
     re.escape(f"no manifest; {OPTIM_1}: not a whole torch zip archive (truncated?)") + ".*"),
    ("truncated-safetensors", truncate("model.safetensors", 300_000), Status.INCOMPLETE,
     r"no manifest; model\.safetensors: tensors end at byte \d+ but the file has 300000 \(truncated\?\)"),
    ("zero-byte-scheduler", truncate("scheduler.pt", 0), Status.INCOMPLETE,
     "no manifest; scheduler.pt: empty file"),
    ("zero-byte-safetensors", truncate("model.safetensors", 0), Status.INCOMPLETE,
     "no manifest; model.safetensors: 0 bytes: too short for a safetensors header"),
    ("zero-byte-config", truncate("config.json", 0), Status.INCOMPLETE,
     "no manifest; config.json: not valid JSON.*"),
    ("trainer-state-garbage", write("trainer_state.json", b"\x00\x93garbage{"), Status.CORRUPT,
     "trainer_state.json unreadable: .*"),
    ("trainer-state-zero-byte", truncate("trainer_state.json", 0), Status.CORRUPT,
     "trainer_state.json unreadable: .*"),
    ("trainer-state-not-an-object", write("trainer_state.json", b"[6]"), Status.CORRUPT,
     "trainer_state.json global_step None != directory step 6"),
    ("global-step-mismatch", lambda c: set_global_step(c, 5), Status.CORRUPT,
     "trainer_state.json global_step 5 != directory step 6"),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize(("brk", "status", "reason"), [p[1:] for p in PLAIN_BREAKS],
                         ids=[p[0] for p in PLAIN_BREAKS])
def test_broken_plain_checkpoint(plain_zero2_run: Path, copy_run: Callable[[Path], Path], brk: Break,
                                 status: Status, reason: str) -> None:
    out = copy_run(plain_zero2_run)
    assert_passed_over(broken_run(out, brk), out, status, reason, Status.UNVERIFIED)


@pytest.mark.deepspeed
def test_plain_checkpoint_missing_last_ranks_rng_state(plain_zero2_run: Path,
                                                       copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(plain_zero2_run)
    res = broken_run(out, delete("rng_state_1.pth"))
    assert res.checkpoints[0].status is Status.INCOMPLETE, res.checkpoints[0].reason


@pytest.mark.deepspeed
def test_deeply_nested_trainer_state_is_corrupt(plain_zero2_run: Path,
                                                copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(plain_zero2_run)
    nested = b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH
    res = broken_run(out, write("trainer_state.json", nested))
    assert res.checkpoints[0].status is Status.CORRUPT


# ------------------------------------------------------- broken copies of a JitTrainer (manifest) run


JIT_BREAKS: list[tuple[str, Break, Status, str]] = [
    ("sentinel-with-manifest", write(SENTINEL_NAME, b"x"), Status.INCOMPLETE,
     f"{SENTINEL_NAME} present: the save did not finish"),
    ("listed-file-deleted", delete(OPTIM_1), Status.CORRUPT, f"{OPTIM_1} is missing"),
    ("listed-file-truncated", truncate("model.safetensors", 1000), Status.CORRUPT,
     r"model.safetensors has 1000 bytes, manifest says \d+"),
    ("listed-file-zero-bytes", truncate("rng_state_1.pth", 0), Status.CORRUPT,
     r"rng_state_1.pth has 0 bytes, manifest says \d+"),
    ("listed-file-grown", write("latest", b"global_step6\n\n"), Status.CORRUPT,
     "latest has 14 bytes, manifest says 12"),
    ("listed-file-is-symlink", symlink_to_checkpoint_3("latest"), Status.CORRUPT,
     re.escape("latest is a symlink, not a regular file")),
    ("trainer-state-garbage", then_reseal(write("trainer_state.json", b"\x00\x93garbage{")), Status.CORRUPT,
     "trainer_state.json unreadable: .*"),
    ("trainer-state-missing", then_reseal(delete("trainer_state.json")), Status.CORRUPT,
     re.escape("manifest does not list trainer_state.json")),
    ("global-step-mismatch", then_reseal(lambda c: set_global_step(c, 5)), Status.CORRUPT,
     "trainer_state.json global_step 5 != directory step 6"),
    ("manifest-garbage", write(MANIFEST_NAME, b'{"format": "slurm-jit-checkpoint", "files": {'),
     Status.CORRUPT, "manifest unreadable: .*"),
    ("manifest-not-ours", write(MANIFEST_NAME, b'{"format": "other"}'), Status.CORRUPT,
     "manifest is not a slurm-jit manifest"),
    ("manifest-future-version", edit_manifest(lambda m: m.update(version=99)), Status.CORRUPT,
     re.escape("manifest version 99 not supported (want one of (1, 2))")),
    ("manifest-without-files", edit_manifest(lambda m: m.pop("files")), Status.CORRUPT,
     "manifest lacks files or step"),
    ("manifest-step-mismatch", edit_manifest(lambda m: m.update(step=3)), Status.CORRUPT,
     "manifest step 3 != directory step 6"),
    ("manifest-entry-malformed", edit_manifest(lambda m: m["files"].update(latest={"size": "12"})),
     Status.CORRUPT, "manifest entry for latest is malformed"),
    ("manifest-path-dotdot", escape_file_beside, Status.CORRUPT,
     re.escape("manifest path '../escape.bin' escapes the checkpoint")),
    ("manifest-path-absolute", edit_manifest(add_entry("/etc/passwd", Path("/etc/passwd"))), Status.CORRUPT,
     re.escape("manifest path '/etc/passwd' escapes the checkpoint")),
    ("manifest-path-inner-dotdot",
     lambda c: edit_manifest(add_entry(INNER_DOTDOT, c.parent / "checkpoint-3" / "latest"))(c),
     Status.CORRUPT, re.escape(f"manifest path '{INNER_DOTDOT}' escapes the checkpoint")),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize(("brk", "status", "reason"), [p[1:] for p in JIT_BREAKS],
                         ids=[p[0] for p in JIT_BREAKS])
def test_broken_jit_checkpoint(jit_zero2_run: Path, copy_run: Callable[[Path], Path], brk: Break,
                               status: Status, reason: str) -> None:
    out = copy_run(jit_zero2_run)
    assert_passed_over(broken_run(out, brk), out, status, reason, Status.COMPLETE)


@pytest.mark.deepspeed
def test_same_size_byte_flip_needs_deep(jit_zero2_run: Path, copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    path = out / "checkpoint-6" / OPTIM_1
    flip_middle_byte(path, 0x01)
    shallow = protocol.inspect(out / "checkpoint-6", 6)
    assert (shallow.status, shallow.reason) == (Status.COMPLETE, "")
    seen: list[int] = []
    deep = protocol.inspect(out / "checkpoint-6", 6, deep=True, progress=seen.append)
    assert (deep.status, deep.reason) == (Status.CORRUPT, f"{OPTIM_1} checksum mismatch")
    assert sum(seen) > 0  # deep really read files
    assert protocol.inspect(out / "checkpoint-3", 3, deep=True).status is Status.COMPLETE


@pytest.mark.deepspeed
def test_listed_files_under_a_symlinked_directory_are_corrupt(jit_zero2_run: Path,
                                                              copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    res = broken_run(out, tag_dir_symlinked_outside)
    assert res.checkpoints[0].status is Status.CORRUPT, res.checkpoints[0]


# ---------------------------------------------------------------- the checkpoint directory itself a symlink


@pytest.mark.deepspeed
def test_checkpoint_directory_symlinks_are_never_trusted(jit_zero2_run: Path, tmp_path: Path,
                                                         copy_run: Callable[[Path], Path]) -> None:
    out = copy_run(jit_zero2_run)
    outside = restep(out / "checkpoint-6", tmp_path / "elsewhere" / "checkpoint-9", 9)
    assert protocol.inspect(outside, 9, deep=True).status is Status.COMPLETE  # whole: only the link is wrong
    (out / "checkpoint-9").symlink_to(outside)
    (out / "checkpoint-12").symlink_to(out / "checkpoint-12")  # a loop onto itself
    (out / "checkpoint-15").symlink_to(out / "checkpoint-18")  # a loop of two
    (out / "checkpoint-18").symlink_to(out / "checkpoint-15")
    (out / "checkpoint-21").symlink_to(tmp_path / "nowhere")  # dangling
    res = protocol.find_resumable(out, deep=True)
    why = "the checkpoint directory is a symlink: not trusted"
    assert [(c.step, c.status, c.reason) for c in res.passed_over] == [
        (step, Status.CORRUPT, why) for step in (21, 18, 15, 12, 9)]
    assert res.checkpoint is not None and res.checkpoint.path == out / "checkpoint-6"


# ---------------------------------------------------------------- quarantine


def test_quarantine_path_never_reuses_a_name(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-6"
    assert protocol.quarantine_path(ckpt) == tmp_path / "checkpoint-6.incomplete"
    (tmp_path / "checkpoint-6.incomplete").mkdir()
    (tmp_path / "checkpoint-6.incomplete.1").touch()
    assert protocol.quarantine_path(ckpt) == tmp_path / "checkpoint-6.incomplete.2"


# ---------------------------------------------------------------- the write side


def test_write_manifest_refuses_without_a_sentinel(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-6"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"global_step": 6}')
    with pytest.raises(protocol.ProtocolError, match="no sentinel; write_sentinel"):
        protocol.write_manifest(ckpt, step=6, kind="jit", world_size=1, zero_stage=None, deepspeed_tag=None,
                                files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
    assert not (ckpt / MANIFEST_NAME).exists()
    assert protocol.inspect(ckpt, 6).status is Status.INCOMPLETE


def test_write_manifest_rejects_an_unknown_kind(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-6"
    protocol.write_sentinel(ckpt, 6, "jit")
    with pytest.raises(protocol.ProtocolError, match="unknown save kind 'preempt'"):
        protocol.write_manifest(ckpt, step=6, kind="preempt", world_size=1, zero_stage=None,
                                deepspeed_tag=None, files={})
    assert (ckpt / SENTINEL_NAME).exists() and not (ckpt / MANIFEST_NAME).exists()


@pytest.mark.deepspeed
def test_sentinel_then_manifest_round_trip(plain_zero2_run: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "out" / "checkpoint-6"
    protocol.write_sentinel(ckpt, 6, "jit")
    assert protocol.inspect(ckpt, 6).status is Status.INCOMPLETE
    shutil.copytree(plain_zero2_run / "checkpoint-6", ckpt, dirs_exist_ok=True)  # the ranks write their files
    assert protocol.inspect(ckpt, 6).status is Status.INCOMPLETE  # still: the sentinel decides
    rels = protocol.payload_files(ckpt)
    assert SENTINEL_NAME not in rels and OPTIM_1 in rels and "trainer_state.json" in rels
    written = protocol.write_manifest(ckpt, step=6, kind="jit", world_size=2, zero_stage=2,
                                      deepspeed_tag="global_step6", files=protocol.file_entries(ckpt, rels))
    assert sorted(os.listdir(ckpt)) == sorted({rel.split("/")[0] for rel in rels} | {MANIFEST_NAME})
    on_disk = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert on_disk == written
    assert {k: on_disk[k] for k in ("format", "version", "step", "kind", "world_size", "zero_stage",
                                    "deepspeed_tag")} == {
        "format": protocol.MANIFEST_FORMAT, "version": protocol.FORMAT_VERSION, "step": 6, "kind": "jit",
        "world_size": 2, "zero_stage": 2, "deepspeed_tag": "global_step6"}
    assert sorted(on_disk["files"]) == rels
    assert on_disk["total_bytes"] == sum(e["size"] for e in on_disk["files"].values())
    info = protocol.inspect(ckpt, 6, deep=True)
    assert (info.status, info.kind, info.reason) == (Status.COMPLETE, "jit", "")
