"""An async periodic save is committed by rank 0 only once every rank's done marker exists (issue #23): the manifest
lists the markers' entries and the files written synchronously, the markers are gone, the sentinel removed last;
a missing or lying marker leaves the checkpoint incomplete (sentinel kept, no manifest), never corrupt. Real files,
the protocol's own manifest writer. Also: the flag's default and its refusals."""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from disk_helpers import fill, tmpfs
from safetensors.torch import save_file

from slurm_jit.checkpoint import manifest, protocol
from slurm_jit.train.async_save import commit, periodic
from slurm_jit.train.async_save.periodic import CollectingEngine
from slurm_jit.train.jit_config import JitConfig
from slurm_jit.train.refusals import JitRefusal
from slurm_jit.train.trainer import JitTrainer

STEP = 5
SHORT_WAIT_S = 0.3  # the deadline for a marker that never comes
LONG_WAIT_S = 30.0  # a deadline the test must not reach
RACE_S = 2.0  # how long a rank's fsync of the tree races another rank's marker writes (thousands of rounds)


def _checkpoint(tmp_path: Path) -> Path:
    """checkpoint-5 mid-save: the sentinel, the small files (synchronous), each rank's big file (background)."""
    ckpt = tmp_path / f"checkpoint-{STEP}"
    protocol.write_sentinel(ckpt, STEP, "periodic")
    (ckpt / protocol.TRAINER_STATE_NAME).write_text('{"global_step": 5}')
    (ckpt / "rng_state_0.pth").write_bytes(b"rng0")
    (ckpt / "rng_state_1.pth").write_bytes(b"rng1")
    (ckpt / "global_step5").mkdir()
    for rank in (0, 1):
        (ckpt / "global_step5" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes([rank]) * 99)
    return ckpt


def _mark(ckpt: Path, rank: int) -> None:
    rel = f"global_step5/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    commit.write_marker(ckpt, rank, protocol.file_entries(ckpt, [rel]))


def _seal(ckpt: Path, files: dict[str, dict[str, Any]]) -> int:
    written = protocol.write_manifest(ckpt, step=STEP, kind="periodic", world_size=2, zero_stage=2,
                                      deepspeed_tag="global_step5", files=files)
    return int(written["total_bytes"])


def test_every_marker_present_commits_the_manifest_of_every_file(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    _mark(ckpt, 0)
    _mark(ckpt, 1)
    nbytes = commit.commit(ckpt, 2, SHORT_WAIT_S, functools.partial(_seal, ckpt))
    written, why = manifest.read(ckpt)
    assert written is not None, why
    assert sorted(written["files"]) == sorted(protocol.payload_files(ckpt)) == [
        "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_0.pth", "rng_state_1.pth",
        protocol.TRAINER_STATE_NAME]
    assert written["files"] == protocol.file_entries(ckpt, sorted(written["files"]))  # true sizes and hashes
    assert nbytes == sum(e["size"] for e in written["files"].values())
    assert not (ckpt / protocol.SENTINEL_NAME).exists()
    assert not list(ckpt.glob(f"{commit.MARKER_PREFIX}*")), "markers left in a committed checkpoint"


@pytest.mark.parametrize("present", [[], [0], [1]])
def test_a_missing_marker_leaves_it_incomplete(tmp_path: Path, present: list[int]) -> None:
    ckpt = _checkpoint(tmp_path)
    for rank in present:
        _mark(ckpt, rank)
    missing = [r for r in (0, 1) if r not in present]
    with pytest.raises(commit.CommitError, match=re.escape(f"rank(s) {missing} did not report")) as err:
        commit.commit(ckpt, 2, SHORT_WAIT_S, functools.partial(_seal, ckpt), poll_s=0.01)
    assert "\n" not in str(err.value) and "HINT:" in str(err.value)
    assert not (ckpt / protocol.MANIFEST_NAME).exists()
    assert (ckpt / protocol.SENTINEL_NAME).exists()
    assert protocol.inspect(ckpt, STEP).status is protocol.Status.INCOMPLETE  # markers are not corruption


def test_a_ranks_failed_marker_stops_the_commit_at_once_not_at_the_deadline(tmp_path: Path) -> None:
    # A rank whose background write failed (its thread alone) wrote a failed marker: rank 0 used to wait for its
    # done marker until the deadline (300 s at least) while training went on.
    ckpt = _checkpoint(tmp_path)
    _mark(ckpt, 0)
    commit.write_failed_marker(ckpt, 1, "slurm_jit: the background write of x failed: OSError: boom. HINT: h\nmore")
    t0 = time.monotonic()
    with pytest.raises(commit.CommitError, match=r"rank 1's background write failed \(slurm_jit: .*boom") as err:
        commit.commit(ckpt, 2, LONG_WAIT_S, functools.partial(_seal, ckpt), poll_s=0.01)
    assert time.monotonic() - t0 < LONG_WAIT_S / 10
    assert "\n" not in str(err.value) and "HINT:" in str(err.value)
    assert (ckpt / protocol.SENTINEL_NAME).exists() and not (ckpt / protocol.MANIFEST_NAME).exists()
    assert protocol.inspect(ckpt, STEP).status is protocol.Status.INCOMPLETE  # a failed marker is no corruption
    assert commit.failed_marker_path(ckpt, 1).name not in protocol.payload_files(ckpt)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("partial", [True, False])
def test_a_failed_marker_appears_on_a_full_disk(tmp_path: Path, partial: bool) -> None:
    # The background write failed because the disk is full: the failed marker must still appear, or rank 0 waits
    # for the deadline. Its own partial files are removed first (room for the reason); with none, an empty marker.
    with tmpfs(tmp_path / "full", 512 * 1024) as mount:
        ckpt = _checkpoint(mount)
        own = ckpt / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        _mark(ckpt, 0)
        fill(mount)
        commit.write_failed_marker(ckpt, 1, "slurm_jit: x could not be written: no space. HINT: h",
                                   [own] if partial else [])
        assert commit.failed_marker_path(ckpt, 1).exists() and own.exists() is not partial
        reason = "no space" if partial else "no reason: its disk was full"
        with pytest.raises(commit.CommitError, match=f"rank 1's background write failed \\(.*{reason}"):
            commit.commit(ckpt, 2, LONG_WAIT_S, functools.partial(_seal, ckpt), poll_s=0.01)
        assert protocol.inspect(ckpt, STEP).status is protocol.Status.INCOMPLETE


def test_a_rank_fsyncing_its_tree_survives_another_ranks_marker_being_renamed_into_place(tmp_path: Path) -> None:
    # Each rank's thread fsyncs the whole checkpoint tree while the other ranks' threads write their markers (a
    # .tmp renamed into place) or a failed write's test file: a file gone between the listing and its open failed
    # the save (FileNotFoundError) on a rank whose own files were fine. Real files, real threads, for RACE_S.
    ckpt = _checkpoint(tmp_path)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            _mark(ckpt, 1)
            commit.marker_path(ckpt, 1).unlink()

    other = threading.Thread(target=churn, daemon=True)
    other.start()
    deadline = time.monotonic() + RACE_S
    try:
        while time.monotonic() < deadline:
            protocol.fsync_tree(ckpt)
    finally:
        stop.set()
        other.join(SHORT_WAIT_S * 10)


def test_a_share_is_removed_on_failure_only_before_its_marker_is_published(tmp_path: Path) -> None:
    """Issue #42 item 2: before rank 1's done marker, a failure removes its file and leaves a failed marker; after
    it (the marker's directory fsync, rank 0's commit or rotation failing), nothing is removed and the error says
    the files are kept: the checkpoint rank 0 commits stays complete."""
    ckpt = _checkpoint(tmp_path)
    own = ckpt / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    before = commit.Share(ckpt, 1, [own])
    before.failed("slurm_jit: the background write failed: OSError: EIO. HINT: h")
    assert not own.exists() and commit.failed_marker_path(ckpt, 1).exists()

    ckpt = _checkpoint(tmp_path / "again")
    rel = "global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    share = commit.Share(ckpt, 1, [ckpt / rel])
    with pytest.raises(commit.CheckpointWriteError) as caught, share.reported_once_published():
        share.publish(protocol.file_entries(ckpt, [rel]))
        raise OSError(5, "Input/output error")  # as the marker's directory fsync would
    share.failed(str(caught.value))
    assert "files are kept" in str(caught.value) and "\n" not in str(caught.value)
    assert (ckpt / rel).exists() and not commit.failed_marker_path(ckpt, 1).exists()
    _mark(ckpt, 0)
    commit.commit(ckpt, 2, LONG_WAIT_S, functools.partial(_seal, ckpt), poll_s=0.01)
    written, why = manifest.read(ckpt)
    assert written is not None and not (ckpt / protocol.SENTINEL_NAME).exists(), why
    assert written["files"][rel] == protocol.file_entries(ckpt, [rel])[rel]


def test_a_marker_naming_a_file_not_on_disk_is_not_committed(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    _mark(ckpt, 0)
    _mark(ckpt, 1)
    (ckpt / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(commit.CommitError, match="in a done marker but not on disk"):
        commit.commit(ckpt, 2, SHORT_WAIT_S, functools.partial(_seal, ckpt))
    assert (ckpt / protocol.SENTINEL_NAME).exists() and not (ckpt / protocol.MANIFEST_NAME).exists()


def test_a_marker_that_arrives_later_is_waited_for(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    _mark(ckpt, 0)
    calls = []

    def seal(files: dict[str, dict[str, Any]]) -> int:
        calls.append(files)
        return _seal(ckpt, files)

    late = threading.Timer(0.2, _mark, (ckpt, 1))
    late.start()
    try:
        commit.commit(ckpt, 2, 30.0, seal, poll_s=0.01)
    finally:
        late.join()
    assert len(calls) == 1 and protocol.inspect(ckpt, STEP).status is not protocol.Status.CORRUPT


def test_the_collecting_engine_collects_zip_saves_and_writes_legacy_ones(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine = TorchCheckpointEngine()
    engine.zipfile_serialization = True
    ckpt = tmp_path / "checkpoint-1"
    collector = CollectingEngine(engine, ckpt, save_file)
    state = {"w": torch.ones(3)}
    collector.save(state, str(ckpt / "a.pt"))
    assert collector.collected == [(ckpt / "a.pt", state)] and not (ckpt / "a.pt").exists()
    # the step-free key of a file (the staging buffer reused from save to save), its folder kept
    assert collector.key(ckpt / "global_step1" / "a.pt") == "global_step#/a.pt" != collector.key(ckpt / "a.pt")
    assert collector.key(ckpt / "ref" / "adapter_model.safetensors") == "ref/adapter_model.safetensors"
    assert collector.name == engine.name  # everything else is the original's
    collector.save(state, str(tmp_path / "elsewhere.pt"))  # not this checkpoint's file: written at once
    assert (tmp_path / "elsewhere.pt").exists() and len(collector.collected) == 1
    collector.save_safetensors({"w": torch.ones(2)}, str(tmp_path / "export.safetensors"))
    assert (tmp_path / "export.safetensors").exists() and len(collector.collected) == 1
    thread = threading.Thread(target=collector.save, args=(state, str(ckpt / "b.pt")))  # another thread's
    ckpt.mkdir()
    thread.start()
    thread.join(60)
    assert (ckpt / "b.pt").exists() and len(collector.collected) == 1
    engine.zipfile_serialization = False
    collector.save(state, str(ckpt / "legacy.pt"))
    assert (ckpt / "legacy.pt").exists() and len(collector.collected) == 1


def test_the_flag_is_off_by_default_and_must_be_a_bool() -> None:
    assert JitConfig().async_periodic_saves is False
    with pytest.raises(ValueError, match="async_periodic_saves='yes'. HINT"):
        JitConfig(async_periodic_saves="yes")  # type: ignore[arg-type]


def test_the_flag_without_deepspeed_is_refused_in_one_line(tmp_path: Path) -> None:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    with pytest.raises(JitRefusal, match=r"async_periodic_saves=True\) needs DeepSpeed") as err:
        JitTrainer(model=model, args=args, jit_config=JitConfig(async_periodic_saves=True))
    assert "\n" not in str(err.value) and "HINT:" in str(err.value)


def test_the_commit_gives_up_at_once_when_aborted(tmp_path: Path) -> None:
    """train() ended with a peer lost: rank 0's wait for that peer's marker stops at the abort, not the deadline."""
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    commit.write_marker(ckpt, 0, {})
    abort = threading.Event()
    abort.set()
    t0 = time.monotonic()
    with pytest.raises(commit.CommitError, match="peer lost") as caught:
        commit.wait_for_markers(ckpt, 2, timeout_s=60.0, abort=abort)
    assert time.monotonic() - t0 < 5.0 and "HINT:" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_the_flag_with_push_to_hub_is_refused_in_one_line(strategy: str) -> None:
    """Upstream's _save_checkpoint pushes the checkpoint's files (_push_from_checkpoint) as it returns: under an
    async save they are not written yet. A stand-in trainer: a real push_to_hub Trainer needs the Hub at __init__
    (create_repo), which this machine cannot reach."""
    from transformers.trainer_utils import HubStrategy  # noqa: PLC0415

    trainer = SimpleNamespace(jit_config=JitConfig(async_periodic_saves=True),
                              args=SimpleNamespace(push_to_hub=True, hub_strategy=HubStrategy(strategy)))
    why = periodic.refusal(trainer)  # type: ignore[arg-type]
    assert why is not None and "push_to_hub" in why and "HINT:" in why and "\n" not in why, why
    trainer.args.hub_strategy = HubStrategy.END  # pushes only at the end of training, after finish() waited
    trainer.is_deepspeed_enabled = False
    assert "needs DeepSpeed" in periodic.refusal(trainer)  # type: ignore[arg-type,operator]
