"""demo_train's OUT/final-state.json: the digest of the model's weights that tests compare across runs, in any
precision a run trains in. Pure: a real module, no training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_jit import demo_train


def _trainer(dtype: object) -> SimpleNamespace:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(dtype)
    return SimpleNamespace(model=model, state=SimpleNamespace(global_step=7, best_metric=None,
                                                              best_model_checkpoint=None))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_final_state_digests_the_weights_bytes_in_the_runs_precision(tmp_path: Path, dtype_name: str) -> None:
    """The digest is sha256 over each parameter's name and raw bytes (fp32: what it always was). Before: a bf16
    run (--targ bf16=true) ended in numpy's 'Got unsupported ScalarType BFloat16' after its final checkpoint."""
    import torch

    trainer = _trainer(getattr(torch, dtype_name))
    demo_train._write_final_state(str(tmp_path), trainer)
    state = json.loads((tmp_path / "final-state.json").read_text())
    expected = hashlib.sha256()
    for name, param in sorted(trainer.model.named_parameters()):
        expected.update(name.encode())
        expected.update(bytes(param.detach().reshape(-1).view(torch.uint8).tolist()))
    assert state["global_step"] == 7 and state["weights_sha256"] == expected.hexdigest(), state
