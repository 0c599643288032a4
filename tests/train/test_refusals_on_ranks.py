"""Settings and resumes refused on real ranks, before any step (issue 7 items 8 and 12): save_on_each_node,
DeepSpeed's async and node-local checkpoint engines (the synchronous writers accepted), a resume on another world
size with the same per-device batch, a checkpoint whose DeepSpeed tag is another step. One line with a HINT.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import START_TIMEOUT_S, losses, start_demo
from run_outputs import checkpoint_names as _dirs

from slurm_jit.train.refusals import refused_settings

pytestmark = pytest.mark.deepspeed

def _refused(tmp_path: Path, out: Path, args: list[str], ranks_n: int = 1) -> str:
    ranks = start_demo(out, args, world_size=ranks_n, log_dir=tmp_path / "logs-refused")
    codes = ranks.wait(START_TIMEOUT_S)
    log = ranks.log(0)
    assert codes == [2] * ranks_n, log[-3000:]
    assert "Traceback" not in log
    lines = [line for line in log.splitlines() if line.startswith("demo_train: slurm_jit:")]
    assert len(lines) == 1 and "HINT:" in lines[0], log[-3000:]
    return lines[0]


def test_resume_with_another_world_size_is_refused_before_training(tmp_path: Path, copy_run,
                                                                   jit_zero2_run: Path) -> None:
    """Item 8 (issue 13): a 2-rank checkpoint resumed by 1 rank with the same per-device batch, i.e. half the
    samples per step, under JitConfig(keep_global_batch=False); and by 3 ranks, where no integer accumulation keeps
    4 samples (issue 21): one line with a HINT each, nothing trained, nothing touched, nothing converted (by
    default 1 rank doubles the accumulation, converts and resumes: tests/train/test_elastic.py)."""
    out = copy_run(jit_zero2_run)
    before = losses(out)
    line = _refused(tmp_path, out, ["--max-steps", "10", "--resume", "--refuse-batch-change"])
    assert "4 samples per optimizer step when written, 2 in this run" in line, line
    assert "HINT: keep per_device_train_batch_size x gradient_accumulation_steps x world size at 4" in line, line
    line = _refused(tmp_path / "three-ranks", out, ["--max-steps", "10", "--resume"], ranks_n=3)  # its own log
    assert "4 samples per optimizer step when written, 6 in this run" in line, line
    assert "HINT: no per-device batch does on 3 ranks: resume on a number of ranks that divides 4 (1, 2, 4)" in line
    assert losses(out) == before and _dirs(out) == ["checkpoint-3", "checkpoint-6"]
    assert not (out / "checkpoint-6" / "universal").exists()


def test_checkpoint_whose_deepspeed_tag_is_another_step_is_refused(tmp_path: Path, copy_run,
                                                                    plain_zero2_run: Path) -> None:
    """Item 8: checkpoint-6 whose DeepSpeed tag says global_step7, as transformers' enable_jit_checkpoint writes
    when the signal lands in on_pre_optimizer_step (its tag directory renamed here: upstream's off-by-one is
    timing-dependent); resuming it by explicit path is refused with one line on both ranks."""
    out = copy_run(plain_zero2_run)
    ckpt = out / "checkpoint-6"
    (ckpt / "global_step6").rename(ckpt / "global_step7")
    (ckpt / "latest").write_text("global_step7")
    line = _refused(tmp_path, out, ["--max-steps", "10", "--resume-from", str(ckpt)], ranks_n=2)
    assert "DeepSpeed tag 'global_step7' is not global_step6" in line


def test_save_on_each_node_is_refused_at_init(tmp_path: Path) -> None:
    """Item 12, for real: one line with a HINT, before any training."""
    line = _refused(tmp_path, tmp_path / "out", ["--save-on-each-node"])
    assert "save_on_each_node=True" in line


@pytest.mark.parametrize(("ds_config", "needle"), [
    ({"checkpoint": {"writer": {"decoupled": True}}}, "decoupled"),
    ({"datastates_ckpt": {}}, "datastates_ckpt"),
    ({"checkpoint": {"use_node_local_storage": True}}, "use_node_local_storage"),
])
def test_async_and_node_local_deepspeed_engines_are_refused(ds_config: dict, needle: str) -> None:
    """Item 12: the DeepSpeed 0.19.8 keys whose files are committed after save_checkpoint returns, or land on
    node-local storage."""
    why = refused_settings(save_on_each_node=False, ds_config=ds_config)
    assert why is not None and needle in why and "HINT:" in why


def test_synchronous_deepspeed_writers_are_accepted() -> None:
    assert refused_settings(save_on_each_node=False, ds_config={"checkpoint": {"writer": {"type": "fast"}}}) is None
    assert refused_settings(save_on_each_node=False, ds_config={"datastates_ckpt": False}) is None
    assert refused_settings(save_on_each_node=False, ds_config=None) is None
