"""slurm-jit: keep Hugging Face Transformers + DeepSpeed training alive on Slurm time limits and preemption.

``JitTrainer`` is imported lazily so that the torch-free parts (``ckpt-check``, ``grace-calc``) start fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["JitTrainer", "JitConfig", "with_jit", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("JitTrainer", "JitConfig"):
        from slurm_jit.train import trainer

        return getattr(trainer, name)
    if name == "with_jit":
        from slurm_jit.train.subclassing import with_jit

        return with_jit
    raise AttributeError(f"module 'slurm_jit' has no attribute {name!r}")
