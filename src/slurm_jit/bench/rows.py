"""One result row: a value, its unit, the target it is held to and whether it met it."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

_COMPARE: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le, "<": operator.lt}
REFERENCE = "reference"  # the target of a row the others divide by: it has none of its own
NO_TARGET = "none (reported)"  # a comparison the issue asks to report without a target


@dataclass(frozen=True, kw_only=True)
class Row:
    """What results.json holds per row; ``met`` is None when the row was skipped or has no target."""

    name: str  # short id, e.g. "save_bw_over_disk_zero2"
    value: float | None  # None when skipped
    unit: str  # "ratio", "MB/s", "s", "count", ...
    target: str  # ">= 0.8", "<= 1.1" or "reference"
    met: bool | None
    compares: str  # what was measured against what, in words
    note: str = ""  # how it was measured, or why it was skipped
    details: dict[str, Any] = field(default_factory=dict)  # the raw numbers behind the value

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def judge(value: float, target: str) -> bool:
    """``target`` as ``"<op> <number>"``: does value meet it?"""
    op, number = target.split()
    return _COMPARE[op](value, float(number))


def measured(name: str, value: float, unit: str, target: str, compares: str, note: str = "",
             **details: Any) -> Row:
    met = None if target in (REFERENCE, NO_TARGET) else judge(value, target)
    return Row(name=name, value=round(value, 4), unit=unit, target=target, met=met, compares=compares, note=note,
               details=details)


def skipped(name: str, unit: str, target: str, compares: str, reason: str, **details: Any) -> Row:
    """A row not measured on purpose; ``details``: what was measured on the way, if anything."""
    return Row(name=name, value=None, unit=unit, target=target, met=None, compares=compares,
               note=f"skipped: {reason}", details=details)


def failed(name: str, unit: str, target: str, compares: str, error: str) -> Row:
    """A row whose measurement broke: reported (met None) rather than ending the whole run."""
    return Row(name=name, value=None, unit=unit, target=target, met=None, compares=compares,
               note=f"not measured: {error}")
