"""The ``universal/`` conversion inside ``checkpoint-S`` (issue 13) never changes the verdict on ``checkpoint-S``
itself: crafted directories (tests/helpers/ckpt_factory.py), milliseconds, no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import ckpt_factory

from slurm_jit.checkpoint import ckpt_check, elastic_plan, protocol
from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.train import elastic, refusals


def _half_conversion(ckpt: Path) -> Path:
    """What a SIGKILL during ds_to_universal leaves: the sentinel, and a .pt file cut off mid-write."""
    universal = elastic_plan.universal_dir(ckpt)
    protocol.write_sentinel(universal, 5, "jit")
    cut = universal / "global_step5" / "zero" / "lm_head.weight" / "fp32.pt"
    ckpt_factory.torch_like_zip(cut)
    cut.write_bytes(cut.read_bytes()[:20])  # a zip local header and nothing after it
    return universal


def test_a_half_written_conversion_leaves_the_original_complete_and_chosen(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    _half_conversion(ckpt)
    info = protocol.inspect(ckpt, 5, deep=True)
    assert info.status is protocol.Status.COMPLETE, info.reason
    run = ckpt_factory.run_ckpt_check(tmp_path, "--world-size", "1")
    assert run.code == 0 and run.last_line == os.fsencode(ckpt), run.stdout


def test_a_foreign_file_in_universal_does_not_make_the_original_corrupt(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    universal = elastic_plan.universal_dir(ckpt)
    universal.mkdir()
    os.mkfifo(universal / "pipe")  # not a regular file: the conversion's business, not the original's
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    assert not elastic_plan.universal_complete(ckpt, 5)


def test_universal_as_a_symlink_or_a_file_leaves_the_original_complete(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    elastic_plan.universal_dir(ckpt).symlink_to(tmp_path)
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    elastic_plan.universal_dir(ckpt).unlink()
    os.mkfifo(elastic_plan.universal_dir(ckpt))
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERT


def test_a_manifest_without_world_size_is_judged_by_its_files(tmp_path: Path) -> None:
    """The manifest's world_size missing: the RNG files say 2 ranks, so 1 rank is a conversion, not 'same'."""
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True, world_size=None)
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    decided = elastic_plan.plan(ckpt, 1)
    assert (decided.action, decided.written_by) == (elastic_plan.CONVERT, 2), decided
    assert elastic_plan.plan(ckpt, 2).action == elastic_plan.SAME


def test_a_deepspeed_checkpoint_whose_zero_stage_is_unknown_is_refused_on_another_world(tmp_path: Path) -> None:
    """No zero_stage in the manifest, or no manifest at all (a plain Trainer save): DeepSpeed's own load would
    fail with a traceback on another world size; one line with a HINT instead."""
    no_stage = ckpt_factory.checkpoint(tmp_path / "a", 5, world=2, deepspeed=True, zero_stage=None)
    plain = ckpt_factory.checkpoint(tmp_path / "b", 5, world=2, deepspeed=True, manifest=False)
    for ckpt in (no_stage, plain):
        refusal = refusals.resume_refusal(ckpt, world_size=1)
        assert refusal is not None and "HINT: resume with 2 ranks" in refusal and "\n" not in refusal, refusal
        assert refusals.resume_refusal(ckpt, world_size=2) is None
    undeepspeed = ckpt_factory.checkpoint(tmp_path / "c", 5, world=2, manifest=False)
    assert elastic_plan.plan(undeepspeed, 1).action == elastic_plan.DIRECT


def test_a_failed_conversion_is_one_line_and_the_original_stays_chosen(tmp_path: Path) -> None:
    """DeepSpeed's real converter on shards it cannot read (here: crafted, so unpicklable; in the field: another
    DeepSpeed's layout), for a manifest that does not record its world size: one line with a HINT, no traceback;
    the half conversion left behind changes nothing about the original (about 10 s: the converter imports torch)."""
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True, world_size=None)
    one_rank = SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None
    load_from, refusal, _ = elastic.prepare(str(ckpt), one_rank, manifest, convert_timeout_s=120.0)
    assert load_from is None and refusal is not None, refusal
    assert "conversion to DeepSpeed's universal format failed" in refusal and "HINT: resume with" in refusal
    assert "\n" not in refusal, refusal
    assert (elastic_plan.universal_dir(ckpt) / protocol.SENTINEL_NAME).is_file()
    assert protocol.find_resumable(tmp_path).checkpoint is not None
    assert protocol.inspect(ckpt, 5, deep=True).status is protocol.Status.COMPLETE


def test_the_global_batch_of_a_bf16_run_is_checked_too(tmp_path: Path) -> None:
    """Under bf16 DeepSpeed names the optimizer shards bf16_zero_pp_rank_<r>_...; the saved DeepSpeed config is
    read from the model states file (engine._common_checkpoint_state), so another global batch is still refused
    before converting. Real torch.save files with DeepSpeed's keys; the tensors are left out."""
    import torch

    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    tag = ckpt / "global_step5"
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True}}
    for rank in range(2):
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").rename(
            tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    torch.save({"module": {}, "ds_config": config, "ds_version": "0.19.8"}, tag / "mp_rank_00_model_states.pt")
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None
    half_the_batch = SimpleNamespace(world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    load_from, refusal, _ = elastic.prepare(str(ckpt), half_the_batch, manifest, convert_timeout_s=120.0)
    assert refusal is not None and "4 samples per optimizer step when written, 2 in this run" in refusal, refusal
    assert load_from is None and not elastic_plan.universal_dir(ckpt).exists()


def test_a_bad_world_size_for_ckpt_check_is_one_line_with_a_hint(tmp_path: Path) -> None:
    ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    for bad in ("0", "-1", "abc", str(10**9), "2.0", ""):
        run = ckpt_factory.run_ckpt_check(tmp_path, f"--world-size={bad}")
        assert run.code == ckpt_check.EXIT_USAGE and run.stdout == b"", (bad, run)
        assert len(run.stderr.splitlines()) == 1 and "HINT:" in run.stderr and "--world-size" in run.stderr, run


def _complete_universal(ckpt: Path, deepspeed_version: str, converted_from: object = True) -> None:
    """A finished conversion as elastic.ensure_universal writes it (crafted files), by ``deepspeed_version``;
    ``converted_from``: the record of the parent it was converted from (True: ``ckpt``'s manifest's digest)."""
    parent, _ = manifest_file.read(ckpt)
    assert parent is not None
    record = {elastic_plan.CONVERTED_FROM_KEY: elastic_plan.parent_digest(parent) if converted_from is True
              else converted_from}
    universal = elastic_plan.universal_dir(ckpt)
    protocol.write_sentinel(universal, 5, "jit")
    ckpt_factory.torch_like_zip(universal / "global_step5" / "zero" / "lm_head.weight" / "fp32.pt")
    elastic._link_trainer_files(ckpt, universal)
    (universal / elastic.LATEST_UNIVERSAL_NAME).write_text("global_step5")
    protocol.write_manifest(universal, step=5, kind="jit", world_size=2, zero_stage=2, deepspeed_tag="global_step5",
                            files=protocol.file_entries(universal, protocol.payload_files(universal)),
                            extra={elastic_plan.UNIVERSAL_OF_KEY: 2,
                                   elastic_plan.CONVERTER_VERSION_KEY: deepspeed_version,
                                   **({} if converted_from is None else record)})


def test_a_conversion_by_another_deepspeed_version_is_redone(tmp_path: Path) -> None:
    """A job requeued after a DeepSpeed upgrade: the universal layout is the converter's, so the copy written by
    another version is converted again instead of loaded (a failed load would repeat at every start)."""
    import importlib.metadata

    installed = importlib.metadata.version("deepspeed")
    ours = ckpt_factory.checkpoint(tmp_path / "a", 5, world=2, deepspeed=True)
    _complete_universal(ours, installed)
    assert elastic_plan.plan(ours, 1).action == elastic_plan.CONVERTED
    theirs = ckpt_factory.checkpoint(tmp_path / "b", 5, world=2, deepspeed=True)
    _complete_universal(theirs, "0.14.0")
    assert elastic_plan.plan(theirs, 1).action == elastic_plan.CONVERT


def test_a_universal_copy_of_another_checkpoint_5_is_not_loaded(tmp_path: Path) -> None:
    """checkpoint-5 replaced by another run's checkpoint-5 (rsync -a of a checkpoint from elsewhere onto it: new
    files, new manifest, the old universal/ left inside): the copy converted from the old one verifies on its own,
    but it is not this checkpoint's, so it is converted again instead of loaded (it would resume other weights)."""
    import importlib.metadata

    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    _complete_universal(ckpt, importlib.metadata.version("deepspeed"))
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERTED
    (ckpt / "trainer_state.json").unlink()  # rsync writes a new file and renames it over the old one
    protocol.write_sentinel(ckpt, 5, "periodic")
    ckpt_factory.write_files(ckpt, 5, world=2, deepspeed=True,
                             trainer_state={"global_step": 5, "log_history": [{"loss": 1.5, "step": 5}]})
    protocol.write_manifest(ckpt, step=5, kind="periodic", world_size=2, zero_stage=2, deepspeed_tag="global_step5",
                            files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
    assert protocol.inspect(ckpt, 5, deep=True).status is protocol.Status.COMPLETE
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERT


def test_a_universal_copy_whose_parent_record_is_missing_or_garbage_is_converted_again(tmp_path: Path) -> None:
    """A copy written before the record existed, or with a record that is not the digest of this checkpoint's
    manifest (edited, truncated, of another type): not known to be this checkpoint's, so converted again."""
    import importlib.metadata

    installed = importlib.metadata.version("deepspeed")
    for i, record in enumerate((None, "", "0" * 32, 12345, ["x"], {"files": {}})):
        ckpt = ckpt_factory.checkpoint(tmp_path / str(i), 5, world=2, deepspeed=True)
        _complete_universal(ckpt, installed, converted_from=record)
        assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERT, record


def test_the_size_counts_hard_linked_files_once(tmp_path: Path) -> None:
    """universal/ hard-links the Trainer's files of checkpoint-S (elastic._link_trainer_files): ckpt-check's size
    (and grace-calc's checkpoint bytes) count each file once; the converter's own files add their bytes."""
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    before = protocol.inspect(ckpt, 5).size_bytes
    assert before is not None and before > 0
    universal = elastic_plan.universal_dir(ckpt)
    universal.mkdir()
    elastic._link_trainer_files(ckpt, universal)
    assert any(f.stat().st_nlink == 2 for f in universal.iterdir())  # linked, not copied
    assert protocol.inspect(ckpt, 5).size_bytes == before
    (universal / "fp32.pt").write_bytes(b"x" * 1000)
    assert protocol.inspect(ckpt, 5).size_bytes == before + 1000


HOLD_LOCK = """
import fcntl, os, sys, time
from pathlib import Path
ckpt = Path(sys.argv[1])
fd = os.open(ckpt / "universal.lock", os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
(ckpt / "universal").mkdir()
(ckpt / "universal" / "checkpoint-is-incomplete.txt").write_text("converting")
(ckpt / "universal" / "being-written.pt").write_text("x")
print("held", flush=True)
time.sleep(60)
"""


def test_a_conversion_in_progress_elsewhere_is_waited_for_not_removed(tmp_path: Path) -> None:
    """Two runs with other output_dirs resuming the same checkpoint on 1 rank (a sweep branching from one
    checkpoint): the second took the first's conversion in progress for a killed one and removed it under the
    converter. It waits for the conversion lock instead (here held past its timeout: one line, nothing removed)."""
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ckpt)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        manifest, _ = manifest_file.read(ckpt)
        assert manifest is not None
        one_rank = SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=1)
        started = time.monotonic()
        load_from, refusal, _ = elastic.prepare(str(ckpt), one_rank, manifest, convert_timeout_s=1.0)
        assert time.monotonic() - started < 10.0
        assert load_from is None and refusal is not None and "\n" not in refusal, refusal
        assert "another process" in refusal and "HINT:" in refusal, refusal
        assert (elastic_plan.universal_dir(ckpt) / "being-written.pt").is_file()  # the other's, untouched
    finally:
        holder.kill()
        holder.wait()
