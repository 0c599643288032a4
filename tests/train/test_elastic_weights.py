"""An elastic resume loads the checkpoint's weights, all of them, and only that checkpoint's (issue 24, items 2 and
4): a parameter frozen in the resuming run and a persistent buffer get the checkpoint's values (DeepSpeed's
universal load fills the optimizer's parameters only), one the checkpoint holds no value for is refused, and a
universal copy converted from another checkpoint of the same step is converted again instead of loaded. What the
universal load cannot fill is refused before converting: a parameter trained now but frozen when written, one of
another shape, two trained tensors tied into one now.

Real DeepSpeed ranks on CPU: two 2-rank ZeRO-2 runs that differ only in the learning rate, each JIT-stopped at
step 5, shared by the tests (logging every 500 steps, so that their trainer_state.json are byte-identical; the
model has a persistent buffer that counts training batches: tests/helpers/demo_with_buffer.py). The resumes run
on 1 rank
and dump the state right after the load (``--dump-state-at 5``: demo_train's exactness dump, at on_train_begin),
which is compared with the checkpoint's. A third 2-rank run, with the embeddings frozen, serves the refusal of
unfreezing them. About 4 minutes on an idle 2-core machine (6 under load).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from demo_with_buffer import BUFFER_NAME
from jit_helpers import START_TIMEOUT_S, run_demo, start_demo

from slurm_jit.checkpoint import elastic_plan, protocol
from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.train import elastic

ARGS = ["--model", "llama", "--vocab", "96", "--width", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--kill-wait", "0", "--max-steps", "8", "--zero-stage", "2", "--targ", "logging_steps=500"]
LRS = ("3e-3", "1e-3")  # the two runs' only difference
STOP_AT = 4  # each 2-rank run signals itself after this step: its JIT checkpoint is checkpoint-5
STEP = STOP_AT + 1
# 1 rank takes both ranks' share (the global batch must stay); the state right after the load is dumped.
ONE_RANK = ["--batch-size", "4", "--resume", "--max-steps", str(STEP + 1), "--dump-state-at", str(STEP)]
EMBEDDINGS = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"
PROGRAM = [str(Path(__file__).resolve().parents[1] / "helpers" / "demo_with_buffer.py")]
pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two 2-rank runs, learning rates LRS, JIT-stopped at step 5 (started together: half the wall time)."""
    root = tmp_path_factory.mktemp("elastic-weights")
    outs = (root / "lr-a", root / "lr-b")
    ranks = [start_demo(out, [*ARGS, "--lr", lr, "--signal-self-at-step", str(STOP_AT)], 2, program=PROGRAM)
             for out, lr in zip(outs, LRS, strict=True)]
    try:
        for group in ranks:
            codes = group.wait(START_TIMEOUT_S)
            assert codes == [0, 0], group.log(0)[-4000:]
    finally:
        for group in ranks:  # the other run too, when one failed
            group.kill()
    return outs


def _masters(ckpt: Path) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master weight at the stop, put together from the ranks' ZeRO-2 partitions (not from
    the universal copy: the conversion is what is checked)."""
    tag = ckpt / f"global_step{STEP}"
    files = sorted(tag.glob("*_optim_states.pt"), key=lambda p: int(p.name.split("_")[3]))
    states = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    shapes = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["param_shapes"]
    masters = {}
    for group, group_shapes in enumerate(shapes):
        flat = torch.cat([s["single_partition_of_fp32_groups"][group] for s in states])
        offset = 0
        for name, shape in group_shapes.items():
            numel = int(torch.Size(shape).numel())
            masters[name] = flat[offset:offset + numel].view(shape)
            offset += numel
    return masters


def _loaded(out: Path) -> dict[str, torch.Tensor]:
    """The resumed rank's module state right after the load (demo_train's exactness dump)."""
    dump = torch.load(out / "exact-state" / f"step-{STEP}" / "rank0.pt", map_location="cpu", weights_only=False)
    return {key.split("/", 1)[1]: value for key, value in dump.items() if key.startswith("module/")}


def _differing(loaded: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """``name max|diff|`` of each wanted tensor the load did not give bit for bit."""
    return [f"{name} {(loaded[name].double() - value.double()).abs().max().item():.3g}"
            if name in loaded and loaded[name].shape == value.shape else f"{name} missing or reshaped"
            for name, value in want.items() if not (name in loaded and torch.equal(loaded[name], value))]


def test_a_parameter_frozen_on_resume_and_a_buffer_get_the_checkpoints_values(two_runs: tuple[Path, Path],
                                                                              tmp_path: Path) -> None:
    """Stopped on 2 ranks, resumed on 1 with the embeddings frozen: the universal load filled the optimizer's
    parameters only, so the embeddings (max |diff| 0.004) and the buffer stayed as built. Every parameter is now the
    checkpoint's fp32 master (the model is fp32: bit for bit), the buffer the saved module's."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(two_runs[0]), str(out)], check=True)
    log = run_demo(out, [*ARGS, "--lr", LRS[0], *ONE_RANK, "--freeze-embeddings"], 1, program=PROGRAM)
    assert "world size 2 -> 1" in log, log[-3000:]
    ckpt = out / f"checkpoint-{STEP}"
    want = _masters(ckpt)
    saved = torch.load(ckpt / f"global_step{STEP}" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)["module"]
    want[BUFFER_NAME] = saved[BUFFER_NAME]
    assert EMBEDDINGS in want and int(want[BUFFER_NAME]) == STEP  # one training batch per step on each rank
    loaded = _loaded(out)
    assert _differing(loaded, want) == [], log[-3000:]


def test_a_frozen_parameter_the_checkpoint_holds_no_value_for_is_refused_before_converting(
        two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """The embeddings frozen now, and neither held by the checkpoint's optimizer nor in its module (its model states
    rewritten, manifest entry too, as by a save whose optimizer did not hold them and that left frozen parameters
    out: DeepSpeed's exclude_frozen_parameters): the 1-rank resume ends with one line and a HINT, before any step,
    with nothing converted or saved."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(two_runs[0]), str(out)], check=True)
    ckpt = out / f"checkpoint-{STEP}"
    rel = f"global_step{STEP}/mp_rank_00_model_states.pt"
    states = torch.load(ckpt / rel, map_location="cpu", weights_only=False)
    states["param_shapes"] = [{k: v for k, v in g.items() if k != EMBEDDINGS} for g in states["param_shapes"]]
    states["module"].pop(EMBEDDINGS, None)
    torch.save(states, ckpt / rel)
    manifest = json.loads((ckpt / manifest_file.MANIFEST_NAME).read_text())
    manifest["files"].update(protocol.file_entries(ckpt, [rel]))
    (ckpt / manifest_file.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert protocol.inspect(ckpt, STEP, deep=True).status is protocol.Status.COMPLETE
    ranks = start_demo(out, [*ARGS, "--lr", LRS[0], *ONE_RANK, "--freeze-embeddings"], 1, program=PROGRAM)
    assert ranks.wait(START_TIMEOUT_S) == [2], ranks.log(0)[-3000:]
    lines = [line for line in ranks.log(0).splitlines() if line.startswith("demo_train: ")]
    # the by-name comparison before any conversion (model_match.pick_refusal) sees it first; elastic's own refusal
    # of an unsaved frozen tensor ("N tensors this run does not train") is its backstop
    assert len(lines) == 1 and f"this model's parameter '{EMBEDDINGS}' is not in the checkpoint" in lines[0], lines
    assert "HINT:" in lines[0], lines
    assert not (ckpt / elastic_plan.UNIVERSAL_DIR_NAME).exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [ckpt.name]
    assert not (out / "exact-state").exists()  # no load, no step


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run with the embeddings frozen (its optimizer does not hold them), JIT-stopped at step 5."""
    out = tmp_path_factory.mktemp("elastic-frozen") / "out"
    ranks = start_demo(out, [*ARGS, "--lr", LRS[0], "--signal-self-at-step", str(STOP_AT), "--freeze-embeddings"],
                       2, program=PROGRAM)
    try:
        assert ranks.wait(START_TIMEOUT_S) == [0, 0], ranks.log(0)[-4000:]
    finally:
        ranks.kill()
    return out


def test_a_parameter_frozen_when_written_and_trained_now_is_refused_before_converting(
        frozen_run: Path, tmp_path: Path) -> None:
    """Written with the embeddings frozen, resumed on 1 rank with them trained: the checkpoint holds no optimizer
    state for them, and DeepSpeed's universal load died after the conversion with a bare AssertionError traceback
    (``Steps [None, tensor(5.), ...] are not equal``). Now: one line with a HINT, before any conversion or step."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(frozen_run), str(out)], check=True)
    ckpt = out / f"checkpoint-{STEP}"
    ranks = start_demo(out, [*ARGS, "--lr", LRS[0], *ONE_RANK], 1, program=PROGRAM)
    assert ranks.wait(START_TIMEOUT_S) == [2], ranks.log(0)[-3000:]
    lines = [line for line in ranks.log(0).splitlines() if line.startswith("demo_train: ")]
    assert len(lines) == 1 and f"{EMBEDDINGS} is trained in this run but was not by the checkpoint's" in lines[0], \
        ranks.log(0)[-3000:]
    assert "HINT:" in lines[0] and "Traceback" not in ranks.log(0), lines
    assert not (ckpt / elastic_plan.UNIVERSAL_DIR_NAME).exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [ckpt.name]
    assert not (out / "exact-state").exists()


Tensors = list[tuple[tuple[str, ...], tuple[int, ...]]]  # (names, shape) of each tensor


def _prepare_one_rank(ckpt: Path, held: Tensors, unheld: Tensors = ()) -> tuple[str | None, str | None]:
    """elastic.prepare for 1 rank (as the JitTrainer calls it) with ``held``: what this run's optimizer holds, and
    ``unheld``: what it does not."""
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None
    one_rank = SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    load_from, refusal, _ = elastic.prepare(str(ckpt), one_rank, manifest, 120.0, held_now=held, unheld_now=unheld)
    return load_from, refusal


def _held_when_written(ckpt: Path) -> dict[str, tuple[int, ...]]:
    states = torch.load(ckpt / f"global_step{STEP}" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    return {name: tuple(shape) for group in states["param_shapes"] for name, shape in group.items()}


def test_a_tensor_tied_now_that_was_two_trained_tensors_is_refused(two_runs: tuple[Path, Path]) -> None:
    """The checkpoint's embeddings and LM head were two trained tensors; a run that ties them (one tensor, both
    names) would get one of the two trained values and drop the other: refused in one line, nothing converted."""
    ckpt = two_runs[0] / f"checkpoint-{STEP}"
    shapes = _held_when_written(ckpt)
    tied = (EMBEDDINGS, LM_HEAD)
    held = [(tied, shapes[EMBEDDINGS]), *(((n,), s) for n, s in shapes.items() if n not in tied)]
    load_from, refusal = _prepare_one_rank(ckpt, held)
    assert load_from is None and refusal is not None
    assert f"{EMBEDDINGS} and {LM_HEAD} are one tensor in this run" in refusal and "HINT:" in refusal, refusal
    assert "\n" not in refusal and not (ckpt / elastic_plan.UNIVERSAL_DIR_NAME).exists()


def test_a_parameter_of_another_shape_with_the_same_size_is_refused(two_runs: tuple[Path, Path]) -> None:
    """A parameter stored transposed now (as a Conv1D <-> Linear change in a library upgrade does), same name and
    size: DeepSpeed's universal load copies by element count and would load the wrong matrix silently."""
    ckpt = two_runs[0] / f"checkpoint-{STEP}"
    shapes = _held_when_written(ckpt)
    rows, cols = shapes[DOWN_PROJ]
    assert rows != cols
    held = [((n,), (cols, rows) if n == DOWN_PROJ else s) for n, s in shapes.items()]
    load_from, refusal = _prepare_one_rank(ckpt, held)
    assert load_from is None and refusal is not None
    assert f"{DOWN_PROJ} is {[cols, rows]} in this run but {[rows, cols]} in the checkpoint" in refusal, refusal
    assert "HINT:" in refusal and "\n" not in refusal and not (ckpt / elastic_plan.UNIVERSAL_DIR_NAME).exists()


def test_a_buffer_of_another_shape_is_refused_before_converting(two_runs: tuple[Path, Path]) -> None:
    """The persistent buffer saved as a scalar, this model's of shape [2]: refused in one line before converting
    (it was refused only after the conversion, at the load: up to convert_timeout_s spent first)."""
    ckpt = two_runs[0] / f"checkpoint-{STEP}"
    held = [((n,), s) for n, s in _held_when_written(ckpt).items()]
    load_from, refusal = _prepare_one_rank(ckpt, held, [((BUFFER_NAME,), (2,))])
    assert load_from is None and refusal is not None
    assert f"{BUFFER_NAME} is saved as [], this model's is [2]. HINT:" in refusal, refusal
    assert "\n" not in refusal and not (ckpt / elastic_plan.UNIVERSAL_DIR_NAME).exists()


def _rsync(source: Path, dest: Path) -> None:
    """``rsync -a source/ dest/``: each file written beside its target and renamed over it."""
    for path in sorted(source.rglob("*")):
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(exist_ok=True)
            continue
        temp = target.with_name(f".{target.name}.tmp")
        shutil.copy2(path, temp)
        os.replace(temp, target)


def test_another_runs_checkpoint_copied_over_a_converted_one_is_converted_again(
        two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Run A's checkpoint-5 converted for 1 rank, then run B's checkpoint-5 (another learning rate, the same
    trainer_state.json byte for byte) copied over it, universal/ left inside: the resume loads B's weights, not
    the stale conversion of A's."""
    run_a, run_b = two_runs
    name = f"checkpoint-{STEP}"
    state = manifest_file.TRAINER_STATE_NAME
    assert (run_a / name / state).read_bytes() == (run_b / name / state).read_bytes()  # what fooled the old check
    out = tmp_path / "out"
    subprocess.run(["cp", "-a", str(run_a), str(out)], check=True)
    ckpt = out / name
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None
    one_rank = SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    load_from, refusal, _ = elastic.prepare(str(ckpt), one_rank, manifest, convert_timeout_s=120.0)
    assert refusal is None and load_from == str(elastic_plan.universal_dir(ckpt)), refusal
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERTED
    _rsync(run_b / name, ckpt)
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERT
    log = run_demo(out, [*ARGS, "--lr", LRS[1], *ONE_RANK], 1, program=PROGRAM)
    assert "removing the unfinished conversion" in log, log[-3000:]
    want, stale = _masters(run_b / name), _masters(run_a / name)
    assert _differing(want, stale)  # the learning rate made a difference
    assert _differing(_loaded(out), want) == [], log[-3000:]
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERTED


def test_a_checkpoint_copied_over_during_its_conversion_is_refused_and_converted_again_later(
        two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Run B's checkpoint-5 copied over run A's while A's is being converted: the copy is of neither, so that
    start is refused in one line (HINT: start again); the conversion keeps its sentinel and the next start
    converts again (the conversion's own time, no DeepSpeed run)."""
    run_a, run_b = two_runs
    ckpt = tmp_path / f"checkpoint-{STEP}"
    subprocess.run(["cp", "-a", str(run_a / ckpt.name), str(ckpt)], check=True)
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None
    copied: list[float] = []

    def copy_once(elapsed_s: float) -> None:  # called while the converter runs
        if not copied:
            copied.append(elapsed_s)
            _rsync(run_b / ckpt.name, ckpt)

    one_rank = SimpleNamespace(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    load_from, refusal, _ = elastic.prepare(str(ckpt), one_rank, manifest, convert_timeout_s=120.0,
                                            heartbeat=copy_once)
    assert copied and load_from is None and refusal is not None, refusal
    assert "changed while it was being converted" in refusal and "HINT: start again" in refusal, refusal
    assert "\n" not in refusal
    assert (elastic_plan.universal_dir(ckpt) / protocol.SENTINEL_NAME).is_file()
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERT
