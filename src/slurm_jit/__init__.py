"""slurm-jit: keep Hugging Face Transformers + DeepSpeed training alive on Slurm time limits and preemption.

``JitTrainer`` is imported lazily so that the torch-free parts (``ckpt-check``, ``grace-calc``) start fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["JitTrainer", "JitConfig", "with_jit", "__version__"]


def with_jit(trainer_cls: type) -> type:
    """``trainer_cls`` (a Trainer subclass such as TRL's SFTTrainer) with JIT checkpoints: ``Jit<Name>(JitTrainer,
    trainer_cls)`` (slurm_jit/train/subclassing.py); the trainer's modules are imported at the call."""
    from slurm_jit.train.trainer import with_jit as made_with_jit

    return made_with_jit(trainer_cls)


def __getattr__(name: str) -> Any:
    if name in ("JitTrainer", "JitConfig"):
        from slurm_jit.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'slurm_jit' has no attribute {name!r}")
