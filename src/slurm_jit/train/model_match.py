"""Does a DeepSpeed checkpoint hold the model it is about to be loaded into? Asked before any load.

DeepSpeed 0.19.8's model-states file (``mp_rank_00_model_states.pt`` under ZeRO-0/1/2; every rank's
``zero_pp_rank_R_mp_rank_00_model_states.pt`` under ZeRO-3: ``engine._common_checkpoint_state``) records the model
it was written from:

- ``param_shapes``: per optimizer group, the name and shape of each parameter the ZeRO optimizer holds, in the
  order of its flat fp32 partitions (``engine._get_zero_param_shapes``). The partitions carry no names: DeepSpeed
  restores them by position, so a parameter of the same size but another shape, name or place silently gets
  another parameter's numbers (and a slim save's module weights come from there only: ``slim_save.py``);
- ``frozen_param_shapes`` (ZeRO-2/3): the parameters it does not hold; ``buffer_names``;
- ``shared_params`` (rank 0's file): tied parameters, alias -> the name that holds the data;
- ``module``: the state dict, with each tensor's dtype (a slim save leaves the held weights out; ZeRO-3 writes
  placeholders for the parameters);
- ``ds_config``: the ZeRO stage.

:func:`difference` compares a :class:`ModelRecord` read from that file (:func:`saved_record`) with one of the
engine about to load it (:func:`live_record`) and says, in one line with a HINT, the first thing that differs.
What is not recorded (an older checkpoint, another layout) is not compared: a matching model still resumes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_jit.train.refusals import _read_latest_tag

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
# rank 0's file: the only one that records shared_params (engine._get_shared_params runs on rank 0)
MODEL_STATES_NAMES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
ZERO3 = 3
LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"  # the files that name the tag engine.load_checkpoint reads
# a module tensor in another of these is cast by load_state_dict, and the held ones come from the fp32 master
FLOAT_DTYPES = {"torch.float32", "torch.bfloat16", "torch.float16", "torch.float64"}
INTERCHANGEABLE_STAGES = {1, 2}  # one optimizer (stage_1_and_2.py), the same partitions of the fp32 master
# A left-out weight's module entry in a PEFT JIT save (slim_save.py writes it): torch refuses it for any other shape
PLACEHOLDER_SHAPE = (0,)
MODEL_HINT = ("HINT: resume with the model the checkpoint was written with (the same config and transformers "
              "version), or start a new run in another output_dir")


@dataclass(frozen=True, kw_only=True)
class ModelRecord:
    """What is known of one model: from a checkpoint (None where it does not record it) or from an engine."""

    zero_stage: int | None = None
    groups: list[list[tuple[str, Shape]]] | None = None  # param_shapes: each optimizer group's parameters, in order
    frozen: dict[str, Shape] | None = None  # frozen_param_shapes: the parameters the optimizer does not hold
    buffers: set[str] | None = None  # buffer_names: the persistent buffers
    shared: dict[str, str] | None = None  # shared_params: tied alias -> the name that holds the data
    tensors: dict[str, tuple[Shape | None, str]] = field(default_factory=dict)  # module: shape (None: a ZeRO-3
    # placeholder), dtype

    @property
    def held(self) -> set[str]:
        return {name for group in self.groups or [] for name, _ in group}

    def frozen_names(self) -> set[str] | None:
        """The parameters not held: recorded (ZeRO-2/3), else the module's parameter entries (ZeRO-1)."""
        if self.frozen is not None:
            return set(self.frozen)
        if self.groups is None or self.buffers is None or self.shared is None:
            return None
        return set(self.tensors) - self.buffers - self.held - set(self.shared)


def difference(saved: ModelRecord, live: ModelRecord, by_name: bool = False) -> str | None:
    """The first way the checkpoint's model differs from the live one (one line with a HINT), or None.
    ``by_name``: a universal copy (elastic.py), loaded parameter by parameter by name, in any stage and grouping:
    only the ties, the shapes of the names both have and the dtypes are compared."""
    checks = ((_tie_difference, _named_shape_difference, _tensor_difference) if by_name else
              (_stage_difference, _tie_difference, _held_frozen_difference, _order_difference, _frozen_difference,
               _tensor_difference))
    for check in checks:
        why = check(saved, live)
        if why:
            return why
    return None


def stage_refusal(ckpt_dir: str, manifest: dict[str, Any], ds_config: dict[str, Any] | None) -> str | None:
    """Why this run's ZeRO stage cannot load the checkpoint's shards as they are (same world size), or None."""
    zero = (ds_config or {}).get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    why = _stage_difference(ModelRecord(zero_stage=_int(manifest.get("zero_stage"))),
                            ModelRecord(zero_stage=_int(stage)))
    return f"{ckpt_dir}: {why}" if why else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _stage_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    was, now = saved.zero_stage, live.zero_stage
    if was is None or now is None or was == now or {was, now} <= INTERCHANGEABLE_STAGES:
        return None
    return (f"written under ZeRO stage {was}, and this run uses ZeRO stage {now}: each stage partitions the "
            f"weights and optimizer states its own way, and DeepSpeed cannot load one as the other. HINT: resume "
            f"with zero_optimization.stage {was} (as written), or start a new run in another output_dir")


def _tie_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    if saved.shared is None or live.shared is None:
        return None
    hint = ("HINT: resume with the parameters tied as they were (tie_word_embeddings in the model config), or "
            "start a new run in another output_dir")
    saved_names, live_names = _names(saved), _names(live)
    # a tie whose names the other side has none of is the name check's (another model, a PEFT wrapper's prefix)
    for alias, owner in live.shared.items():
        if saved.shared.get(alias) != owner and saved_names & {alias, owner}:
            then = f"tied to '{saved.shared[alias]}'" if alias in saved.shared else "a parameter of its own"
            return f"'{alias}' is tied to '{owner}' in this model and was {then} in the checkpoint. {hint}"
    for alias, owner in saved.shared.items():
        if alias not in live.shared and live_names & {alias, owner}:
            return (f"'{alias}' was tied to '{owner}' in the checkpoint and is a parameter of its own in this "
                    f"model. {hint}")
    return None


def _names(record: ModelRecord) -> set[str]:
    """Every parameter name the record knows of: held, frozen, tied aliases, module entries."""
    return record.held | (record.frozen_names() or set()) | set(record.shared or {}) | set(record.tensors)


def _held_frozen_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    if saved.groups is None or live.groups is None:
        return None
    hint = ("HINT: resume with the same parameters trainable (requires_grad) as when it was written, or start a "
            "new run in another output_dir")
    saved_frozen = saved.frozen_names() or set()
    for name in _in_order(live.held, live):
        if name in saved_frozen:
            return (f"'{name}' is trained in this run (held by the optimizer) and was frozen when the checkpoint "
                    f"was written. {hint}")
    for name in _in_order(live.frozen_names() or set(), live):
        if name in saved.held:
            return (f"'{name}' is frozen in this run and was trained (held by the optimizer) when the checkpoint "
                    f"was written. {hint}")
    return None


def _in_order(names: Iterable[str], record: ModelRecord) -> list[str]:
    """``names`` in the record's module order (the first difference named is the model's first)."""
    order = {name: i for i, name in enumerate(record.tensors)}
    return sorted(names, key=lambda name: (order.get(name, len(order)), name))


def _order_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    if saved.groups is None or live.groups is None:
        return None
    if len(saved.groups) != len(live.groups):
        return (f"the checkpoint's optimizer has {len(saved.groups)} parameter groups, this run's "
                f"{len(live.groups)}: the flat fp32 partitions are restored group by group. HINT: resume with the "
                "optimizer parameter groups it was written with (the same weight-decay exclusions)")
    for g, (was, now) in enumerate(zip(saved.groups, live.groups, strict=True)):
        for i in range(max(len(was), len(now))):
            why = _position_difference(g, i, was[i] if i < len(was) else None, now[i] if i < len(now) else None,
                                       saved.held)
            if why:
                return why
    return None


def _position_difference(group: int, index: int, was: tuple[str, Shape] | None, now: tuple[str, Shape] | None,
                         saved_held: set[str]) -> str | None:
    where = f"optimizer group {group}, parameter #{index}"
    if now is None:
        assert was is not None
        return f"{where}: the checkpoint's '{was[0]}' is not in this model. {MODEL_HINT}"
    if was is None:
        return f"{where}: this model's '{now[0]}' is not in the checkpoint. {MODEL_HINT}"
    if was[0] != now[0]:
        kind = "moved: the parameter order changed" if now[0] in saved_held else "renamed, or another model"
        return f"{where} is '{was[0]}' in the checkpoint and '{now[0]}' in this model ({kind}). {MODEL_HINT}"
    if was[1] != now[1]:
        return _shape_difference(now[0], was[1], now[1])
    return None


def _shape_difference(name: str, was: Shape, now: Shape) -> str:
    return f"'{name}' has shape {list(was)} in the checkpoint and {list(now)} in this model. {MODEL_HINT}"


def _named_shape_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    was, now = _parameter_shapes(saved), _parameter_shapes(live)
    for name, shape in now.items():
        if name in was and was[name] != shape:
            return _shape_difference(name, was[name], shape)
    return None


def _parameter_shapes(record: ModelRecord) -> dict[str, Shape]:
    shapes = {name: shape for group in record.groups or [] for name, shape in group}
    shapes.update(record.frozen or {})
    return shapes


def _frozen_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    if saved.frozen is None or live.frozen is None:
        return None
    for name, shape in live.frozen.items():
        if name not in saved.frozen and name not in saved.held:
            return f"this model's frozen parameter '{name}' is not in the checkpoint. {MODEL_HINT}"
        if name in saved.frozen and saved.frozen[name] != shape:
            return _shape_difference(name, saved.frozen[name], shape)
    for name in saved.frozen:
        if name not in live.frozen and name not in live.held:
            return f"the checkpoint's frozen parameter '{name}' is not in this model. {MODEL_HINT}"
    return None


def _tensor_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    """Shapes; dtypes between integer and floating point (another tensor). Another floating-point precision
    (switching bf16 on after a stop) is a warning: DeepSpeed's load casts, the optimizer's fp32 master is exact."""
    warned = False
    for name, (shape, dtype) in live.tensors.items():
        if name not in saved.tensors:
            continue
        was_shape, was_dtype = saved.tensors[name]
        if was_dtype != dtype and not {was_dtype, dtype} <= FLOAT_DTYPES:
            return (f"'{name}' is {was_dtype} in the checkpoint and {dtype} in this model. HINT: resume with the "
                    "model the checkpoint was written with, or start a new run in another output_dir")
        if was_dtype != dtype and not warned:
            warned = True
            logger.warning("slurm_jit: '%s' is %s in the checkpoint and %s in this model: loaded in this run's "
                           "precision (the fp32 master weights the optimizer holds are restored as saved)",
                           name, was_dtype, dtype)
        if shape is not None and was_shape is not None and was_shape != shape:
            return _shape_difference(name, was_shape, shape)
    return None


# ---------------------------------------------------------------- the two records


def saved_record(tag_dir: Path) -> ModelRecord | None:
    """What rank 0's model-states file in ``tag_dir`` records (memory-mapped: no tensor is read), or None."""
    import torch

    for name in MODEL_STATES_NAMES:
        path = tag_dir / name
        if not path.is_file():
            continue
        try:
            saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed's own load says what is wrong with the file
            logger.warning("slurm_jit: %s: not read (%s): the model is not compared before the load", path, exc)
            return None
        return record_of_states(saved, default_stage=ZERO3 if name.startswith("zero_pp") else None)
    return None


def record_of_states(saved: Any, default_stage: int | None = None) -> ModelRecord | None:
    """What a loaded model-states dict records (``default_stage``: when its ds_config does not say)."""
    if not isinstance(saved, dict):
        return None
    config = saved.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = _int(zero.get("stage")) if isinstance(zero, dict) else None
    stage = default_stage if stage is None else stage
    shapes = saved.get("param_shapes")
    shapes = [shapes] if isinstance(shapes, dict) else shapes
    groups = ([[(str(n), tuple(int(d) for d in s)) for n, s in g.items()] for g in shapes]
              if isinstance(shapes, list) and all(isinstance(g, dict) for g in shapes) else None)
    frozen = saved.get("frozen_param_shapes")
    buffers = saved.get("buffer_names")
    shared = saved.get("shared_params")
    module = saved.get("module") if isinstance(saved.get("module"), dict) else {}
    params = {n for g in groups or [] for n, _ in g} | set(frozen or {}) | set(shared or {})
    # A PEFT JIT save's placeholders (ZeRO-1/2) are left-out weights, as a slim save's absent keys; ZeRO-3's
    # module entries are all empty, recorded with the shape None
    left_out = {n for n, t in module.items() if stage != ZERO3 and n in params and is_placeholder(t)}
    tensors = {str(n): (None if stage == ZERO3 and n in params else tuple(t.shape), str(t.dtype))
               for n, t in module.items() if hasattr(t, "shape") and hasattr(t, "dtype") and n not in left_out}
    return ModelRecord(
        zero_stage=stage, groups=groups,
        frozen={str(n): tuple(int(d) for d in s) for n, s in frozen.items()} if isinstance(frozen, dict) else None,
        buffers={str(b) for b in buffers} if isinstance(buffers, list) else None,
        shared={str(a): str(o) for a, o in shared.items()} if isinstance(shared, dict) else None, tensors=tensors)


def is_placeholder(tensor: Any) -> bool:
    """Whether a saved module entry is a PEFT JIT save's placeholder of a left-out weight (its shape)."""
    return tuple(getattr(tensor, "shape", ())) == PLACEHOLDER_SHAPE


def live_record(engine: Any) -> ModelRecord:
    """What a checkpoint written by ``engine`` now would record (DeepSpeed's own functions where it has them)."""
    module = engine.module
    stage = int(engine.zero_optimization_stage())
    groups = None
    if stage and getattr(engine, "optimizer", None) is not None:
        groups = [[(n, tuple(int(d) for d in s)) for n, s in g.items()] for g in engine._get_zero_param_shapes()]
    held = {n for g in groups or [] for n, _ in g}
    frozen = {n: _shape(p) for n, p in module.named_parameters() if n not in held} if groups is not None else None
    tensors: dict[str, tuple[Shape | None, str]] = {
        n: (None if stage == ZERO3 else _shape(p), str(p.dtype))
        for n, p in module.named_parameters(remove_duplicate=False)}
    buffers = _persistent_buffers(module)
    tensors.update((n, (tuple(b.shape), str(b.dtype))) for n, b in buffers.items())
    return ModelRecord(zero_stage=stage, groups=groups, frozen=frozen, buffers=set(buffers),
                       shared=_shared_params(module, stage == ZERO3), tensors=tensors)


def _shape(param: Any) -> Shape:
    return tuple(int(d) for d in getattr(param, "ds_shape", param.shape))


def _persistent_buffers(module: Any) -> dict[str, Any]:
    """As engine._get_buffer_names: every persistent buffer, by its state-dict name."""
    return {f"{prefix}.{name}" if prefix else name: buf
            for prefix, mod in module.named_modules(remove_duplicate=False)
            for name, buf in mod.named_buffers(recurse=False)
            if buf is not None and name not in mod._non_persistent_buffers_set}


def _shared_params(module: Any, zero3: bool) -> dict[str, str]:
    """As engine._get_shared_params (which runs on rank 0 only): alias -> the first name of the same weights."""
    first: dict[Any, str] = {}
    shared: dict[str, str] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, param in mod.named_parameters(recurse=False):
            if param is None or (zero3 and not hasattr(param, "ds_id")):
                continue
            key = f"{prefix}.{name}" if prefix else name
            ident = param.ds_id if zero3 else param.data_ptr()
            if ident in first:
                shared[key] = first[ident]
            else:
                first[ident] = key
    return shared


def pick_refusal(ckpt_dir: str, model: Any) -> str | None:
    """Why ``model`` (built, no engine yet) must not be resumed from ``ckpt_dir`` on another world size, or None:
    the names, shapes and ties of its parameters against those rank 0's original model-states file records, by
    name (the universal copy is loaded so). Asked before the elastic conversion, so that a checkpoint of another
    model is refused without ``universal/`` being written into it."""
    tag = _read_latest_tag(Path(ckpt_dir))
    saved = saved_record(Path(ckpt_dir) / tag) if tag else None
    if saved is None or model is None:
        return None
    built = _built_record(model)
    why = _tie_difference(saved, built) or _named_shape_difference(saved, built) or _name_difference(saved, built)
    return f"{ckpt_dir}: {why}" if why else None


def _built_record(model: Any) -> ModelRecord:
    """A built model's parameter names, shapes, trainable set and ties (no dtypes: the engine casts them later;
    ties by object, as named_parameters tells them: a ZeRO-3 partitioned parameter's storage is empty)."""
    params = dict(model.named_parameters())
    first: dict[int, str] = {id(p): n for n, p in reversed(params.items())}
    shared = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != n}
    return ModelRecord(groups=[[(n, _shape(p)) for n, p in params.items() if p.requires_grad]],
                       frozen={n: _shape(p) for n, p in params.items() if not p.requires_grad}, shared=shared,
                       tensors={n: (None, str(p.dtype)) for n, p in params.items()})  # the model's order only


def _name_difference(saved: ModelRecord, live: ModelRecord) -> str | None:
    """A parameter on one side only (held, frozen or a tied alias on the other: the elastic path's to check)."""
    saved_names = saved.held | set(saved.frozen or {}) | set(saved.shared or {})
    if saved.frozen is None:  # ZeRO-1: the frozen ones are module entries
        saved_names |= set(saved.tensors) - (saved.buffers or set())
    live_names = live.held | set(live.frozen or {}) | set(live.shared or {})
    for name in _in_order(live.held | set(live.frozen or {}), live):
        if name not in saved_names:
            return f"this model's parameter '{name}' is not in the checkpoint (renamed, or another model). {MODEL_HINT}"
    for name in _in_order(saved.held | set(saved.frozen or {}), saved):
        if name not in live_names:
            return f"the checkpoint's parameter '{name}' is not in this model (renamed, or another model). {MODEL_HINT}"
    return None


def load_refusal(engine: Any, checkpoint_path: str) -> str | None:
    """Why ``engine`` must not load the DeepSpeed checkpoint in ``checkpoint_path`` (the tag its ``latest`` names;
    a universal copy's ``latest_universal``: compared by name), as one line with a HINT, or None (also when the
    checkpoint records nothing to compare)."""
    universal = bool(engine.load_universal_checkpoint())
    tag = _read_latest_tag(Path(checkpoint_path), LATEST_UNIVERSAL if universal else LATEST)
    if not tag:
        return None
    saved = saved_record(Path(checkpoint_path) / tag)
    if saved is None:
        return None
    why = difference(saved, live_record(engine), by_name=universal)
    return f"{checkpoint_path}: {why}" if why else None
