"""How a staged file is written: ``torch.save`` (DeepSpeed's files, collected from its checkpoint engine) or
safetensors (``model.safetensors`` and its shards, collected from ``save_pretrained``'s call).

``write`` uses the functions as imported here, never the module attributes that :mod:`.periodic` swaps for a
collector during an async save's collection: the background thread writes while the next save may collect.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file as _safetensors_save_file

_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust I/O errors name their errno


@dataclass
class SafetensorsFile:
    """One ``safetensors.torch.save_file(tensors, path, metadata=metadata)`` call, kept for later."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] | None


@dataclass
class TrainerStateFile:
    """One ``TrainerState.save_to_json(path)`` call, kept for later: a snapshot of the state at the call."""

    state: Any  # a TrainerState

    @classmethod
    def of(cls, state: Any) -> TrainerStateFile:
        """The state as it is now, cheaply: its log (a list that grows over the whole run, ~29 ms of json at 2500
        entries) copied entry by entry (each a flat dict of numbers and strings), every other field deep-copied."""
        snapshot = copy.copy(state)
        vars(snapshot).pop("save_to_json", None)  # the collection's swap on the instance (it holds the collector)
        for field in dataclasses.fields(state):
            value = getattr(state, field.name)
            if field.name == "log_history" and isinstance(value, list):
                value = [_entry(entry) for entry in value]
            else:
                value = copy.deepcopy(value)
            setattr(snapshot, field.name, value)
        return cls(snapshot)


def _entry(entry: Any) -> Any:
    """A log entry as it is now: a flat dict of numbers and strings copied as a dict, anything else deep-copied."""
    if type(entry) is dict and all(value is None or type(value) in _ATOMS for value in entry.values()):
        return dict(entry)
    return copy.deepcopy(entry)


_ATOMS = (int, float, str, bool)  # immutable: a log entry made of them is copied whole by dict()


@dataclass
class Later:
    """A state made when the writer comes to it (a staged snapshot's rebuild, in the writer's thread)."""

    make: Callable[[], Any]


def write(path: Path, state: Any) -> None:
    """Write one collected (or staged) file as the synchronous save would have."""
    if isinstance(state, Later):
        state = state.make()
    if isinstance(state, TrainerStateFile):
        type(state.state).save_to_json(state.state, str(path))  # the class's, as the Trainer's own call writes it
        return
    if isinstance(state, SafetensorsFile):
        try:
            _safetensors_save_file(state.tensors, str(path), metadata=state.metadata)
        except SafetensorError as exc:  # an I/O error as the OSError it is: a full disk gets its own line
            found = _OS_ERROR.search(str(exc))
            if found is None:
                raise
            errno = int(found.group(1))
            raise OSError(errno, os.strerror(errno), str(path)) from exc
    else:
        torch.save(state, path)
