"""A staged storage keeps the location tag of the storage it copies, so that ``torch.save`` of a staged state writes
the same ``('storage', ..., 'cuda:0', ...)`` records as ``torch.save`` of the original: ``torch.load`` without
``map_location`` then puts each tensor back where the synchronous save's file would have put it.

A staged copy of a CPU storage needs nothing (its tag is ``cpu`` already), so on a CPU-only run the registry stays
empty. The tagger goes through ``torch.serialization.register_package``, torch's documented seam for tagging
storages at save time, ahead of torch's own taggers.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.serialization

# torch's own taggers have priorities 10 (cpu), 20 (cuda) and 21-26 (other devices); a lower value runs first, and
# register_package sorts (priority, tagger, deserializer) tuples, so the priority must be one no other uses.
STAGED_TAG_PRIORITY = 1

_LOCATIONS: dict[int, str] = {}  # a staged storage's StorageImpl (torch.save's own key: _cdata) -> original tag
_lock = threading.Lock()
_registered = False


def _tagger(storage: Any) -> str | None:  # torch's STORAGE union
    if not _LOCATIONS:
        return None
    return _LOCATIONS.get(getattr(storage, "_cdata", -1))


def _deserializer(storage: Any, location: str) -> None:
    return None  # loading is torch's: the tag names a real device


def remember(staged: torch.UntypedStorage, location: str) -> None:
    """``torch.save`` tags ``staged`` with ``location`` (the original storage's tag) from now on."""
    global _registered
    with _lock:
        if not _registered:
            torch.serialization.register_package(STAGED_TAG_PRIORITY, _tagger, _deserializer)
            _registered = True
        _LOCATIONS[staged._cdata] = location


def forget(staged: torch.UntypedStorage) -> None:
    """``staged`` is freed or reused for a CPU storage: its own tag again."""
    with _lock:
        _LOCATIONS.pop(staged._cdata, None)
