"""What an async periodic save collects instead of writing (``periodic.collecting`` installs these for one save).

:class:`CollectingEngine` stands in for DeepSpeed's torch checkpoint engine, and for safetensors' ``save_file``
wherever a loaded module names it (:func:`safetensors_collected`): the training thread's writes into the checkpoint
directory are kept as (path, state), every other write goes through. :func:`state_dict_uncloned` makes accelerate's
``get_state_dict`` the module's own state dict (no clone in training's time), a tied weight replaced by a
placeholder that the staging fills from its source (:func:`unaliased`), so that save_pretrained writes the file the
synchronous save writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from slurm_jit.train.async_save import files

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike

DEEPSPEED_TAG = re.compile(r"(^|/)global_step\d+(/|$)")  # save_checkpoint's default tag folder (the Trainer's)
ZERO3 = 3  # ZeRO-3's get_state_dict gathers the partitioned weights: never replaced by the module's state dict
SAFETENSORS_NAMES = ("save_file", "safe_save_file")  # the names modules give safetensors.torch.save_file


class CollectingEngine:
    """Stands in for DeepSpeed's torch checkpoint engine during one save: ``save`` collects (path, state) instead
    of writing (a legacy-format file, which the background writer does not write, is written at once); everything
    else is the original's. Only this save's files are collected: a call from another thread, or for a path outside
    the checkpoint directory (a ``save_model`` override's export, a user's thread), writes at once as it would have.
    """

    def __init__(self, original: Any, ckpt: Path, safetensors_save: Callable[..., Any]) -> None:
        self.original = original
        self.ckpt = ckpt
        self.safetensors_save = safetensors_save  # the original save_file, for the calls that are not the save's
        self.thread = threading.get_ident()
        self.collected: list[tuple[Path, Any]] = []
        self.sources: dict[int, torch.Tensor] = {}  # a placeholder's storage (_cdata) -> the tensor it stands for
        self.splits: dict[int, torch.Tensor] = {}  # a split view's own storage (_cdata) -> the view it was made of
        self.made: list[torch.Tensor] = []  # the placeholders and split views, alive while their _cdata are keys

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    def _ours(self, path: str | os.PathLike[str]) -> bool:
        return threading.get_ident() == self.thread and Path(os.path.abspath(path)).is_relative_to(
            os.path.abspath(self.ckpt))

    def save(self, state_dict: Any, path: str) -> None:
        if not self.original.zipfile_serialization or not self._ours(path):
            self.original.save(state_dict, path)
            return
        self.collected.append((Path(path), state_dict))

    def save_safetensors(self, tensors: dict[str, Any], filename: str, metadata: dict[str, str] | None = None,
                         ) -> Any:
        """Stands in for ``safetensors.torch.save_file`` (save_pretrained's call): kept to be staged and written."""
        if not self._ours(filename):
            return self.safetensors_save(tensors, filename, metadata=metadata)
        self.collected.append((Path(filename), files.SafetensorsFile(
            {name: self.joined(tensor) for name, tensor in tensors.items()}, metadata)))
        return None

    def joined(self, tensor: Any) -> Any:
        """A split view (:func:`split_views`) handed to save_file as it was made: the view of the shared storage it
        was made of (the staging copies that storage once, for every file that holds it); anything else as it is."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return tensor
        view = self.splits.get(tensor.untyped_storage()._cdata)
        same = view is not None and (tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()) == (
            view.dtype, view.shape, view.stride(), 0)
        return view if same else tensor

    def save_trainer_state(self, state: Any, json_path: str) -> None:
        """Stands in for ``TrainerState.save_to_json`` on the trainer's state: kept as a snapshot, written by the
        background writer (the json of a long run's log is ~29 ms at 2500 entries)."""
        if not self._ours(json_path):
            files.write(Path(json_path), files.TrainerStateFile(state))  # not the save's: written at once
            return
        self.collected.append((Path(json_path), files.TrainerStateFile.of(state)))

    def key(self, path: Path) -> str:
        """A collected file's staging key: its path in the checkpoint (two files of one name in two folders, e.g.
        a second adapter's ``ref/adapter_model.safetensors``, are two keys) with DeepSpeed's step tag folder made
        step-free, so that the key, and with it the staging buffer, is the same from save to save."""
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.ckpt))
        return DEEPSPEED_TAG.sub(r"\1global_step#\2", rel)


def namers(function: Any) -> list[tuple[Any, str]]:
    """The loaded modules whose globals bind ``function`` as ``save_file`` or ``safe_save_file``, and the name.
    Each module's ``__dict__`` is looked into, not ``getattr`` (a lazy module's ``__getattr__``, transformers'
    among them, made a scan of the 3849 modules loaded with transformers, DeepSpeed and PEFT ~6 ms at every save;
    this one is ~1.5 ms). Every save scans them all again: a module may bind the name at any time (a reload, a
    wrapper put on and taken off), and one that names the original unseen would write a placeholder's bytes."""
    found: list[tuple[Any, str]] = []
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        found.extend((module, name) for name in SAFETENSORS_NAMES if names.get(name) is function)
    return found


@contextlib.contextmanager
def safetensors_collected(collector: CollectingEngine) -> Iterator[None]:
    """Every loaded module's name for ``safetensors.torch.save_file`` (transformers' ``safe_save_file``, PEFT's,
    safetensors' own) is the collector's for the block, and the original's after."""
    original = safetensors.torch.save_file
    swapped = namers(original)
    for module, name in swapped:
        setattr(module, name, collector.save_safetensors)
    try:
        yield
    finally:
        for module, name in swapped:
            setattr(module, name, original)


@contextlib.contextmanager
def trainer_state_collected(trainer: JitTrainerLike, collector: CollectingEngine) -> Iterator[None]:
    """The trainer's ``state.save_to_json`` is the collector's for the block (an attribute of that one instance),
    unless something else already replaced it there or in its class."""
    from transformers import TrainerState  # noqa: PLC0415 (the Trainer's own class)

    state = trainer.state
    if "save_to_json" in vars(state) or type(state).save_to_json is not TrainerState.save_to_json:
        yield
        return
    state.save_to_json = lambda json_path: collector.save_trainer_state(state, json_path)  # type: ignore[method-assign]
    try:
        yield
    finally:
        vars(state).pop("save_to_json", None)


@contextlib.contextmanager
def deepspeed_lookup_once() -> Iterator[None]:
    """accelerate's ``extract_model_from_parallel`` (every ``unwrap_model``: three in one save) asks
    ``is_deepspeed_available()``, which parses DeepSpeed's package metadata each time (~2 ms here); for the block,
    the answer found once (an installed package does not change within a save)."""
    try:
        from accelerate.utils import other  # noqa: PLC0415 (accelerate is the Trainer's; import it where used)
    except ImportError:
        yield
        return
    original = getattr(other, "is_deepspeed_available", None)
    if original is None:
        yield
        return
    answer = bool(original())
    other.is_deepspeed_available = lambda: answer
    try:
        yield
    finally:
        other.is_deepspeed_available = original


@contextlib.contextmanager
def state_dict_uncloned(trainer: JitTrainerLike, collector: CollectingEngine, jit_class: Any) -> Iterator[None]:
    """accelerate's ``get_state_dict`` under ZeRO-0/1/2 is a clone of the module's state dict (a full copy of the
    weights on every rank, in training's time); here the module's state dict itself, which the staging copies once
    (the weights shared with DeepSpeed's model-states file), with what aliases an earlier entry replaced by a
    placeholder that the staging fills from it (``collector.sources``), and each view of a storage that other
    entries view too (DeepSpeed's flat buffer of ZeRO-1/2) given a storage of its own over the same memory
    (``collector.splits``: save_pretrained would clone them all)."""
    accelerator = trainer.accelerator
    engine: Any = trainer.model_wrapped
    stage = engine.zero_optimization_stage()
    if "get_state_dict" in accelerator.__dict__ or stage >= ZERO3 or not only_upstream_sees_it(trainer, jit_class):
        yield  # someone else's; ZeRO-3's is a gather; a user's code may change what it gets: accelerate's clone
        return

    # save_pretrained runs where the Trainer writes the model (and on every rank of a model sharded at load time)
    writes = bool(trainer.args.should_save or getattr(trainer, "is_distributed_loading_by_transformers", True))

    def get_state_dict(model: Any, unwrap: bool = True) -> dict[str, Any]:
        own = (accelerator.unwrap_model(model) if unwrap else model).state_dict()
        # accelerate's clone keeps the dict's type (an OrderedDict), not its _metadata
        state = unaliased(type(own)(own.items()), collector.sources, collector.made)
        return split_views(state, collector.splits, collector.made) if writes else state

    accelerator.get_state_dict = get_state_dict
    try:
        yield
    finally:
        accelerator.__dict__.pop("get_state_dict", None)


def unaliased(state: dict[str, Any], sources: dict[int, torch.Tensor], made: list[torch.Tensor]) -> dict[str, Any]:
    """``state`` with each tensor whose bytes overlap an earlier entry's replaced by a placeholder of its own
    storage (``empty_like``: no copy now; ``sources`` says what the staging copies into its buffer): what
    save_pretrained sees is then what it sees in accelerate's all-clone state dict (no two entries share memory, so
    a tied ``lm_head.weight`` is written, as the synchronous save writes it), and nothing is copied before the
    staging."""
    held: dict[int, list[tuple[int, int]]] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        span = byte_span(tensor)
        ranges = held.setdefault(tensor.untyped_storage().data_ptr(), [])
        if any(span[0] < end and start < span[1] for start, end in ranges):
            placeholder = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            sources[placeholder.untyped_storage()._cdata] = tensor.detach()
            made.append(placeholder)  # kept alive while its _cdata is a key (transformers may drop it)
            state[key] = placeholder
        else:
            ranges.append(span)
    return state


def only_upstream_sees_it(trainer: JitTrainerLike, jit_class: Any) -> bool:
    """True when what ``get_state_dict`` returns goes only through code known not to change it in place: the
    JitTrainer's ``save_model``, transformers' ``_save`` and ``save_pretrained`` (PEFT's). The module's own
    tensors are live weights: a user's override that scales or casts them in place (harmless to accelerate's clone)
    would change training, and the checkpoint (found by a review: a save_model override that scaled the dict it
    got halved the weights of ``model.safetensors``, and the run's next losses)."""
    from transformers import PreTrainedModel, Trainer  # noqa: PLC0415 (the Trainer's own classes)

    cls = type(trainer)
    if cls.save_model is not jit_class.save_model or cls._save is not Trainer._save or {"save_model", "_save"} & set(
            vars(trainer)):
        return False
    known: list[Any] = [PreTrainedModel.save_pretrained]
    try:
        from peft import PeftModel  # noqa: PLC0415 (optional)

        known.append(PeftModel.save_pretrained)
    except ImportError:
        pass
    model: Any = trainer.model
    return "save_pretrained" not in vars(model) and any(type(model).save_pretrained is f for f in known)


def split_views(state: dict[str, Any], splits: dict[int, torch.Tensor], made: list[torch.Tensor]) -> dict[str, Any]:
    """``state`` with each tensor that shares its storage with another entry (disjoint views of DeepSpeed's flat
    ZeRO-1/2 buffer: every trainable weight) replaced by a tensor of the same memory with a storage of its own
    (DLPack: no copy, the values are the weights' own, so whatever save_pretrained computes from them is right).
    transformers' ``remove_tied_weights_from_state_dict`` clones every view of a shared storage (the whole model, in
    training's time); a split view is not shared. ``splits`` says which view each stands for, so that the collector
    hands the staging the views again (:meth:`CollectingEngine.joined`)."""
    holders: dict[int, int] = {}
    for tensor in state.values():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            holders[tensor.untyped_storage()._cdata] = holders.get(tensor.untyped_storage()._cdata, 0) + 1
    for key, tensor in state.items():
        if (type(tensor) is not torch.Tensor or tensor.device.type == "meta" or not tensor.is_contiguous()
                or holders[tensor.untyped_storage()._cdata] < 2 or tensor.numel() == 0):
            continue  # a subclass (DTensor, a quantised weight) stays as it is: save_pretrained clones it
        try:
            split = torch.from_dlpack(tensor.detach())
        except (RuntimeError, TypeError, BufferError):  # a view DLPack cannot carry (conjugate, negative bit)
            continue
        splits[split.untyped_storage()._cdata] = tensor.detach()
        made.append(split)  # a storage freed while its _cdata is a key could be another's address later
        state[key] = split
    return state


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor reaches: [first, last + 1)."""
    size = tensor.element_size()
    last = tensor.storage_offset() + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(),
                                                                                  strict=True) if n > 0)
    return int(tensor.storage_offset()) * size, int(last + 1) * size
