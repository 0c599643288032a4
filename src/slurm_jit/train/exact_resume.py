"""Exact resume: give DeepSpeed's CPU Adam kernels the hidden state of the process that never stopped.

DeepSpeed's CPU Adam kernel (``csrc/includes/cpu_adam.h``, ``Adam_Optimizer::IncrementStep``) keeps beta1^t and
beta2^t per process as running float32 products, advanced by one multiplication per step, while a fresh process
starts them from ``pow(beta, step)``. The two differ in the last bit, the bias correction amplifies that, and a
resumed run drifts from the uninterrupted one although every tensor in the checkpoint is equal. This state is not
in the checkpoint. It is rebuilt here by calling the kernel once per past step on empty tensors, which advances
only its hidden counter, exactly as the uninterrupted process advanced it.

Kernels in the installed DeepSpeed (0.19.8) and what they need:

- ``FusedAdam`` on the CPU accelerator (``"optimizer": {"type": "Adam"/"AdamW"}``): one static kernel per
  AdamW/Adam mode per process (``csrc/cpu/adam/fused_adam.cpp``): replayed.
- ``DeepSpeedCPUAdam`` (ZeRO-Offload), and ``ZenFlowCPUAdam`` without overlap: one kernel per instance
  (``opt_id``): replayed. ``ZenFlowCPUAdam`` with ``overlap_step`` steps in a worker process: not made exact.
- ``FusedAdam`` on CUDA, ``torch.optim.*`` (the Trainer's optimizer, ``"torch_adam": true``): recompute the
  correction from ``step`` on every call: nothing hidden.
- CPU Lion (``FusedLion`` on CPU, ``DeepSpeedCPULion``) and ``DeepSpeedCPUAdagrad``: keep a hidden step counter
  only, which their update does not read: nothing to do.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# FusedAdam's CPU multi_tensor_adam ignores the chunk size; this is the value its own applier passes
# (deepspeed/ops/adam/fused_adam.py: MultiTensorApply(2048 * 32)).
FUSED_ADAM_CHUNK = 2048 * 32
# Attributes through which DeepSpeed wraps one optimizer in another (ZeRO optimizers, bf16/fp16 wrappers,
# Muon's auxiliary Adam).
_INNER_OPTIMIZER_ATTRS = ("optimizer", "aux_optimizer", "basic_optimizer")
_MAX_WRAP_DEPTH = 6

# One kernel call: (step, beta1, beta2, lr, [param, grad, exp_avg, exp_avg_sq]) with eps = weight decay = 0.
KernelCall = Callable[[int, float, float, float, list[Any]], None]


@dataclass(frozen=True, kw_only=True)
class HiddenKernel:
    """One per-process Adam kernel whose beta products are not in the checkpoint."""

    name: str  # what the log says: "FusedAdam(cpu, AdamW)", "DeepSpeedCPUAdam#0"
    call: KernelCall  # one call of the kernel; on empty tensors it moves only the hidden state
    steps: int  # optimizer steps taken so far (from the loaded optimizer state)
    betas: tuple[tuple[float, float], ...]  # the betas of each kernel call of one step, in call order

    def replay(self) -> int:
        """Call the kernel as the uninterrupted process did; returns the number of calls made."""
        empty = [_empty() for _ in range(4)]  # nothing to update: each call moves only the hidden state
        if len(set(self.betas)) == 1:
            beta1, beta2 = self.betas[0]
            for step in range(1, self.steps + 1):  # the product chain: one multiplication per step
                self.call(step, beta1, beta2, 0.0, empty)
            return self.steps
        # Betas that change between the calls of a step make the kernel recompute pow(beta, step) at every
        # call, so only the calls of the last step shape its state.
        for beta1, beta2 in self.betas:
            self.call(self.steps, beta1, beta2, 0.0, empty)
        return len(self.betas)

    def probe(self) -> float:
        """The kernel's update of p=0 with g=1, m=v=0, lr=1 at the current step, without moving its state (same
        step and betas as its last call): -(1-b1)/(1-b1^t) * sqrt(1-b2^t)/sqrt(1-b2), a fingerprint of the
        hidden beta products."""
        beta1, beta2 = self.betas[-1]
        tensors = [_empty(1), _empty(1) + 1.0, _empty(1), _empty(1)]
        self.call(self.steps, beta1, beta2, 1.0, tensors)
        return float(tensors[0].item())


def _empty(n: int = 0) -> Any:
    import torch

    return torch.zeros(n, dtype=torch.float32)


def _optimizers(root: Any) -> Iterator[Any]:
    """Every torch optimizer reachable from ``root`` through DeepSpeed's wrappers, each once."""
    import torch

    seen: set[int] = set()
    todo = [(root, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if obj is None or id(obj) in seen or depth > _MAX_WRAP_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            yield obj
        todo.extend((getattr(obj, attr, None), depth + 1) for attr in _INNER_OPTIMIZER_ATTRS)


def _steps(optimizer: Any) -> int:
    found = [int(s["step"]) for s in optimizer.state.values() if isinstance(s, dict) and "step" in s]
    found += [int(g["step"]) for g in optimizer.param_groups if "step" in g]
    return max(found, default=0)


def _betas(optimizer: Any) -> tuple[tuple[float, float], ...]:
    groups = [g for g in optimizer.param_groups if g["params"]] or optimizer.param_groups
    return tuple((float(g["betas"][0]), float(g["betas"][1])) for g in groups)


def _fused_adam_cpu(opt: Any) -> KernelCall:
    def call(step: int, beta1: float, beta2: float, lr: float, tensors: list[Any]) -> None:
        param, grad, exp_avg, exp_avg_sq = ([t] for t in tensors)
        opt.multi_tensor_adam(FUSED_ADAM_CHUNK, opt._dummy_overflow_buf, [grad, param, exp_avg, exp_avg_sq], lr,
                              beta1, beta2, 0.0, step, opt.adam_w_mode, 1, 0.0)
    return call


def _cpu_adam(opt: Any) -> KernelCall:
    def call(step: int, beta1: float, beta2: float, lr: float, tensors: list[Any]) -> None:
        opt.ds_opt_adam.adam_update(opt.opt_id, step, lr, beta1, beta2, 0.0, 0.0, True, *tensors)
    return call


def _on_cpu_accelerator() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().device_name() == "cpu")


def classify(optimizer: Any) -> tuple[KernelCall | None, str | None]:
    """(how to advance its hidden kernel, None) when it has one that can be replayed; (None, why not) when it
    has one that cannot; (None, None) when it keeps nothing the checkpoint lacks."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    kind = type(optimizer).__name__
    if isinstance(optimizer, DeepSpeedCPUAdam):
        if getattr(optimizer, "overlap_step", False):
            return None, f"{kind} with overlap_step steps in a worker process"
        return _cpu_adam(optimizer), None
    if isinstance(optimizer, FusedAdam) and _on_cpu_accelerator():
        return _fused_adam_cpu(optimizer), None
    return None, None


def hidden_kernels(engine: Any) -> tuple[list[HiddenKernel], list[str]]:
    """The replayable kernels behind a DeepSpeed engine's optimizer, and the ones that cannot be made exact."""
    kernels: list[HiddenKernel] = []
    inexact: list[str] = []
    for opt in _optimizers(getattr(engine, "optimizer", None)):
        call, why_not = classify(opt)
        if why_not:
            inexact.append(why_not)
        if call is None:
            continue
        name = type(opt).__name__
        if hasattr(opt, "opt_id"):
            name += f"#{opt.opt_id}"
        elif hasattr(opt, "adam_w_mode"):
            name += f"(cpu, {'AdamW' if opt.adam_w_mode else 'Adam'})"
        kernels.append(HiddenKernel(name=name, call=call, steps=_steps(opt), betas=_betas(opt)))
    return kernels, inexact


def restore(engine: Any) -> str:
    """After ``engine.load_checkpoint``, before the first resumed step: replay every hidden kernel to the
    loaded step. Logs and returns one line saying what was done."""
    t0 = time.monotonic()
    kernels, inexact = hidden_kernels(engine)
    done = [f"{k.name} replayed {k.replay()} kernel calls to step {k.steps}" for k in kernels if k.steps > 0]
    if done:
        done[-1] += f" ({time.monotonic() - t0:.2f} s)"
    line = "slurm_jit: exact resume: " + ("; ".join(done) if done else "no optimizer kernel with hidden state")
    if inexact:
        line += "; NOT exact: " + "; ".join(inexact) + " (its beta products restart from pow(beta, step))"
    # At warning level, like the trainer's other resume lines, so that it shows by default; once (rank 0) unless
    # it says the resume is not exact, which every rank says for itself.
    logger.log(logging.WARNING if inexact or _is_rank0() else logging.DEBUG, line)
    return line


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


@contextmanager
def rng_untouched() -> Iterator[None]:
    """Python, numpy and torch (CPU and accelerator) random states are the same after the block as before."""
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
