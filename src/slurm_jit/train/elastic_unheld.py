"""What DeepSpeed's universal load leaves out: the tensors the resuming run's optimizer does not hold.

With ``load_universal_checkpoint`` set, deepspeed 0.19.8's ``engine._load_checkpoint`` skips the module load (``if
not self.load_universal_checkpoint(): self.load_module_state_dict(...)``) and the ZeRO-1/2 optimizer fills only its
own groups (``base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir``: each parameter of ``bit16_groups`` from
``zero/<name>/``, then ``update_lp_params``). A parameter frozen in the resuming run (trained in the checkpoint)
and every persistent buffer kept the value the model was built with. :func:`restore` loads them after that load.

Where each value comes from, by any of the tensor's names (tied parameters share one tensor), first found:

1. the saved model-states file's ``module`` (``ds_to_universal`` copies it into ``universal/<tag>/``): what the
   saved optimizer did not hold (frozen parameters, buffers), in their own dtype; a full (not slim) save has every
   tensor there;
2. ``zero/<name>/fp32.pt``: the fp32 master of a parameter the saved optimizer held, merged element for element
   from the shards (test_elastic.py compares them), cast to the parameter's dtype by the same ``copy_`` as the
   optimizer step's ``update_lp_params``;
3. the saved ``shared_params`` (a tied name the saved engine did not store -> the name it did).

Not zero_to_fp32's reconstruction from the original shards: that reads every shard again on every rank, while the
universal copy holds each parameter's merged master in a file of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_jit.train.refusals import JitRefusal

logger = logging.getLogger(__name__)

# The model-states file holding ``module``: ZeRO-1/2 writes one (engine._get_ckpt_name), ZeRO-3 one per rank.
MODEL_STATES_NAMES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
ZERO_DIR_NAME = "zero"  # the universal copy's per-parameter folders (ds_to_universal)
FP32_NAME = "fp32.pt"
PARAM_KEY = "param"  # deepspeed.checkpoint.constants.PARAM: the tensor in a ZeRO-1/2 universal file
SHOWN_NAMES = 3  # of the names a refusal lists

Group = tuple[str, ...]  # the state-dict names of one tensor
Held = tuple[Group, tuple[int, ...]]  # one tensor: its names, its shape


def unheld_names(model: Any) -> list[Held]:
    """Before the engine exists: the names, grouped per tensor, and the shape of what the ZeRO-1/2 optimizer will
    not hold (the parameters that do not require gradients, the persistent buffers)."""
    held = {id(p) for p in model.parameters() if p.requires_grad}
    return [(names, tuple(tensor.shape)) for names, tensor in _unheld(model, held)]


def held_names(model: Any) -> list[Held]:
    """Before the engine exists: the names, grouped per tensor (tied ones share it), and the shape of each parameter
    that requires gradients: what the ZeRO optimizer will hold and the universal load fills from ``zero/<name>/``."""
    groups: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if tensor.requires_grad:
            shape = getattr(tensor, "ds_shape", None) or tensor.shape  # ZeRO-3 (zero.Init): partitioned already
            groups.setdefault(id(tensor), ([], tuple(shape)))[0].append(name)
    return [(tuple(names), shape) for names, shape in groups.values()]


def _unheld(module: Any, held_ids: set[int], buffers_only: bool = False) -> list[tuple[Group, Any]]:
    """(names, tensor) of each parameter of ``module`` whose id is not in ``held_ids`` (all its names: tied ones
    share it) and of each persistent buffer: what its state dict holds beside the optimizer's parameters. Named
    directly, not through ``state_dict()``, which gathers ZeRO-3 parameters."""
    groups: dict[int, tuple[list[str], Any]] = {}
    params = () if buffers_only else module.named_parameters(remove_duplicate=False)
    for name, tensor in params:
        if id(tensor) not in held_ids:
            groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    for prefix, sub in module.named_modules():
        for name, tensor in sub.named_buffers(recurse=False):
            if tensor is not None and name not in sub._non_persistent_buffers_set:
                groups.setdefault(id(tensor), ([], tensor))[0].append(f"{prefix}.{name}" if prefix else name)
    return [(tuple(names), tensor) for names, tensor in groups.values()]


def saved_shapes(states_file: Path) -> dict[str, tuple[int, ...]] | None:
    """The names whose values a conversion of the checkpoint carries, with their shapes: its model-states
    ``module`` tensors, the parameters its optimizer held (``param_shapes``) and the tied names recorded for those
    (``shared_params``); None when the file cannot be read (memory-mapped: no tensor is read)."""
    import torch

    states = load_states(states_file)
    if states is None:
        return None
    shapes = {k: tuple(v.shape) for k, v in _dict(states.get("module")).items() if isinstance(v, torch.Tensor)}
    for group in states.get("param_shapes") or ():
        shapes.update((k, tuple(v)) for k, v in _dict(group).items())
    shapes.update((k, shapes[v]) for k, v in _dict(states.get("shared_params")).items() if v in shapes)
    return shapes


def held_refusal(states_file: Path, held_now: Sequence[Held]) -> str | None:
    """Why a parameter this run trains cannot be filled from the checkpoint by the universal load, or None. That
    load reads ``zero/<name>/`` by name and copies by element count: deepspeed 0.19.8 (universal_checkpoint.py
    ``load_hp_checkpoint_state``) loads a same-sized parameter of another shape (transposed) silently and dies on
    another size, or on one its optimizer did not hold, with a bare assertion. So: the checkpoint's optimizer held
    it (not frozen, nor tied to another parameter, when written), with this shape, and not as two tensors tied
    into one now (one of their trained values would be dropped). None when the model states (their
    ``param_shapes``) cannot be read."""
    states = load_states(states_file)
    shapes = states.get("param_shapes") if states is not None else None
    if not isinstance(shapes, list) or not shapes:
        return None  # not a ZeRO-1/2 model-states file: the conversion refuses it with DeepSpeed's own words
    held_then = {name: tuple(shape) for group in shapes for name, shape in _dict(group).items()}
    for group, shape in held_now:
        found = [name for name in group if name in held_then]
        if not found:
            return (f"{group[0]} is trained in this run but was not by the checkpoint's optimizer (frozen, or tied "
                    "to another parameter, when written): the checkpoint holds no optimizer state for it")
        if len(found) > 1:
            return (f"{found[0]} and {found[1]} are one tensor in this run but were two trained tensors when "
                    "written (tied now, untied then): one of their values would be dropped")
        if held_then[found[0]] != tuple(shape):
            return (f"{found[0]} is {list(shape)} in this run but {list(held_then[found[0]])} in the checkpoint "
                    "(another model, or a library that changed its layout)")
    return None


def missing_from(unheld: Sequence[Held], saved: Mapping[str, Any]) -> list[str]:
    """The first name of each tensor none of whose names ``saved`` holds."""
    return [names[0] for names, _ in unheld if names and not any(name in saved for name in names)]


def reshaped(unheld: Sequence[Held], saved: Mapping[str, tuple[int, ...]]) -> str | None:
    """The first tensor saved with another shape than this model's (as :func:`restore` would refuse it after the
    conversion), in words; None when there is none."""
    for names, shape in unheld:
        for name in names:
            if name in saved and tuple(saved[name]) != tuple(shape):
                return f"{name} is saved as {list(saved[name])}, this model's is {list(shape)}"
    return None


def _dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def load_states(path: Path) -> dict[str, Any] | None:
    import torch

    if not path.is_file():
        return None
    try:
        states = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - another layout or a damaged file: the caller says what it means
        return None
    return states if isinstance(states, dict) else None


class _Saved:
    """The values a universal copy holds for the tensors its optimizer load does not fill."""

    def __init__(self, tag_dir: Path) -> None:
        states = next((s for s in map(load_states, (tag_dir / n for n in MODEL_STATES_NAMES)) if s), None)
        if states is None:
            raise JitRefusal(f"slurm_jit: {tag_dir}: no readable model-states file ({' or '.join(MODEL_STATES_NAMES)})"
                             ". HINT: remove the universal/ directory beside it and resume again (it is converted "
                             "again), or resume with the original number of ranks")
        self.module, self.shared = _dict(states.get("module")), _dict(states.get("shared_params"))
        self.zero = tag_dir / ZERO_DIR_NAME

    def value(self, name: str, follow_alias: bool = True) -> Any:
        """The saved value of ``name`` (None: none saved)."""
        import torch

        if name in self.module:
            return self.module[name]
        fp32 = self.zero / name / FP32_NAME
        if "/" not in name and fp32.is_file():
            loaded = torch.load(fp32, map_location="cpu", weights_only=False)
            return loaded.get(PARAM_KEY) if isinstance(loaded, dict) else loaded
        alias = self.shared.get(name)
        return self.value(alias, False) if follow_alias and isinstance(alias, str) else None


def restore(engine: Any, checkpoint_path: str, tag: str, strict: bool) -> None:
    """After the universal load of ``checkpoint_path/tag`` by ``engine``: every state-dict tensor the optimizer does
    not hold gets its saved value. ``strict`` (the Trainer's load_module_strict: False for PEFT models, as
    upstream's own load): one without a saved value is refused (JitRefusal, one line), else kept and logged."""
    import torch

    zero3 = engine.zero_optimization_partition_weights()  # its frozen parameters are refused before: buffers only
    held = set() if zero3 else {id(p) for group in engine.optimizer.bit16_groups for p in group}
    unheld = _unheld(engine.module, held, buffers_only=zero3)
    if not unheld:
        return
    saved = _Saved(Path(checkpoint_path) / tag)
    missing: list[str] = []
    restored = 0
    with torch.no_grad():
        for names, tensor in unheld:
            value = _one_value(saved, names, tensor, checkpoint_path)
            if value is None:
                missing.append(names[0])
                continue
            tensor.data.copy_(value)  # the dtype cast of update_lp_params' copy_ (fp32 master -> 16-bit weight)
            restored += 1
    if missing and strict:
        raise JitRefusal(f"slurm_jit: {checkpoint_path}: {len(missing)} tensors this run does not train (e.g. "
                         f"{missing[:SHOWN_NAMES]}) are neither in the checkpoint's module nor held by its optimizer"
                         ": they would keep the values the model was built with. HINT: resume with the model and "
                         "the frozen parameters the checkpoint was written with")
    if missing:
        logger.warning("slurm_jit: %s: %d tensors not in the checkpoint (e.g. %s) keep the values the model was "
                       "built with (a non-strict load, as upstream's for PEFT models)", checkpoint_path,
                       len(missing), missing[:SHOWN_NAMES])
    logger.info("slurm_jit: %s: %d tensors the optimizer does not hold restored after the universal load",
                checkpoint_path, restored)


def _one_value(saved: _Saved, names: Group, tensor: Any, checkpoint_path: str) -> Any:
    """The saved value of one tensor, known by ``names``; refused (one line) when its shape is not the tensor's, or
    when two of its names were saved with different values (tied in this model, untied in the checkpoint's)."""
    import torch

    found = [(name, v) for name, v in ((n, saved.value(n)) for n in names) if v is not None]
    for name, value in found:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(tensor.shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise JitRefusal(f"slurm_jit: {checkpoint_path}: {name} is saved as {shape}, this model's is "
                             f"{tuple(tensor.shape)}. HINT: resume with the model the checkpoint was written with")
    if not found:
        return None
    first = found[0][1].to(tensor.dtype)
    for name, value in found[1:]:
        if not torch.equal(value.to(tensor.dtype), first):
            raise JitRefusal(f"slurm_jit: {checkpoint_path}: {found[0][0]} and {name} are one tensor in this model "
                             "but were saved with different values (tied here, untied when written). HINT: resume "
                             "with the model the checkpoint was written with")
    return first
