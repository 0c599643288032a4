"""A resume refuses a checkpoint of another model than the one it is loaded into: one line with a HINT on each rank,
before any step, the checkpoint untouched (train/model_match.py; the table: docs/resume-checks.md).

The DeepSpeed loads restore the fp32 master partitions by position, so without these checks a parameter of the same
size in another shape resumed silently with the wrong matrix and a resized embedding ended in SIGSEGV (issue 24).
Real DeepSpeed on 2 CPU ranks. Shared runs: one ZeRO-2 run stopped by a JIT signal (a periodic checkpoint-2 in
DeepSpeed's full layout, and the slim JIT checkpoint), one ZeRO-3 run stopped the same way; each test resumes a
copy with the model or engine changed as a user (or a library upgrade) would.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from jit_helpers import START_TIMEOUT_S, losses, run_logged, start_demo

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

BASE = ["--max-steps", "8", "--kill-wait", "0"]
PERIODIC_STEP = 2  # --save-steps: checkpoint-2 is a periodic save, DeepSpeed's full layout
STOP_AT = 3  # each rank signals itself after this step: the JIT checkpoint is the next boundary's (slim)
REFUSAL_PREFIX = "demo_train: slurm_jit: "  # demo_train prints a JitRefusal so, and exits 2
pytestmark = pytest.mark.deepspeed


def _stopped_run(out: Path, args: list[str]) -> Path:
    result = run_logged(out, [*BASE, *args, "--signal-self-at-step", str(STOP_AT)])
    assert result.codes == [0, 0], result.log[-4000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    return out


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _stopped_run(tmp_path_factory.mktemp("match-z2") / "out", ["--save-steps", str(PERIODIC_STEP)])


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _stopped_run(tmp_path_factory.mktemp("match-z3") / "out", ["--zero-stage", "3"])


def _checkpoint(out: Path, layout: str) -> Path:
    """The JIT checkpoint (``slim``: ZeRO-1/2 weights in the optimizer shards only) or checkpoint-2 (``full``)."""
    record = stop_record.read(out)
    assert record is not None
    ckpt = Path(record["checkpoint"]) if layout == "slim" else out / f"checkpoint-{PERIODIC_STEP}"
    manifest = json.loads((ckpt / protocol.MANIFEST_NAME).read_text())
    slim = layout == "slim" or manifest["zero_stage"] == 3  # ZeRO-3: every save is master-only
    expected = protocol.WEIGHTS_MASTER_ONLY if slim else protocol.WEIGHTS_FULL
    assert manifest["weights"] == expected, (ckpt, manifest["weights"])
    return ckpt


def _hashes(ckpt: Path, but: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under ``ckpt`` (``but``: not those under these top-level names)."""
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.relative_to(ckpt).parts[0] not in but}


def _refused(run: Path, tmp_path: Path, layout: str, args: list[str], world_size: int = 2,
             but: tuple[str, ...] = ()) -> str:
    """Resume a copy of ``run``'s ``layout`` checkpoint with ``args`` changed: every rank exits 2 with the same one
    refusal line, nothing was trained, the checkpoint is byte for byte what it was (``but``: names that may be
    added) and still complete. Returns the line."""
    out = tmp_path / "out"
    shutil.copytree(run, out, symlinks=True)
    ckpt = out / _checkpoint(run, layout).name
    before, trained = _hashes(ckpt), losses(out)
    ranks = start_demo(out, [*BASE, *args, "--resume-from", str(ckpt)], world_size)
    codes = ranks.wait(START_TIMEOUT_S)
    logs = [ranks.log(r) for r in range(world_size)]
    assert codes == [2] * world_size, logs[0][-4000:]
    lines = [[line for line in log.splitlines() if line.startswith(REFUSAL_PREFIX)] for log in logs]
    assert len(lines[0]) == 1 and all(other == lines[0] for other in lines), logs[0][-4000:]
    assert "HINT: " in lines[0][0] and not any("Traceback" in log for log in logs), logs[0][-4000:]
    assert losses(out) == trained, "a step ran before the refusal"
    assert _hashes(ckpt, but) == before, "the checkpoint resumed from was written to"
    info = protocol.inspect(ckpt, int(ckpt.name.rsplit("-", 1)[1]), deep=True)
    assert info.status is protocol.Status.COMPLETE, info
    return lines[0][0].removeprefix(REFUSAL_PREFIX)


@pytest.mark.parametrize("layout", ["slim", "full"])
def test_a_parameter_stored_transposed_is_refused(zero2_run: Path, tmp_path: Path, layout: str) -> None:
    """The same name and size, the other shape (Conv1D -> nn.Linear): before, the slim resume trained on with the
    wrong matrix and the full one ended in DeepSpeed's 'size mismatch' traceback."""
    line = _refused(zero2_run, tmp_path, layout, ["--variant", "transposed"])
    assert "'transformer.h.0.mlp.c_fc.weight' has shape [64, 256] in the checkpoint and [256, 64] in this model" \
        in line, line


def test_resized_embeddings_are_refused(zero2_run: Path, tmp_path: Path) -> None:
    """Vocabulary 128 -> 136: before, 'corrupted double-linked list' / SIGSEGV on both ranks."""
    line = _refused(zero2_run, tmp_path, "slim", ["--vocab", "136"])
    assert "'transformer.wte.weight' has shape [128, 64] in the checkpoint and [136, 64] in this model" in line


def test_untied_embeddings_are_refused(zero2_run: Path, tmp_path: Path) -> None:
    line = _refused(zero2_run, tmp_path, "slim", ["--untie-embeddings"])
    assert ("'lm_head.weight' was tied to 'transformer.wte.weight' in the checkpoint and is a parameter of its own "
            "in this model") in line and "tie_word_embeddings" in line, line


def test_a_renamed_module_is_refused_naming_it(zero2_run: Path, tmp_path: Path) -> None:
    line = _refused(zero2_run, tmp_path, "full", ["--variant", "renamed"])
    assert ("is 'transformer.h.0.mlp.c_proj.weight' in the checkpoint and 'transformer.h.0.mlp.proj_out.weight' in "
            "this model (renamed, or another model)") in line, line


def test_a_parameter_frozen_since_the_save_is_refused(zero2_run: Path, tmp_path: Path) -> None:
    """Held by the optimizer when written, frozen now: the flat partitions would be filled by position."""
    line = _refused(zero2_run, tmp_path, "slim", ["--freeze-embeddings"])
    assert "'transformer.wte.weight' is frozen in this run and was trained (held by the optimizer)" in line, line


def test_a_zero3_checkpoint_under_zero2_on_the_same_world_size_is_refused(zero3_run: Path, tmp_path: Path) -> None:
    """Before: a bare AssertionError traceback on both ranks."""
    line = _refused(zero3_run, tmp_path, "slim", ["--zero-stage", "2"])
    assert "written under ZeRO stage 3, and this run uses ZeRO stage 2" in line, line
    assert "HINT: resume with zero_optimization.stage 3 (as written)" in line, line


def test_a_zero3_checkpoint_under_zero2_on_another_world_size_is_refused_before_converting(
        zero3_run: Path, tmp_path: Path) -> None:
    """1 rank with the 2 ranks' global batch: before, converted to the universal format and then the same bare
    AssertionError (DeepSpeed's ZeRO-2 load looks for the ZeRO-1/2 model-states file)."""
    line = _refused(zero3_run, tmp_path, "slim", ["--zero-stage", "2", "--batch-size", "4"], world_size=1)
    assert "written under ZeRO stage 3, and this run uses ZeRO stage 2" in line, line
    assert not list((tmp_path / "out").glob("checkpoint-*/universal")), "converted before the refusal"


def test_a_zero2_checkpoint_under_zero3_on_the_same_world_size_is_refused(zero2_run: Path, tmp_path: Path) -> None:
    line = _refused(zero2_run, tmp_path, "full", ["--zero-stage", "3"])
    assert "written under ZeRO stage 2, and this run uses ZeRO stage 3" in line, line


def test_a_transposed_parameter_is_refused_on_another_world_size_before_converting(
        zero2_run: Path, tmp_path: Path) -> None:
    """1 rank: the names and shapes are compared by name with the original model-states file's records before the
    elastic conversion (before: refused only at the universal load, with universal/ already written into it)."""
    line = _refused(zero2_run, tmp_path, "slim", ["--variant", "transposed", "--batch-size", "4"], world_size=1)
    assert "'transformer.h.0.mlp.c_fc.weight' has shape [64, 256] in the checkpoint and [256, 64]" in line, line
    assert not list((tmp_path / "out").glob("checkpoint-*/universal*")), "converted before the refusal"


def test_a_renamed_module_on_another_world_size_is_refused_before_converting(zero2_run: Path, tmp_path: Path) -> None:
    """1 rank: a name the checkpoint does not hold is named before the conversion writes universal/."""
    line = _refused(zero2_run, tmp_path, "full", ["--variant", "renamed", "--batch-size", "4"], world_size=1)
    assert ("this model's parameter 'transformer.h.0.mlp.proj_out.weight' is not in the checkpoint (renamed, or "
            "another model)") in line, line
    assert not list((tmp_path / "out").glob("checkpoint-*/universal*")), "converted before the refusal"
