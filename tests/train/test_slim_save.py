"""The slim JIT save's resume checks that need no ranks (train/slim_save.py); the save, the load and their
exactness run on real DeepSpeed ranks in test_exact_resume.py, test_stop_and_resume.py and test_elastic.py."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_jit.checkpoint import protocol
from slurm_jit.train import slim_save

SLIM_ZERO2 = {"zero_stage": 2, "weights": protocol.WEIGHTS_MASTER_ONLY}


@pytest.mark.parametrize(("manifest", "ds_config", "expected"), [
    (SLIM_ZERO2, {"zero_optimization": {"stage": 2}}, None),
    (SLIM_ZERO2, {"zero_optimization": {"stage": 1}}, None),  # the same shards, the same rebuild
    ({"zero_stage": 2}, {"zero_optimization": {"stage": 3}}, None),  # full: DeepSpeed's own load decides
    ({"zero_stage": 3}, {"zero_optimization": {"stage": 3}}, None),  # ZeRO-3's own layout
    (SLIM_ZERO2, {"zero_optimization": {"stage": 3}}, "HINT: resume with ZeRO stage 2"),
    (SLIM_ZERO2, None, "this run uses ZeRO stage None"),
    (SLIM_ZERO2, {"zero_optimization": {"stage": 2, "load_from_fp32_weights": False}},
     "HINT: leave load_from_fp32_weights at its default"),
])
def test_resume_refusal(manifest: dict[str, Any], ds_config: dict[str, Any] | None, expected: str | None) -> None:
    refusal = slim_save.resume_refusal("ckpt", manifest, ds_config)
    if expected is None:
        assert refusal is None
    else:
        assert refusal is not None and expected in refusal and "\n" not in refusal, refusal


def test_layout_without_deepspeed_is_full() -> None:
    assert slim_save.layout(None, slim=False) == protocol.WEIGHTS_FULL
