"""The slim JIT save: DeepSpeed's model-states file without the module weights the ZeRO optimizer already holds.

Under ZeRO-1/2 DeepSpeed's ``save_checkpoint`` writes ``mp_rank_00_model_states.pt`` with the whole
``module_state_dict()`` beside the fp32 master partitions every rank writes into its optimizer shard: the trainable
weights twice (issue 10 measured 405 MB written for 304 MB needed). A JIT save races SIGKILL, so it writes them
once: :func:`slim_model_states` leaves out of that file's ``module`` every tensor the optimizer holds, and keeps
what it does not (persistent buffers, frozen parameters) and every other key (``buffer_names``,
``param_shapes``, ``ds_config``, scheduler, steps, ...), so that DeepSpeed's ``zero_to_fp32`` still rebuilds the
whole model from it. The manifest records the layout (``weights: fp32-master-only``).

Resuming it takes a load path of our own around DeepSpeed's (:func:`install_load`, every ZeRO-1/2 load: what the
file holds decides, not the manifest): ``load_checkpoint`` with a module load that accepts exactly the left-out
keys (any other missing key is refused), DeepSpeed restoring the fp32 master partitions from the shards
(``load_from_fp32_weights``, its default), then the module weights rebuilt from them as the end of an optimizer
step does (``update_lp_params``: each rank copies its fp32 partition into its
16-bit partition, then all-gather). The copy is the optimizer step's own, so the weights are bit for bit the ones
at the stop. A plain ``transformers.Trainer`` cannot resume such a checkpoint of a model that is not PEFT
(DeepSpeed's strict module load refuses it: README). ZeRO-3's model-states files hold placeholders only: its
every save is master-only already, and DeepSpeed's own load restores it.

A PEFT model's periodic and final saves are transformers' (:func:`excludes_frozen`: ``exclude_frozen_parameters``):
the model-states file holds the trainable weights (the adapters) and no frozen ones, which are the model as built
(the base the user's script loads); both trainers load it back non-strict (``weights: frozen-excluded``). Its JIT
save leaves the frozen base out too, and the adapters (their fp32 master is in the shards): each held key stays in
the module as a zero-element placeholder (:func:`placeholder`, shape [0]), a few bytes, because a plain Trainer
loads a PEFT module non-strict and would silently keep the adapters as built where a key were simply missing;
torch's ``load_state_dict`` raises on the size mismatch whatever ``strict`` says. :func:`load_slim` drops the
placeholders of held names and rebuilds those weights as above; one of a name not held is refused
(``weights: frozen-excluded-master-only``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint.manifest import (
    MASTER_ONLY,
    WEIGHTS_FROZEN_EXCLUDED,
    WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY,
    WEIGHTS_FULL,
    WEIGHTS_MASTER_ONLY,
    ZERO3,
)
from slurm_jit.train import model_match
from slurm_jit.train.model_match import PLACEHOLDER_SHAPE, is_placeholder
from slurm_jit.train.refusals import JitRefusal

logger = logging.getLogger(__name__)

SLIM_STAGES = (1, 2)  # the stages whose model-states file holds the weights again (stage_1_and_2's optimizer)
SHOWN_KEYS = 3  # of the keys a refusal names


def slim_capable(engine: Any) -> bool:
    """Whether this engine's JIT save can leave the weights out: a ZeRO-1/2 optimizer that rebuilds the module
    weights from its fp32 partitions (MoE engines write their own files: left as they are)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = getattr(engine, "optimizer", None)
    return (isinstance(optimizer, DeepSpeedZeroOptimizer) and hasattr(optimizer, "update_lp_params")
            and hasattr(optimizer, "bit16_groups") and not getattr(engine, "has_moe_layers", False))


def excludes_frozen(model: Any, engine: Any) -> bool:
    """Whether transformers' save of ``model`` leaves the frozen parameters out: a PEFT model, whose frozen base it
    loads back from the model as built (its adapter files; with DeepSpeed, ``Trainer._save_optimizer_and_scheduler``'s
    own test: ``exclude_frozen_parameters``). ``engine``: the DeepSpeed engine, or None."""
    if not _is_peft_model(model):
        return False
    return engine is None or "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters


def _is_peft_model(model: Any) -> bool:
    """transformers' own test (the Trainer's saves and loads ask it), or the one it stands for if it moved: a
    failing import must not turn a JIT stop into a traceback."""
    try:
        from transformers.trainer_utils import _is_peft_model as upstream
    except ImportError:
        try:
            from peft import PeftMixedModel, PeftModel
        except ImportError:
            return False
        return isinstance(model, PeftModel | PeftMixedModel)
    return bool(upstream(model))


def layout(engine: Any, slim: bool, frozen_excluded: bool = False) -> str:
    """The weights layout of a save by ``engine`` (None: no DeepSpeed); ``slim``: :func:`slim_model_states` wrote it;
    ``frozen_excluded``: transformers' save of a PEFT model (:func:`excludes_frozen`) wrote it."""
    if engine is not None and engine.zero_optimization_stage() == ZERO3:
        return WEIGHTS_MASTER_ONLY
    if slim:
        return WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY if frozen_excluded else WEIGHTS_MASTER_ONLY
    return WEIGHTS_FROZEN_EXCLUDED if frozen_excluded else WEIGHTS_FULL


def held_names(engine: Any) -> set[str]:
    """The module's state-dict names of the parameters the ZeRO-1/2 optimizer holds (tied names included)."""
    held = {id(p) for group in engine.optimizer.bit16_groups for p in group}
    return {name for name, p in engine.module.named_parameters(remove_duplicate=False) if id(p) in held}


def placeholder(tensor: Any) -> Any:
    """The module entry of a left-out weight in a PEFT JIT save: no elements, the weight's dtype, on the CPU."""
    import torch

    return torch.empty(PLACEHOLDER_SHAPE, dtype=tensor.dtype)


@contextmanager
def slim_model_states(engine: Any, placeholders: bool = False) -> Iterator[bool]:
    """While inside, the engine's ``save_checkpoint`` writes a model-states file whose ``module`` leaves out the
    weights the optimizer holds (``placeholders``: keeps each key, a :func:`placeholder` for a PEFT model); yields
    whether it does (False: not a ZeRO-1/2 engine, the save is DeepSpeed's)."""
    if engine is None or not slim_capable(engine):
        yield False
        return
    names = held_names(engine)
    save = engine.save_checkpoint

    # save's signature: transformers passes exclude_frozen_parameters only where the signature has it (PEFT)
    @functools.wraps(save)
    def slim_save(*args: Any, **kwargs: Any) -> Any:
        full = engine.module_state_dict

        def module_state_dict(*sd_args: Any, **sd_kwargs: Any) -> Any:
            state = full(*sd_args, **sd_kwargs)
            prefix = sd_kwargs.get("prefix", "")
            for name in names:
                left_out = state.pop(prefix + name, None)
                if placeholders and left_out is not None:
                    state[prefix + name] = placeholder(left_out)
            return state

        with _swapped(engine, "module_state_dict", module_state_dict):
            return save(*args, **kwargs)

    with _swapped(engine, "save_checkpoint", slim_save):
        yield True


@contextmanager
def frozen_left_out(engine: Any) -> Iterator[None]:
    """While inside, the engine's ``module_state_dict(exclude_frozen_parameters=True)`` (transformers' save of a PEFT
    model) leaves out every name of a frozen parameter: DeepSpeed drops each under its first name only, so a frozen
    embedding tied to the output layer stayed in whole (``lm_head.weight``). None, or a ZeRO-3 engine: as it is."""
    if engine is None or engine.zero_optimization_stage() not in SLIM_STAGES:
        yield
        return
    frozen = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    full = engine.module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> Any:
        state = full(*args, **kwargs)
        if kwargs.get("exclude_frozen_parameters"):
            for name in frozen:
                state.pop(kwargs.get("prefix", "") + name, None)
        return state

    with _swapped(engine, "module_state_dict", module_state_dict):
        yield


@contextmanager
def _swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` while inside; then what it was (an instance attribute, or the class's method)."""
    before = obj.__dict__.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is None:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


# ---------------------------------------------------------------- resume


def resume_refusal(ckpt_dir: str, manifest: dict[str, Any], ds_config: dict[str, Any] | None) -> str | None:
    """Why this run cannot resume a master-only ZeRO-1/2 checkpoint (one line, HINT), or None."""
    if not _slim_zero12(manifest):
        return None
    zero = (ds_config or {}).get("zero_optimization") or {}
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage not in SLIM_STAGES:
        return (f"{ckpt_dir}: its module weights are only in the ZeRO-{manifest.get('zero_stage')} optimizer "
                f"shards (a slim JIT save), and this run uses ZeRO stage {stage}. HINT: resume with ZeRO stage "
                f"{manifest.get('zero_stage')}, or export the weights with DeepSpeed's zero_to_fp32.py")
    if zero.get("load_from_fp32_weights") is False:
        return (f"{ckpt_dir}: its module weights are only in the fp32 master partitions of the optimizer shards (a "
                "slim JIT save), and zero_optimization.load_from_fp32_weights is false. HINT: leave "
                "load_from_fp32_weights at its default (true)")
    return None


def _slim_zero12(manifest: dict[str, Any] | None) -> bool:
    return (manifest is not None and manifest.get("zero_stage") in SLIM_STAGES
            and manifest_file.weights_layout(manifest) in MASTER_ONLY)


def _is_slim(checkpoint_path: str) -> bool:
    path = Path(checkpoint_path)
    if not (path / manifest_file.MANIFEST_NAME).is_file():
        return False
    manifest, _ = manifest_file.read(path)
    return _slim_zero12(manifest)


def load_slim(engine: Any, checkpoint_path: str, load_module_strict: bool = True) -> None:
    """DeepSpeed's ``load_checkpoint`` with a module load of our own: the weights the ZeRO-1/2 optimizer holds that
    the saved module leaves out (a slim JIT save: the file says so, whatever the manifest says) are rebuilt from the
    fp32 master partitions it restored; all of them when the manifest says master-only, whatever the file holds (a
    weight put back into it by hand would otherwise run the first step, the master the rest). Raises JitRefusal
    (one line) when the saved module lacks a key the optimizer does not hold (another model), or the engine cannot
    rebuild the left-out ones."""
    if not slim_capable(engine):
        raise JitRefusal(_unrebuildable(checkpoint_path))
    names = held_names(engine)
    master_only = _is_slim(checkpoint_path)
    left_out: list[str] = []
    from_file: list[str] = []  # held weights the saved module holds (a full save's, or one put back by hand)

    def load_module(src: dict[str, Any], dst: Any) -> None:
        misfit = _module_misfit(src, dst.state_dict(), names, load_module_strict)
        if misfit:
            raise JitRefusal(f"slurm_jit: {checkpoint_path}: the saved module does not fit this model ({misfit}). "
                             "HINT: resume with the model the checkpoint was written with (a PEFT model: the same "
                             "adapter config, its rank and target modules)")
        # a placeholder of a held weight (a PEFT JIT save) is a left-out one: rebuilt from the fp32 master below
        kept = {k: t for k, t in src.items() if not (k in names and is_placeholder(t))}
        left_out[:] = sorted(set(dst.load_state_dict(kept, strict=False).missing_keys) & names)
        from_file[:] = sorted(names & set(kept))
        if (left_out or master_only) and not engine.zero_load_from_fp32_weights():  # before the shards
            raise JitRefusal(_unrebuildable(checkpoint_path))

    load_path, _ = engine.load_checkpoint(checkpoint_path, load_module_strict=False, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, custom_load_fn=load_module)
    if load_path is None:
        raise ValueError(f"[deepspeed] failed to resume from checkpoint {checkpoint_path}")
    if left_out or master_only:
        _rebuild(engine, checkpoint_path, len(left_out), from_file if master_only else [])


def _rebuild(engine: Any, checkpoint_path: str, left_out: int, ignored: list[str]) -> None:
    """The module weights from the fp32 master partitions; ``ignored``: held weights the file of a master-only
    checkpoint holds after all (edited by hand), whose copy the rebuild overwrites (a warning names the first)."""
    engine.optimizer.update_lp_params()  # the end of an optimizer step: fp32 partitions -> module weights
    if ignored:
        logger.warning("slurm_jit: %s: its manifest says the trained weights are only in the fp32 master partitions, "
                       "and its module file holds %d of them (edited after the save?), first '%s': ignored, every "
                       "one rebuilt from the fp32 master as saved", checkpoint_path, len(ignored), ignored[0])
    logger.info("slurm_jit: %s: %d module weights rebuilt from the fp32 master partitions (slim JIT save)",
                checkpoint_path, left_out + len(ignored))


def _module_misfit(saved: dict[str, Any], built: dict[str, Any], held: set[str], strict: bool) -> str | None:
    """What in the saved module does not fit the built one (its state dict), or None: a placeholder of a weight the
    optimizer does not hold (another model or adapter config: nothing would rebuild it), a key of another shape (a
    LoRA of another rank: torch's load would raise a traceback), a key the model lacks (another adapter set: the
    non-strict load of a PEFT model would ignore it), some held weights saved and others not (a slim save leaves
    all of them out, any other save none); strict, or a slim save (a PEFT model's frozen base missing from a
    checkpoint of another model: DeepSpeed's KeyError), also a missing key the optimizer does not hold."""
    unheld = sorted(n for n, t in saved.items() if n not in held and is_placeholder(t)
                    and tuple(getattr(built.get(n), "shape", ())) != PLACEHOLDER_SHAPE)
    if unheld:
        return f"left out in it, not held by this run's optimizer: {unheld[:SHOWN_KEYS]}"
    for name, tensor in saved.items():
        if name in held and is_placeholder(tensor):
            continue
        if name in built and tuple(getattr(tensor, "shape", ())) != tuple(built[name].shape):
            return f"{name}: shape {list(tensor.shape)} saved, {list(built[name].shape)} now"
    unexpected = sorted(set(saved) - set(built))
    missing_held = sorted(held - set(saved))
    slim = bool(held) and len(missing_held) == len(held & set(built))  # keeps every weight it does not hold
    uncovered = sorted(set(built) - set(saved) - held) if strict or slim else []
    if unexpected or uncovered:
        return (f"missing, not held by the optimizer: {uncovered[:SHOWN_KEYS]}; unexpected: "
                f"{unexpected[:SHOWN_KEYS]}")
    if missing_held and not slim:
        return f"trained weights missing from it: {missing_held[:SHOWN_KEYS]}"
    return None


def _unrebuildable(checkpoint_path: str) -> str:
    return (f"slurm_jit: {checkpoint_path}: its module weights are only in the fp32 master partitions of the "
            "ZeRO-1/2 optimizer shards, which this engine does not restore. HINT: resume with the ZeRO stage it "
            "was written with and load_from_fp32_weights left true")


def _has_deepspeed_tag(checkpoint_path: str) -> bool:
    """transformers' own test before its DeepSpeed load (no global_step* directory: its ValueError)."""
    return any(Path(checkpoint_path).glob("global_step*"))


ORIGINAL_ATTR = "slurm_jit_slim_original"  # not elastic.py's attribute: its wrapper goes on top of this one


def install_load() -> None:
    """Until :func:`uninstall_load`, the Trainer's DeepSpeed loads (the resume, the best model at the end) by a
    ZeRO-1/2 engine, or of a checkpoint whose manifest says master-only ZeRO-1/2, go through :func:`load_slim`;
    every other load (ZeRO-3, universal copies, no DeepSpeed tag) is transformers' own. Before each of them the
    checkpoint's model is compared with the engine's (model_match.py: JitRefusal)."""
    import transformers.trainer as hf_trainer

    current: Callable[..., Any] = hf_trainer.deepspeed_load_checkpoint
    if hasattr(current, ORIGINAL_ATTR):
        return

    def load(engine: Any, checkpoint_path: str, load_module_strict: bool = True) -> None:
        universal = engine.load_universal_checkpoint()  # elastic.py's copy: compared by name, not by position
        if _has_deepspeed_tag(checkpoint_path):  # every DeepSpeed load: slim, full, ZeRO-3, universal
            refusal = model_match.load_refusal(engine, checkpoint_path)
            if refusal:
                raise JitRefusal(f"slurm_jit: {refusal}")
        # Every ZeRO-1/2 load, not only those whose manifest says slim: an edited or lost manifest must not turn
        # the left-out weights into a traceback or, with load_module_strict=False (PEFT), the built model's ones.
        ours = slim_capable(engine) or _is_slim(checkpoint_path)
        if universal or not _has_deepspeed_tag(checkpoint_path) or not ours:
            current(engine, checkpoint_path, load_module_strict=load_module_strict)
        else:
            load_slim(engine, checkpoint_path, load_module_strict=load_module_strict)

    setattr(load, ORIGINAL_ATTR, current)
    hf_trainer.deepspeed_load_checkpoint = load


def uninstall_load() -> None:
    import transformers.trainer as hf_trainer

    hf_trainer.deepspeed_load_checkpoint = getattr(hf_trainer.deepspeed_load_checkpoint, ORIGINAL_ATTR,
                                                   hf_trainer.deepspeed_load_checkpoint)
