"""A PEFT model's checkpoints: periodic and final saves in transformers' layout (the trainable adapter weights kept,
the frozen base left out: ``exclude_frozen_parameters``); JIT saves leave the adapters' module copy out too (their
fp32 master is in the optimizer shards), each as a zero-element placeholder, so that the JitTrainer resumes them
bitwise (rebuilt from the fp32 master) and a plain ``transformers.Trainer`` refuses them loudly (torch's size
mismatch) instead of resuming the adapters as built. The frozen base comes from the model as built (the PEFT
contract: the user's script loads it).

Real DeepSpeed ZeRO-2 on 2 CPU ranks, a tiny GPT-2 from a config wrapped in a LoRA adapter (``demo_train --lora``),
a real SIGTERM. One stopped run is resumed by each trainer and compared with the uninterrupted run. Before issue
19's PEFT layout, a JIT save of a LoRA model left out exactly the adapters with no placeholder and wrote the whole
frozen base; a plain Trainer (non-strict load for every PEFT model) then ran its first resumed step on the
adapters as built (loss 4.733044 vs 4.739069 in the review).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from jit_helpers import (
    START_TIMEOUT_S,
    StopResult,
    assert_jit_stop,
    assert_same_losses,
    losses,
    run_logged,
    start_demo,
)

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.manifest import FROZEN_FINGERPRINT
from slurm_jit.train import stop_record

MAX_STEPS = 10
SAVE_STEPS = 4  # one periodic save (checkpoint-4) before the stop: upstream's own save of a PEFT model
STOP_AT_STEP = 5  # each rank sends itself SIGTERM at the end of this step; kill_wait 0: the stop lands at 5 or 6
ARGS = ["--lora", "--zero-stage", "2", "--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS)]
LORA_MARK = ".lora_"  # PEFT's adapter parameter names: ...c_attn.lora_A.default.weight
REBUILT_LINE = "rebuilt from the fp32 master partitions"  # slim_save.load_slim's log line


@dataclass
class Stopped:
    out: Path  # the stopped run's OUT_DIR, before any resume
    ckpt: Path  # its JIT checkpoint
    step: int
    log: str  # what its ranks wrote


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Stopped:
    out = tmp_path_factory.mktemp("peft-stopped") / "out"
    run = run_logged(out, [*ARGS, "--signal-self-at-step", str(STOP_AT_STEP), "--kill-wait", "0"])
    record = stop_record.read(out)
    assert run.codes == [0, 0] and record is not None and record["state"] == "jit_stop", run.log[-4000:]
    step = int(record["step"])
    assert SAVE_STEPS < step < MAX_STEPS, step
    return Stopped(out=out, ckpt=Path(record["checkpoint"]), step=step, log=run.log)


@dataclass
class Resumed:
    losses: list[tuple[int, float]]  # every step's, the stopped run's first
    log: str  # what the resumed ranks wrote


def _resumed(stopped: Stopped, tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str]) -> Resumed:
    """A copy of the stopped run, resumed to the end with ``args``."""
    out = tmp_path_factory.mktemp(name) / "out"
    shutil.copytree(stopped.out, out, symlinks=True)
    result = run_logged(out, [*ARGS, "--resume", *args])
    assert result.codes == [0, 0], result.log[-4000:]
    return Resumed(losses=losses(out), log=result.log)


@pytest.fixture(scope="module")
def jit_resumed(stopped: Stopped, tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    return _resumed(stopped, tmp_path_factory, "peft-jit", [])


def _module_of(ckpt: Path, step: int) -> dict[str, object]:
    import torch

    states = torch.load(ckpt / f"global_step{step}" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    assert states["param_shapes"], "no param_shapes: zero_to_fp32 could not rebuild the adapters"
    return dict(states["module"])


@pytest.mark.deepspeed
def test_lora_jit_checkpoint_holds_adapter_placeholders_and_no_frozen_base_weight(stopped: Stopped) -> None:
    """The JIT checkpoint's model-states file holds a zero-element placeholder (shape [0], the adapter's dtype) per
    adapter weight and nothing of the base (nor the frozen embedding again under its tied name, lm_head.weight,
    which DeepSpeed's own exclusion keeps); ckpt-check --deep calls it complete. The periodic save is upstream's:
    the same keys with the adapters' values (weights: frozen-excluded). Before: the JIT save held the adapters."""
    ckpt = assert_jit_stop(stopped.out, StopResult(codes=[0, 0], stop_s=0.0, log=stopped.log),
                           weights=protocol.WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY)
    assert ckpt == stopped.ckpt
    module = _module_of(stopped.ckpt, stopped.step)
    assert module and all(LORA_MARK in name for name in module), sorted(module)
    shapes = {name: tuple(t.shape) for name, t in module.items()}  # type: ignore[attr-defined]
    assert set(shapes.values()) == {(0,)}, shapes
    states_bytes = (stopped.ckpt / f"global_step{stopped.step}" / "mp_rank_00_model_states.pt").stat().st_size
    # the file: DeepSpeed's bookkeeping (param_shapes, ds_config, ...), no adapter, no 32 KiB embedding
    assert states_bytes < 24 * 1024, states_bytes
    periodic = stopped.out / f"checkpoint-{SAVE_STEPS}"
    manifest = json.loads((periodic / protocol.MANIFEST_NAME).read_text())
    assert manifest["kind"] == "periodic" and manifest["weights"] == protocol.WEIGHTS_FROZEN_EXCLUDED, manifest
    saved = _module_of(periodic, SAVE_STEPS)
    assert set(saved) == set(module)
    assert all(t.numel() > 0 for t in saved.values()), sorted(saved)  # type: ignore[attr-defined]


@pytest.mark.deepspeed
def test_jit_trainer_resumes_a_lora_checkpoint_bitwise_with_the_adapters_rebuilt_from_the_fp32_master(
        stopped: Stopped, jit_resumed: Resumed, reference_losses: Callable[..., list[tuple[int, float]]]) -> None:
    """Every loss bitwise the uninterrupted run's; the adapters' placeholders were dropped and the adapters rebuilt
    from the optimizer shards' fp32 master partitions (one line per rank)."""
    assert f"/out/checkpoint-{stopped.step} (complete)" in jit_resumed.log, jit_resumed.log[-3000:]  # resuming
    assert REBUILT_LINE in jit_resumed.log, jit_resumed.log[-3000:]
    assert_same_losses(jit_resumed.losses, reference_losses(ARGS))


@pytest.mark.deepspeed
def test_plain_trainer_refuses_a_lora_jit_checkpoint_loudly_before_any_step(
        stopped: Stopped, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A plain transformers.Trainer loads a PEFT module non-strict; the placeholders make torch's load raise its size
    mismatch ("torch.Size([0])") on every rank: no step runs, the checkpoint is untouched. Before the placeholders
    (a JIT save without the adapters' module copy), it resumed silently on the adapters as built."""
    out = tmp_path_factory.mktemp("peft-plain") / "out"
    shutil.copytree(stopped.out, out, symlinks=True)
    ckpt = out / stopped.ckpt.name
    before, steps_before = _files_of(ckpt), losses(out)
    result = run_logged(out, [*ARGS, "--resume", "--trainer", "plain"])
    assert all(code != 0 for code in result.codes), (result.codes, result.log[-4000:])
    assert "size mismatch for base_model.model." in result.log and "torch.Size([0])" in result.log, \
        result.log[-4000:]
    assert losses(out) == steps_before
    assert _files_of(ckpt) == before


def _files_of(ckpt: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(ckpt)): (p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.rglob("*") if p.is_file()}


# Another adapter config on the checkpoint: (demo_train args, what the refusal names)
# (model_match.py compares the recorded parameters before the load: its words, not the module load's)
OTHER_ADAPTERS = {
    "rank": (["--lora-rank", "8"], "'base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight' has shape "
             "[4, 64] in the checkpoint and [8, 64] in this model"),
    "targets": (["--lora-targets", "c_attn,c_proj"], "'base_model.model.transformer.h.1.attn.c_attn.lora_A.default."
                "weight' in the checkpoint and 'base_model.model.transformer.h.0.attn.c_proj.lora_A.default.weight' "
                "in this model"),
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("change", sorted(OTHER_ADAPTERS))
def test_resume_with_another_lora_config_is_refused_in_one_line(
        stopped: Stopped, tmp_path_factory: pytest.TempPathFactory, change: str) -> None:
    """A LoRA of rank 8 on the rank-4 checkpoint (its adapters' shapes differ), or one with more target modules (its
    new adapters are not in the file): one line naming the first adapter, with a HINT, exit 2 on both ranks, the
    checkpoint untouched. Before: torch's size-mismatch traceback; DeepSpeed's own error on the partitions."""
    args, named = OTHER_ADAPTERS[change]
    out = tmp_path_factory.mktemp(f"peft-{change}") / "out"
    shutil.copytree(stopped.out, out, symlinks=True)
    ckpt = out / stopped.ckpt.name
    before = _files_of(ckpt)
    result = run_logged(out, [*ARGS, "--resume", *args])
    assert result.codes == [2, 2], result.log[-4000:]
    assert "Traceback" not in result.log, result.log[-4000:]
    refusals = [line for line in result.log.splitlines() if line.startswith("demo_train: slurm_jit: ")]
    assert len(refusals) == 2 and all(named in line and "HINT:" in line for line in refusals), refusals
    assert _files_of(ckpt) == before


@pytest.mark.deepspeed
def test_lora_model_resuming_a_slim_checkpoint_of_the_plain_model_is_refused_in_one_line(
        tmp_path: Path) -> None:
    """The LoRA-wrapped model on the unwrapped model's slim JIT checkpoint: its frozen base is in neither the saved
    module nor the optimizer's shards. One line with a HINT, exit 2; before, DeepSpeed's KeyError on both ranks."""
    out = tmp_path / "out"
    stop = run_logged(out, [*ARGS[1:], "--signal-self-at-step", str(STOP_AT_STEP), "--kill-wait", "0"])
    record = stop_record.read(out)
    assert stop.codes == [0, 0] and record is not None and record["state"] == "jit_stop", stop.log[-4000:]
    result = run_logged(out, [*ARGS, "--resume"])
    assert result.codes == [2, 2], result.log[-4000:]
    assert "Traceback" not in result.log, result.log[-4000:]
    # model_match.py refuses it before the load (the wrapped model has one optimizer group, the plain one had two);
    # the module load's own check ("does not fit this model ... 'base_model.model.lm_head.weight'") is its backstop
    refusals = [line for line in result.log.splitlines() if line.startswith("demo_train: slurm_jit: ")]
    assert len(refusals) == 2 and all("the checkpoint's optimizer has 2 parameter groups, this run's 1" in line
                                      and "HINT:" in line for line in refusals), refusals


@pytest.mark.deepspeed
def test_a_lora_checkpoint_on_another_world_size_is_refused_in_one_line(
        stopped: Stopped, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The 2-rank LoRA checkpoint resumed on 1 rank (the same samples per step): its frozen base is not in it, and
    converting such a checkpoint is untested: one line with a HINT, exit 2, before universal/ is written. Before:
    model_match's by-name check called every frozen base weight "not in the checkpoint (renamed, or another model)"."""
    out = tmp_path_factory.mktemp("peft-elastic") / "out"
    shutil.copytree(stopped.out, out, symlinks=True)
    ckpt = out / stopped.ckpt.name
    before = _files_of(ckpt)
    ranks = start_demo(out, [*ARGS, "--resume", "--batch-size", "4"], 1)
    assert ranks.wait(START_TIMEOUT_S) == [2], ranks.log(0)[-4000:]
    refusals = [line for line in ranks.log(0).splitlines() if "a PEFT checkpoint" in line]
    assert len(refusals) == 1 and "HINT: resume it on 2 ranks" in refusals[0], ranks.log(0)[-4000:]
    assert refusals[0].startswith(f"demo_train: slurm_jit: {ckpt}: a PEFT checkpoint"), refusals  # one prefix
    assert "Traceback" not in ranks.log(0)
    assert _files_of(ckpt) == before


# ---------------------------------------------------------------- the frozen weights' fingerprint (issue 19)

MAX_STATES_OVER_TRAINABLE = 1.1  # issue 19: a LoRA JIT save writes what changes, not the frozen base
OTHER_BASE_SEED = "43"  # --seed: the script builds the same architecture with other base weights


@pytest.mark.deepspeed
def test_lora_jit_checkpoint_records_the_frozen_base_fingerprint_and_holds_only_the_trainable_state(
        stopped: Stopped) -> None:
    """The JIT checkpoint's manifest records the fingerprint of every frozen tensor it left out (each of the base's
    parameters, the tied output layer under its first name), and its model-states file is at most 1.1x the
    trainable state a resume needs (the optimizer shards: the adapters' fp32 master weights and Adam moments).
    The whole checkpoint is at most 1.1x what a resume needs (the bench row bytes_over_needed_lora's measure: the
    manifest's total_bytes over bytes_needed_for_resume), with no weight bytes twice: before the placeholders the
    adapters' module copy made it 1.32x (bench). (Before b60953c: the model-states file held the whole base.)"""
    from slurm_jit.demo_train import build_model

    manifest = json.loads((stopped.ckpt / protocol.MANIFEST_NAME).read_text())
    recorded = manifest.get(FROZEN_FINGERPRINT)
    assert isinstance(recorded, dict), sorted(manifest)
    base = {name for name, _ in build_model("gpt2", 64, 2).named_parameters()}  # demo_train's default model
    assert recorded["count"] == len(recorded["tensors"]) == len(base), (recorded["count"], len(base))
    assert {n.removeprefix("base_model.model.").replace(".base_layer.", ".") for n in recorded["tensors"]} == base
    tag = stopped.ckpt / f"global_step{stopped.step}"
    trainable_state = sum(p.stat().st_size for p in tag.glob("*optim_states.pt"))
    states = (tag / "mp_rank_00_model_states.pt").stat().st_size
    assert states <= MAX_STATES_OVER_TRAINABLE * trainable_state, (states, trainable_state)
    assert manifest["bytes_weights_duplicate"] == 0, manifest["bytes_weights_duplicate"]
    assert manifest["total_bytes"] <= MAX_STATES_OVER_TRAINABLE * manifest["bytes_needed_for_resume"], manifest


@pytest.mark.deepspeed
def test_resume_with_another_base_model_is_refused_in_one_line_before_any_step(
        stopped: Stopped, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The script builds the base with another seed: the frozen weights it would supply are not those the adapters
    were trained on. One line naming how many frozen tensors differ and the first, with a HINT, exit 2 on both
    ranks, no step run, the checkpoint untouched. Before: the resume ran on the other base to the end."""
    out = tmp_path_factory.mktemp("peft-other-base") / "out"
    shutil.copytree(stopped.out, out, symlinks=True)
    ckpt = out / stopped.ckpt.name
    before, steps_before = _files_of(ckpt), losses(out)
    result = run_logged(out, [*ARGS, "--resume", "--seed", OTHER_BASE_SEED])
    assert result.codes == [2, 2], result.log[-4000:]
    assert "Traceback" not in result.log, result.log[-4000:]
    refusals = [line for line in result.log.splitlines() if line.startswith("demo_train: slurm_jit: ")]
    assert len(refusals) == 2, result.log[-4000:]
    assert all("frozen weights" in line and "frozen tensors differ from this model's" in line
               and "first: 'base_model.model." in line and "HINT:" in line for line in refusals), refusals
    assert losses(out) == steps_before
    assert _files_of(ckpt) == before


# ---------------------------------------------------------------- a checkpoint edited after the save


def _put_adapters_back(ckpt: Path, step: int) -> int:
    """Each placeholder of the model-states file replaced by a real tensor of the adapter's shape (zeros), the file
    rewritten and the checkpoint resealed (ckpt-check's command: its owner changed it on purpose); how many."""
    import subprocess
    import sys

    import torch

    path = ckpt / f"global_step{step}" / "mp_rank_00_model_states.pt"
    states = torch.load(path, map_location="cpu", weights_only=False)
    shapes = {name: tuple(shape) for group in states["param_shapes"] for name, shape in group.items()}
    module = states["module"]
    for name in module:
        module[name] = torch.zeros(shapes[name], dtype=module[name].dtype)
    torch.save(states, path)
    reseal = subprocess.run([sys.executable, "-m", "slurm_jit.launch.ckpt_check_command", "--reseal", str(ckpt)],
                            capture_output=True, text=True, check=False)
    assert reseal.returncode == 0, reseal.stdout + reseal.stderr
    return len(module)


@pytest.mark.deepspeed
def test_adapters_put_back_into_a_resealed_lora_jit_checkpoint_are_ignored_and_rebuilt_from_the_fp32_master(
        stopped: Stopped, tmp_path_factory: pytest.TempPathFactory,
        reference_losses: Callable[..., list[tuple[int, float]]]) -> None:
    """Real tensors (zeros) where the placeholders were, the checkpoint resealed (its manifest still says the
    adapters are only in the fp32 master): the resume rebuilds every adapter from the master, bitwise the
    uninterrupted run, and warns that the file's copy was ignored. Before: no rebuild, the first resumed step ran on
    the edited adapters (step 7: loss 4.733044 vs 4.732936), silently."""
    out = tmp_path_factory.mktemp("peft-edited") / "out"
    shutil.copytree(stopped.out, out, symlinks=True)
    edited = _put_adapters_back(out / stopped.ckpt.name, stopped.step)
    result = run_logged(out, [*ARGS, "--resume"])
    assert result.codes == [0, 0], result.log[-4000:]
    assert_same_losses(losses(out), reference_losses(ARGS))
    warned = [line for line in result.log.splitlines() if f"its module file holds {edited} of them" in line]
    assert len(warned) == 2 and "rebuilt from the fp32 master" in warned[0], result.log[-3000:]
