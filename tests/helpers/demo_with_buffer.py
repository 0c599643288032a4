"""demo_train whose model also has a persistent buffer that changes in training, as BatchNorm's running statistics
do: ``seen_batches`` counts the training forward passes of this rank (tests/train/test_elastic_weights.py). Run as a
script with demo_train's arguments."""

from __future__ import annotations

from typing import Any

import torch

from slurm_jit import demo_train
from slurm_jit.train.trainer import JitTrainer

BUFFER_NAME = "seen_batches"


def _count(module: Any, _args: Any) -> None:
    if module.training:
        getattr(module, BUFFER_NAME).add_(1)


def make_trainer(**kwargs: Any) -> JitTrainer:
    model = kwargs["model"]
    model.register_buffer(BUFFER_NAME, torch.zeros((), dtype=torch.int64))  # persistent: in the state dict
    model.register_forward_pre_hook(_count)
    return JitTrainer(**kwargs)


if __name__ == "__main__":
    demo_train.main(trainer_cls=make_trainer)
