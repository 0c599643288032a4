"""Is a resumed run bitwise the run that never stopped? Dump the complete training state at a step, compare two.

A dump (``dump``, called on every rank at the end of a step; ``demo_train --dump-state-at N`` does it) holds
what a checkpoint holds and what it does not: the hidden state of DeepSpeed's CPU Adam kernels (a probe of their
beta products, see ``train/exact_resume.py``), the ZeRO optimizer's state (fp32 master partitions, moments,
step), the module's weights, the LR scheduler and the RNGs. Only tensors and plain values are stored, so that a
dump loads with ``torch.load(weights_only=True)``::

    python -m slurm_jit.exactness RUN_A RUN_B [--step N]    # two run dirs (OUT/exact-state/step-N/) or dumps
    python -m slurm_jit.exactness CKPT_A CKPT_B --unpickle  # two checkpoint dirs (checkpoint-N/)

Checkpoint files hold pickled Python objects (DeepSpeed's loss scaler, argparse values, numpy RNG states): they
are unpickled only with ``--unpickle``, which runs code from the files, as resuming from them does anyway.
Exit status: 0 bitwise equal, 1 different (the first differing tensor is named), 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATE_DIR = "exact-state"
_MAX_DEPTH = 16  # nesting of optimizer state dicts is < 8; deeper means a cycle through object attributes


# ------------------------------------------------------------------ dump (inside the training processes)

def flatten(obj: Any, prefix: str = "", out: dict[str, Any] | None = None, depth: int = 0) -> dict[str, Any]:
    """Nested dicts, lists and objects as ``{"a/b/0": value}`` holding only tensors and plain values."""
    import numpy as np
    import torch

    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().cpu().clone()
    elif isinstance(obj, np.ndarray):
        out[prefix] = torch.from_numpy(obj.copy())
    elif obj is None or type(obj) in (bool, int, float, str):
        out[prefix] = obj
    elif isinstance(obj, (int, float, str)):  # an enum (ZeroStageEnum) or a numpy scalar: kept as plain text
        out[prefix] = repr(obj)
    elif depth >= _MAX_DEPTH:
        out[prefix] = f"<{type(obj).__name__}: too deep>"
    elif isinstance(obj, dict):
        for key, value in obj.items():
            flatten(value, f"{prefix}/{key}", out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            flatten(value, f"{prefix}/{i}", out, depth + 1)
    elif hasattr(obj, "__dict__"):
        flatten({k: v for k, v in vars(obj).items() if not callable(v)}, f"{prefix}<{type(obj).__name__}>", out,
                depth + 1)
    else:
        out[prefix] = f"<{type(obj).__name__}>"
    return out


def _kernel_probes(engine: Any) -> dict[str, Any]:
    import torch

    from slurm_jit.train import exact_resume

    kernels, inexact = exact_resume.hidden_kernels(engine)
    out: dict[str, Any] = {f"kernel/{k.name}/probe": torch.tensor([k.probe()]) for k in kernels}
    out.update({f"kernel/{k.name}/steps": k.steps for k in kernels})
    out.update({f"kernel/not-exact/{i}": why for i, why in enumerate(inexact)})
    return out


def dump(trainer: Any, root: str, step: int, rank: int) -> Path:
    """Write this rank's complete training state at ``step`` to ``root/step-N/rank{R}.pt``."""
    import numpy as np
    import torch

    engine = trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None
    state: dict[str, Any] = {"global_step": step}
    if engine is not None:
        state.update(_kernel_probes(engine))
        flatten(engine.optimizer.state_dict(), "optimizer", state)
        flatten(engine.module.state_dict(), "module", state)
    else:
        flatten(trainer.optimizer.state_dict(), "optimizer", state)
        flatten(trainer.model.state_dict(), "module", state)
    if trainer.lr_scheduler is not None:
        flatten(trainer.lr_scheduler.state_dict(), "lr_scheduler", state)
    flatten({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "rng", state)
    path = Path(root) / f"step-{step}" / f"rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ compare (a separate process, after the runs)

class BadInput(Exception):
    """A path or option that cannot be compared; the message ends with a HINT."""


@dataclass
class Comparison:
    entries: int = 0
    tensors_differing: list[str] = field(default_factory=list)  # "name: how", in the order of side A
    values_differing: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.tensors_differing or self.values_differing or self.missing)


def _describe(a: Any, b: Any) -> str:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if not (a.is_floating_point() and a.numel()):
        return f"{int((a != b).sum())} of {a.numel()} elements differ"
    x, y = a.double(), b.double()
    differ = int(((x != y) & ~(x.isnan() & y.isnan())).sum())
    diff = (x - y).abs().nan_to_num(0.0)
    rel = (diff / y.abs().clamp_min(torch.finfo(torch.float64).tiny)).max()
    return f"{differ} of {a.numel()} elements differ, max abs {float(diff.max()):.3g}, max rel {float(rel):.3g}"


def _same_bits(a: Any, b: Any) -> bool:
    """Bit for bit (so NaN equals the same NaN, and -0.0 differs from 0.0)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare_states(a: dict[str, Any], b: dict[str, Any], where: str, result: Comparison) -> None:
    import torch

    for key, va in a.items():
        result.entries += 1
        name = f"{where}{key}"
        if key not in b:
            result.missing.append(f"{name} (only in A)")
            continue
        vb = b[key]
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            if not _same_bits(va, vb):
                result.tensors_differing.append(f"{name}: {_describe(va, vb)}")
        elif type(va) is not type(vb) or (va != vb and va == va):  # NaN == NaN here
            result.values_differing.append(f"{name}: {va!r} vs {vb!r}")
    result.missing += [f"{where}{k} (only in B)" for k in b if k not in a]


def _load(path: Path, unpickle: bool) -> dict[str, Any]:
    import pickle

    import torch

    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    except pickle.UnpicklingError:
        if not unpickle:
            raise BadInput(f"{path} holds pickled Python objects. HINT: add --unpickle to load it "
                           "(runs code from the file: only for checkpoints you trust)") from None
    return flatten(torch.load(path, map_location="cpu", weights_only=False))


def _files(root: Path, step: int | None) -> tuple[Path, list[Path]]:
    """The directory compared and its state files: a dump dir, a run dir's dump at ``step``, a checkpoint."""
    if (root / STATE_DIR).is_dir():
        steps = sorted(int(p.name.split("-")[1]) for p in (root / STATE_DIR).glob("step-*"))
        if not steps:
            raise BadInput(f"{root / STATE_DIR} holds no dump. HINT: run with --dump-state-at N")
        chosen = step if step is not None else steps[-1]
        root = root / STATE_DIR / f"step-{chosen}"
        if not root.is_dir():
            raise BadInput(f"no dump at step {chosen} in {root.parent}. HINT: --step one of {steps}")
    files = sorted(root.glob("rank*.pt"))
    if not files:
        files = sorted([*root.glob("*.pt*"), *root.glob("global_step*/*.pt")])
    if not files:
        raise BadInput(f"{root}: no dump (rank*.pt) or checkpoint (global_step*/*.pt). "
                       "HINT: pass two run dirs, dump dirs or checkpoint-N dirs")
    return root, files


def compare(path_a: Path, path_b: Path, step: int | None = None, unpickle: bool = False) -> Comparison:
    root_a, files_a = _files(path_a, step)
    root_b, files_b = _files(path_b, step)
    result = Comparison()
    names_b = {f.relative_to(root_b) for f in files_b}
    for fa in files_a:
        rel = fa.relative_to(root_a)
        if rel not in names_b:
            result.missing.append(f"{rel} (only in A)")
            continue
        compare_states(_load(fa, unpickle), _load(root_b / rel, unpickle), f"{rel}:", result)
    result.missing += [f"{r} (only in B)" for r in sorted(names_b - {f.relative_to(root_a) for f in files_a})]
    return result


def report(result: Comparison) -> str:
    if result.equal:
        return f"bitwise equal: {result.entries} entries"
    lines = [f"DIFFERENT: {len(result.tensors_differing)} tensors, {len(result.values_differing)} other values, "
             f"{len(result.missing)} missing, of {result.entries} entries"]
    if result.tensors_differing:
        lines.append(f"first differing tensor: {result.tensors_differing[0]}")
    lines += [f"first differing value: {v}" for v in result.values_differing[:1]]
    lines += [f"missing: {m}" for m in result.missing[:3]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_jit.exactness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--step", type=int, default=None, help="which dump of a run dir (default: the last)")
    p.add_argument("--unpickle", action="store_true", help="allow checkpoint files with pickled objects")
    args = p.parse_args(argv)
    try:
        for path in (args.a, args.b):
            if not path.is_dir():
                raise BadInput(f"{path}: not a directory. HINT: pass two run dirs, dump dirs or checkpoint dirs")
        result = compare(args.a, args.b, args.step, args.unpickle)
    except BadInput as exc:
        print(f"exactness: {exc}", file=sys.stderr)
        return 2
    print(report(result))
    return 0 if result.equal else 1


if __name__ == "__main__":
    sys.exit(main())
