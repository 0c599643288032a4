"""The examples' own bad settings (examples/dpo_style.py, examples/grpo_style.py) are refused at construction in
one line with a HINT (demo_train prints it and exits 2), not by a traceback at the first step or evaluation.
Real trainers built from a tiny config, no DeepSpeed: ~5 s."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import transformers

from slurm_jit.train.refusals import JitRefusal

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(cls: Any, tmp_path: Path, **kwargs: Any) -> Any:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    batch = kwargs.pop("batch", 2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[],
                                          per_device_train_batch_size=batch, per_device_eval_batch_size=batch)
    return cls(model=model, args=args, **kwargs)


def _one_line_hint(err: pytest.ExceptionInfo[JitRefusal]) -> str:
    message = str(err.value)
    assert "\n" not in message and "HINT:" in message, message
    return message


def test_dpo_refuses_an_odd_batch_at_construction(tmp_path: Path) -> None:
    dpo = _example("dpo_style")
    assert isinstance(_build(dpo.DPOStyleTrainer, tmp_path), dpo.DPOStyleTrainer)
    with pytest.raises(JitRefusal) as err:
        _build(dpo.DPOStyleTrainer, tmp_path, batch=3)
    assert "per_device_train_batch_size=3" in _one_line_hint(err)


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_grpo_refuses_a_steps_per_generation_below_one(tmp_path: Path, steps: Any) -> None:
    grpo = _example("grpo_style")
    with pytest.raises(JitRefusal) as err:
        _build(grpo.GRPOStyleTrainer, tmp_path, steps_per_generation=steps)
    assert f"steps_per_generation={steps!r}" in _one_line_hint(err)
