"""``complete`` means resumable (issue 7 items 3 and 8): the structural checks run on manifested checkpoints too,
a save_only_model checkpoint is ``model-only`` and never picked, and a DeepSpeed tag of another step (transformers'
own JIT checkpoint writes global_step<S+1> into checkpoint-S) is refused. Crafted directories, milliseconds."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import ckpt_factory
import pytest
from ckpt_factory import run_ckpt_check

from slurm_jit.checkpoint import ckpt_check, protocol
from slurm_jit.checkpoint.protocol import MANIFEST_NAME, Status

HOUR_S = 3600.0
OFF_BY_ONE = ("'latest' names DeepSpeed tag global_step7, not global_step6 of this checkpoint. HINT: transformers' "
              "enable_jit_checkpoint writes the next step's engine state (global_step<step+1>) into "
              "checkpoint-<step>; resume from an older checkpoint or start fresh")


def older_full_and(out: Path) -> Path:
    """A full checkpoint-4 written an hour ago: what resume must fall back to."""
    t = time.time() - HOUR_S
    return ckpt_factory.checkpoint(out, 4, created=t, mtime=t)


# ---------------------------------------------------------------- item 3: model-only is never resumed


@pytest.mark.parametrize("manifest", [True, False], ids=["v2-manifest", "plain"])
def test_save_only_model_checkpoint_is_model_only(tmp_path: Path, manifest: bool) -> None:
    full = older_full_and(tmp_path)
    extra = {"contents": protocol.CONTENTS_MODEL_ONLY} if manifest else {}
    ckpt_factory.checkpoint(tmp_path, 6, manifest=manifest, model_only=True, **extra)
    res = protocol.find_resumable(tmp_path)
    newest = res.checkpoints[0]
    assert (newest.step, newest.status) == (6, Status.MODEL_ONLY), newest
    assert newest.reason.endswith("model weights whole, no optimizer/RNG state to resume")
    assert res.checkpoint is not None and res.checkpoint.path == full
    run = run_ckpt_check(tmp_path)
    assert run.code == ckpt_check.EXIT_RESUMABLE and run.last_line == bytes(full)
    assert b"model-only" in run.stdout


def test_version_1_manifest_without_optimizer_is_never_complete(tmp_path: Path) -> None:
    # what JitTrainer wrote with save_only_model=True before: a version-1 manifest over weights only
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, model_only=True)
    ckpt_factory.edit_manifest(ckpt, version=1, contents=None)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    del manifest["contents"], manifest["run_id"]
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    info = protocol.inspect(ckpt, 6)
    assert info.status is Status.MODEL_ONLY
    assert info.reason == ("weights only (no RNG state file (rng_state.pth)): model weights whole, no "
                           "optimizer/RNG state to resume")
    run = run_ckpt_check(tmp_path)
    assert run.code == ckpt_check.EXIT_NONE_RESUMABLE and run.last_line == b""


def test_deepspeed_save_only_model_with_a_manifest_is_not_resumable(tmp_path: Path) -> None:
    # JitTrainer's JIT save under DeepSpeed with save_only_model held only config.json and trainer_state.json
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, deepspeed=True, model_only=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", MANIFEST_NAME, "trainer_state.json"]
    info = protocol.inspect(ckpt, 6)
    assert (info.status, info.reason) == (
        Status.INCOMPLETE, "manifest verified but no RNG state file (rng_state.pth): cannot be resumed")


def test_manifested_checkpoint_without_optimizer_is_incomplete(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 6)
    (ckpt / "optimizer.pt").unlink()
    ckpt_factory.edit_manifest(ckpt, files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
    info = protocol.inspect(ckpt, 6)
    assert (info.status, info.reason) == (Status.INCOMPLETE,
                                          "manifest verified but no optimizer.pt: cannot be resumed")


def test_manifested_checkpoint_headers_are_checked(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 6)
    (ckpt / "optimizer.pt").write_bytes(b"PK not a zip")  # rewritten before the manifest: sizes agree with it
    ckpt_factory.edit_manifest(ckpt, files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
    info = protocol.inspect(ckpt, 6)
    assert info.status is Status.INCOMPLETE and "optimizer.pt: not a whole torch zip archive" in info.reason


def test_manifest_versions(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, run_id="lineage-1")
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert (manifest["version"], manifest["contents"], manifest["run_id"]) == (2, "full", "lineage-1")
    info = protocol.inspect(ckpt, 6)
    assert (info.status, info.run_id, info.world_size) == (Status.COMPLETE, "lineage-1", 1)
    ckpt_factory.edit_manifest(ckpt, version=1)
    assert protocol.inspect(ckpt, 6).status is Status.COMPLETE  # version 1 is still read
    for version, contents in ((3, "full"), (2, "weights"), (True, "full")):
        ckpt_factory.edit_manifest(ckpt, version=version, contents=contents)
        assert protocol.inspect(ckpt, 6).status is Status.CORRUPT, (version, contents)


def test_write_manifest_rejects_unknown_contents(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-6"
    protocol.write_sentinel(ckpt, 6, "jit")
    with pytest.raises(protocol.ProtocolError, match="unknown contents 'weights'"):
        protocol.write_manifest(ckpt, step=6, kind="jit", world_size=1, zero_stage=None, deepspeed_tag=None,
                                files={}, contents="weights")


def test_run_id_is_shown(tmp_path: Path) -> None:
    ckpt_factory.checkpoint(tmp_path, 6, run_id="3f2a9c1e-77")
    run = run_ckpt_check(tmp_path)
    row = run.stdout.decode().splitlines()[1]
    assert "  3f2a9c1e      1     -  full     ok" in row and "3f2a9c1e-" not in row, row  # run, world, zero, weights
    data = json.loads(run_ckpt_check(tmp_path, "--json").stdout)
    assert (data["checkpoints"][0]["run_id"], data["checkpoints"][0]["world_size"]) == ("3f2a9c1e-77", 1)


def test_manifest_weights_layout(tmp_path: Path) -> None:
    """The manifest says where the module weights are; ckpt-check shows it; an old manifest without the field
    means full (ZeRO-3: master-only, DeepSpeed's own layout); an unknown layout is not trusted."""
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, deepspeed=True, world=2)
    assert json.loads((ckpt / MANIFEST_NAME).read_text())["weights"] == protocol.WEIGHTS_FULL
    assert protocol.inspect(ckpt, 6).weights == protocol.WEIGHTS_FULL
    ckpt_factory.edit_manifest(ckpt, weights=protocol.WEIGHTS_MASTER_ONLY)
    info = protocol.inspect(ckpt, 6)
    assert (info.status, info.weights) == (Status.COMPLETE, protocol.WEIGHTS_MASTER_ONLY)
    run = run_ckpt_check(tmp_path, "--json")
    assert json.loads(run.stdout)["checkpoints"][0]["weights"] == protocol.WEIGHTS_MASTER_ONLY
    assert "  master   ok" in run_ckpt_check(tmp_path).stdout.decode().splitlines()[1]
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    for stage, layout in ((2, protocol.WEIGHTS_FULL), (3, protocol.WEIGHTS_MASTER_ONLY)):
        manifest.pop("weights", None)
        manifest["zero_stage"] = stage
        (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
        assert protocol.inspect(ckpt, 6).weights == layout, stage
    for bad in ("half", None, 1):
        ckpt_factory.edit_manifest(ckpt, weights=bad)
        info = protocol.inspect(ckpt, 6)
        assert info.status is Status.CORRUPT and "manifest weights" in info.reason, (bad, info)
    protocol.write_sentinel(tmp_path / "checkpoint-7", 7, "jit")
    with pytest.raises(protocol.ProtocolError, match="unknown weights layout 'half'"):
        protocol.write_manifest(tmp_path / "checkpoint-7", step=7, kind="jit", world_size=1, zero_stage=None,
                                deepspeed_tag=None, files={}, weights="half")


# ---------------------------------------------------------------- item 8: the DeepSpeed tag is this step's


def upstream_jit_checkpoint(out: Path, manifest: bool) -> Path:
    """checkpoint-6 holding global_step7 (what transformers' enable_jit_checkpoint writes mid-step)."""
    extra = {"deepspeed_tag": "global_step7"} if manifest else {}
    return ckpt_factory.checkpoint(out, 6, manifest=manifest, world=2, deepspeed=True, tag="global_step7", **extra)


@pytest.mark.parametrize("manifest", [False, True], ids=["plain", "manifest"])
def test_upstream_jit_checkpoint_is_refused(tmp_path: Path, manifest: bool) -> None:
    full = older_full_and(tmp_path)
    upstream_jit_checkpoint(tmp_path, manifest)
    res = protocol.find_resumable(tmp_path)
    newest = res.checkpoints[0]
    assert (newest.step, newest.status) == (6, Status.CORRUPT)
    expected = ("manifest DeepSpeed tag 'global_step7' is not global_step6 of this checkpoint" if manifest
                else OFF_BY_ONE)
    assert newest.reason == expected
    assert res.checkpoint is not None and res.checkpoint.path == full
    run = run_ckpt_check(tmp_path)
    assert run.code == ckpt_check.EXIT_RESUMABLE and run.last_line == bytes(full)


def test_latest_naming_another_step_than_the_manifest_is_refused(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, world=2, deepspeed=True)
    shutil.copytree(ckpt / "global_step6", ckpt / "global_step7")
    (ckpt / "latest").write_text("global_step7")
    ckpt_factory.edit_manifest(ckpt, files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
    info = protocol.inspect(ckpt, 6)
    assert (info.status, info.reason) == (Status.CORRUPT, OFF_BY_ONE)


def test_a_whole_deepspeed_checkpoint_is_complete(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, world=2, deepspeed=True)
    info = protocol.inspect(ckpt, 6, deep=True)
    assert (info.status, info.reason, info.world_size) == (Status.COMPLETE, "", 2)


@pytest.mark.parametrize("recorded", [None, "abc", [1], {"digest": "x"}, {"tensors": {"a.weight": 1}},
                                      {"tensors": ["a.weight"]}])
def test_malformed_frozen_fingerprint_is_corrupt_and_an_older_checkpoint_is_picked(
        tmp_path: Path, recorded: object) -> None:
    """A PEFT checkpoint's frozen_fingerprint (issue 19) that is not an object of name -> entry strings: ckpt-check
    says so and picks the older checkpoint, as the resume does. Before: ckpt-check called it resumable (exit 0)
    and the resume then refused it ("malformed")."""
    older = older_full_and(tmp_path)
    good = {"algorithm": "xxh3_128", "digest": "d", "count": 1, "tensors": {"a.weight": "float32[2]:ab"}}
    ckpt = ckpt_factory.checkpoint(tmp_path, 6, frozen_fingerprint=good)
    assert protocol.inspect(ckpt, 6).status is Status.COMPLETE
    ckpt_factory.edit_manifest(ckpt, frozen_fingerprint=recorded)
    info = protocol.inspect(ckpt, 6)
    assert info.status is Status.CORRUPT and "frozen_fingerprint malformed" in info.reason, info
    run = run_ckpt_check(tmp_path)
    assert run.code == ckpt_check.EXIT_RESUMABLE and run.last_line == bytes(older), run
    assert "Traceback" not in run.stderr


# ---------------------------------------------------------------- DeepSpeed without ZeRO (stage 0)


def _stage0(out: Path, step: int, *, shards: tuple[int, ...] = (), model_states: bool = True,
            stage: int = 0) -> Path:
    """A 2-rank DeepSpeed checkpoint as ZeRO stage 0 writes it: the optimizer in the model states file, no
    optimizer shard (a bf16 stage-0 run's optimizer writes one per rank: ``shards``)."""
    ckpt = out / f"checkpoint-{step}"
    protocol.write_sentinel(ckpt, step, "periodic")
    ckpt_factory.write_files(ckpt, step, world=2, deepspeed=True)
    tag = ckpt / f"global_step{step}"
    for rank in range(2):
        if rank not in shards:
            (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").unlink()
    if not model_states:
        (tag / "mp_rank_00_model_states.pt").unlink()
    protocol.write_manifest(ckpt, step=step, kind="periodic", world_size=2, zero_stage=stage,
                            deepspeed_tag=f"global_step{step}", files=protocol.file_entries(
                                ckpt, protocol.payload_files(ckpt)))
    return ckpt


def test_a_stage_0_checkpoint_without_optimizer_shards_is_complete(tmp_path: Path) -> None:
    """Found by a review: a DeepSpeed config with "stage": 0 wrote checkpoints that were never resumable
    ("optimizer shard of rank 0 missing"), and --resume started afresh."""
    ckpt = _stage0(tmp_path, 3)
    info = protocol.inspect(ckpt, 3)
    assert info.status is Status.COMPLETE, info.reason
    assert protocol.find_resumable(tmp_path).checkpoint.path == ckpt


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"stage": 2}, "optimizer shard of rank 0 missing (2 ranks)"),  # ZeRO-2 needs every rank's shard
    ({"shards": (0,)}, "optimizer shard of rank 1 missing (2 ranks)"),  # a bf16 stage-0 run writes every rank's
    ({"model_states": False}, "no model states file"),
], ids=["stage-2", "one-of-two-shards", "no-model-states"])
def test_a_stage_0_checkpoint_still_needs_what_its_layout_has(tmp_path: Path, kwargs: dict, why: str) -> None:
    info = protocol.inspect(_stage0(tmp_path, 3, **kwargs), 3)
    assert info.status is Status.INCOMPLETE and why in info.reason, info.reason
