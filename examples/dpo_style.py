"""A DPO-style JitTrainer subclass: ``compute_loss()`` overridden, with a frozen reference model.

Each batch's first half is the "chosen" sequences and its second half the "rejected" ones; the loss is DPO's
``-log sigmoid(beta * ((policy - ref)_chosen - (policy - ref)_rejected))`` on summed token log-probabilities.
Only ``compute_loss`` is overridden: the stop, save and resume hooks stay JitTrainer's. The reference model is
not trained, not in the checkpoint and rebuilt identically on resume (a copy of the initial weights).

Runs as it is, one process per rank (tiny GPT-2 from a config; the data, flags and launch are demo_train's)::

    srun python examples/dpo_style.py --output-dir OUT --max-steps 20 --resume
    python -m pytest tests/train/test_compat_matrix.py -k dpo   # 2 local CPU ranks, stopped and resumed
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from slurm_jit import demo_train
from slurm_jit.train.refusals import JitRefusal
from slurm_jit.train.trainer import JitTrainer

BETA = 0.1  # DPO's usual temperature


def sequence_logp(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each sequence under ``model`` (next-token prediction)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    tokens = input_ids[:, 1:].unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens).squeeze(-1).sum(-1)


class DPOStyleTrainer(JitTrainer):
    """JitTrainer with a DPO loss against a frozen copy of the initial model."""

    def __init__(self, *args: Any, beta: float = BETA, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            size = getattr(self.args, name)
            if size % 2:  # refused here, not by compute_loss at the first step (or the first evaluation)
                raise JitRefusal(f"DPO needs chosen/rejected pairs: {name}={size}. HINT: an even batch size, "
                                 "e.g. --batch-size 2")
        self.beta = beta
        # Copied before train() wraps the model in DeepSpeed: a plain module, frozen, in eval mode (no dropout).
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        input_ids = inputs["input_ids"]
        half = input_ids.shape[0] // 2
        if half == 0 or input_ids.shape[0] % 2:
            raise ValueError(f"DPO needs chosen/rejected pairs: batch of {input_ids.shape[0]}. HINT: an even "
                             "per-device batch size")
        policy = sequence_logp(model, input_ids)
        with torch.no_grad():
            ref = sequence_logp(self.ref_model, input_ids)
        margin = (policy[:half] - ref[:half]) - (policy[half:] - ref[half:])
        loss = -F.logsigmoid(self.beta * margin).mean()
        return (loss, {"margin": margin}) if return_outputs else loss


if __name__ == "__main__":
    demo_train.main(trainer_cls=DPOStyleTrainer)
