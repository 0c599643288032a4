"""JIT for any Trainer subclass (TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, a framework's own): the
class order, :func:`with_jit`, and the check of what the subclass's other classes do to the hooks JitTrainer needs.

``class MyTrainer(JitTrainer, SFTTrainer)``: JitTrainer comes first in the method resolution order, so each of
its hooks runs first and hands on to the framework's override through ``super()``, which hands on to the
Trainer's. The other order puts the framework's hooks outside JitTrainer's (its ``__init__`` gets ``jit_config``)
and is refused when the class is defined. The drop-in ``transformers.Trainer = JitTrainer`` (before a framework
imports it) makes the framework's classes subclasses of JitTrainer: allowed, with the hooks check below.
docs/stacks.md says, hook by hook, what is kept and what is replaced.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from slurm_jit.train import compat
from slurm_jit.train.refusals import JitRefusal

logger = logging.getLogger(__name__)
_MADE: dict[type, type] = {}  # with_jit's classes, by the class they add JIT to

# What JitTrainer's overrides pass on through super(): (positional, keyword) parameter names. A class between
# JitTrainer and the Trainer that overrides one of these must take that call.
SUPER_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    **{name: (params, ()) for name, params in compat.TRAINER_HOOKS.items()},
    "train": ((), ("resume_from_checkpoint", "trial", "ignore_keys_for_eval")),
    "prediction_step": (("model", "inputs", "prediction_loss_only"), ("ignore_keys",)),
    "save_model": (("output_dir",), ("_internal_call",)),
    "evaluate": ((), ()),  # a pass-through: what its caller gives it
}
# Hooks whose upstream implementation must run: an override that never calls super() leaves the JIT stop
# (train, _maybe_log_save_evaluate: the step boundary), the checkpoint's files (_save_checkpoint) or the exact
# resume (_load_optimizer_and_scheduler, _load_rng_state) undone. Refused in any class. The other hooks may be
# replaced (TRL's prediction_step is): above JitTrainer that costs a JitTrainer feature, said in one warning.
MUST_CALL_SUPER = ("train", "_maybe_log_save_evaluate", "_save_checkpoint", "_load_optimizer_and_scheduler",
                   "_load_rng_state")
REPLACED_COST = {  # what a class above JitTrainer loses when it replaces the hook without super()
    "prediction_step": "an evaluation is not aborted by a stop (the stop waits for its end)",
    "evaluate": "an evaluation may move training's random streams (the resume may not be bitwise)",
    "_evaluate": "an evaluation is not timed nor aborted for a stop",
    "_get_dataloader": "DataLoader workers are not shielded from the stop signals",
    "save_model": "a JIT save writes the consolidated weights too",
    "_determine_best_metric": "an aborted evaluation may be taken for the best one",
    "_load_best_model": "a stopped run loads the best model on its way out",
    "_finish_current_push": "a stopped run waits for the Hub push",
    "_finalize_training": "save_total_limit=1 may delete the JIT checkpoint at the end",
}


def real_trainer(jit_cls: type) -> type:
    """The ``transformers.Trainer`` that ``jit_cls`` really subclasses (``transformers.Trainer`` may since have
    been set to JitTrainer by the drop-in)."""
    for klass in jit_cls.__mro__[1:]:
        if klass.__name__ == "Trainer" and klass.__module__ == "transformers.trainer":
            return klass
    return jit_cls.__mro__[1]


def refuse_wrong_order(cls: type, jit_cls: type) -> None:
    """Raise JitRefusal (one line) when another Trainer subclass comes before ``jit_cls`` in ``cls``'s MRO."""
    mro = cls.__mro__
    base = real_trainer(jit_cls)
    before = [k for k in mro[:mro.index(jit_cls)] if issubclass(k, base) and not issubclass(k, jit_cls)]
    if before:
        names = ", ".join(k.__name__ for k in before)
        raise JitRefusal(f"slurm_jit: class {cls.__name__} puts {names} before {jit_cls.__name__}: its hooks would "
                         f"run outside {jit_cls.__name__}'s (and its __init__ gets jit_config). HINT: class "
                         f"{cls.__name__}({jit_cls.__name__}, {before[0].__name__}), or "
                         f"slurm_jit.with_jit({before[0].__name__})")


def with_jit(trainer_cls: type, JitTrainer: type) -> type:  # noqa: N803 - the class itself, as trainer.py passes it
    """``trainer_cls`` (a Trainer subclass such as TRL's SFTTrainer) with JIT checkpoints: the class
    ``Jit<Name>(JitTrainer, trainer_cls)``; the same class on every call, ``trainer_cls`` itself when it already
    has JitTrainer, JitTrainer for the Trainer itself (``slurm_jit.with_jit``, trainer.py)."""
    base = real_trainer(JitTrainer)
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, base)):  # before the cache: a list is no key
        raise JitRefusal(f"slurm_jit: with_jit({getattr(trainer_cls, '__name__', repr(trainer_cls))}): not a "
                         "transformers.Trainer subclass. HINT: pass the Trainer class itself, e.g. "
                         "with_jit(SFTTrainer)")
    if issubclass(trainer_cls, JitTrainer):
        return trainer_cls
    if trainer_cls is base:
        return JitTrainer
    return _jit_class(trainer_cls, JitTrainer)


def _jit_class(trainer_cls: type, jit_cls: type) -> type:
    """``Jit<Name>(jit_cls, trainer_cls)``, made once: the same class on every call."""
    made = _MADE.get(trainer_cls)
    if made is None:
        name = f"Jit{trainer_cls.__name__}"
        doc = f"{trainer_cls.__name__} with slurm-jit's JIT checkpoints (slurm_jit.with_jit)."
        made = _MADE.setdefault(trainer_cls, type(name, (jit_cls, trainer_cls), {
            "__module__": trainer_cls.__module__, "__doc__": doc, "__qualname__": name}))
    return made


def refuse_unsaved_jit(trainer: Any, saved_step: int, jit_cls: type) -> None:
    """After the JIT save: raise JitRefusal (one line) when it wrote no checkpoint of this step. The class check
    sees that an override of ``_save_checkpoint`` calls super(), not that every path does (``if ...: super()...``):
    a skipped JIT save must not be recorded as a JIT stop at a checkpoint that is not there."""
    step = trainer.state.global_step
    if saved_step == step:
        return
    mro = type(trainer).__mro__
    owners = [k.__name__ for k in mro[:mro.index(jit_cls)] if "_save_checkpoint" in vars(k)] or ["a subclass"]
    raise JitRefusal(f"slurm_jit: the JIT save of step {step} wrote no checkpoint: {owners[0]}._save_checkpoint() "
                     "did not call super()._save_checkpoint() on this path; training stopped without one. HINT: "
                     f"call super()._save_checkpoint(model, trial) on every path of {owners[0]}._save_checkpoint; "
                     "resume from the checkpoint `ckpt-check OUT_DIR` names")


def _calls_super(func: Any) -> bool:
    code = getattr(inspect.unwrap(func), "__code__", None)
    return code is None or "super" in code.co_names  # not Python code: not ours to judge


def _call_problem(func: Any, name: str) -> str | None:
    """Why ``func`` cannot take the call JitTrainer's override of ``name`` makes through super(), or None."""
    positional, keywords = SUPER_CALLS[name]
    try:
        inspect.signature(func).bind(None, *positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        return str(exc)
    except ValueError:  # no signature to read (a C function)
        return None
    return None


def _refusal(owner: type, name: str, why: str, jit_cls: type, hint: str) -> JitRefusal:
    return JitRefusal(f"slurm_jit: {owner.__name__}.{name}() {why}: {jit_cls.__name__} cannot keep its JIT "
                      f"checkpoints with it. HINT: {hint}")


def _check_below(cls: type, jit_cls: type, owner: type, name: str) -> None:
    """``owner`` sits between JitTrainer and the Trainer: JitTrainer's override calls it through super()."""
    func = vars(owner)[name]
    problem = _call_problem(func, name)
    if problem:
        positional, keywords = SUPER_CALLS[name]
        call = ", ".join([*positional, *(f"{k}=..." for k in keywords)])
        raise _refusal(owner, name, f"cannot take JitTrainer's call {name}({call}) ({problem})", jit_cls,
                       f"give {owner.__name__}.{name} those parameters (or *args, **kwargs)")
    if name in MUST_CALL_SUPER and not _calls_super(func):
        raise _refusal(owner, name, "never calls super()", jit_cls,
                       f"call super().{name}(...) in {owner.__name__}.{name}")


def _check_above(cls: type, jit_cls: type, owner: type, name: str) -> None:
    """``owner`` subclasses JitTrainer (the drop-in, or a user's subclass): it runs before JitTrainer's hook."""
    func = vars(owner)[name]
    if _calls_super(func):
        return
    if name in MUST_CALL_SUPER:
        raise _refusal(owner, name, f"replaces {jit_cls.__name__}.{name}() without super()", jit_cls,
                       f"call super().{name}(...) in {owner.__name__}.{name}")
    logger.warning("slurm_jit: %s.%s() replaces %s.%s() (no super()): %s. HINT: call super().%s(...) there; a "
                   "framework's class made a JitTrainer by the transformers.Trainer drop-in keeps both as "
                   "slurm_jit.with_jit(%s) instead", owner.__name__, name, jit_cls.__name__, name,
                   REPLACED_COST.get(name, "its JIT part is skipped"), name, owner.__name__)


def check_hooks(cls: type, jit_cls: type) -> None:
    """At construction: the installed Trainer has the hooks JitTrainer needs (the Trainer that ``jit_cls``
    subclasses, not ``transformers.Trainer`` as it is now: the drop-in may have set it to JitTrainer), and every
    override of them in ``cls``'s other classes is one JitTrainer can live with. Raises JitRefusal (one line)."""
    compat.check_trainer_hooks(trainer_cls=real_trainer(jit_cls), jit_cls=jit_cls)
    _check_overrides(cls, jit_cls)


@functools.cache  # a class's overrides do not change: checked (and warned about) once
def _check_overrides(cls: type, jit_cls: type) -> None:
    base = real_trainer(jit_cls)
    mro = cls.__mro__
    at = mro.index(jit_cls)
    for position, owner in enumerate(mro):
        if owner is jit_cls or owner is base or not issubclass(owner, base):
            continue
        for name in SUPER_CALLS:
            if name in vars(owner):
                (_check_above if position < at else _check_below)(cls, jit_cls, owner, name)
