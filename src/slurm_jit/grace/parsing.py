"""Reading what a user types for the grace calculator: durations (``90s``, ``1h30m``), sizes (``512MB``,
``3.5GiB``), parameter counts (``7B``) and the margin (``20%`` or ``30s``); every bad input is a
:class:`~slurm_jit.grace.rules.GraceError` with a HINT. Pure: no I/O.
"""

from __future__ import annotations

import math
import re

from slurm_jit.grace.formula import Margin
from slurm_jit.grace.rules import GraceError

_NUMBER = r"(?:\d+(?:\.\d+)?|\.\d+)"
_DURATION_RE = re.compile(rf"(?:({_NUMBER})h)?(?:({_NUMBER})m(?:in)?)?(?:({_NUMBER})s(?:ec)?)?")


def parse_duration(text: str, *, what: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from ``90s``, ``2m``, ``1h30m``, ``2.5`` (plain seconds); GraceError for anything else."""
    value = str(text).strip().lower().replace(" ", "")
    seconds: float | None = None
    if re.fullmatch(_NUMBER, value):
        seconds = float(value)
    else:
        match = _DURATION_RE.fullmatch(value)
        if value and match and any(match.groups()):
            hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
            seconds = hours * 3600 + minutes * 60 + secs
    if seconds is None or not math.isfinite(seconds):
        raise GraceError(f"{what}: cannot read {text!r}. HINT: write 90s, 2m, 1h30m or plain seconds")
    if seconds == 0 and not allow_zero:
        raise GraceError(f"{what}: must be more than 0 s. HINT: give the longest time you measured")
    return seconds


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes from ``512MB``, ``3.5GiB``, ``800MB/s``, ``1e9``: decimal K/M/G/T/P, binary with ``i``; > 0."""
    value = str(text).strip().replace(" ", "").removesuffix("/s")
    match = re.fullmatch(rf"({_NUMBER}(?:[eE]\d+)?)(?:([KMGTPkmgtp])(i?))?[Bb]?", value)
    if not match:
        raise GraceError(f"{what}: cannot read {text!r}. HINT: write e.g. 512MB, 3.5GiB or 1e9")
    number, prefix, binary = match.groups()
    power = "KMGTP".index(prefix.upper()) + 1 if prefix else 0
    value_f = float(number) * (1024**power if binary else 1000**power)
    result = int(value_f) if math.isfinite(value_f) else 0
    if result <= 0:
        raise GraceError(f"{what}: {text!r} is not a positive finite number. HINT: give e.g. 512MB")
    return result


def parse_params(text: str) -> int:
    """A parameter count from ``7B``, ``350M``, ``125k``, ``1.3e9``."""
    value = str(text).strip().replace(" ", "")
    match = re.fullmatch(rf"({_NUMBER}(?:[eE]\d+)?)([KMBTkmbt]?)", value)
    if not match:
        raise GraceError(f"--params: cannot read {text!r}. HINT: write e.g. 7B, 350M or 1.3e9")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[match.group(2).upper()]
    count = float(match.group(1)) * scale
    if not (math.isfinite(count) and count >= 1):
        raise GraceError(f"--params: {text!r} is not a positive count. HINT: the model's parameter count")
    return int(count)


def parse_margin(text: str) -> Margin:
    """``20%`` (of step+eval+save) or a duration (``30s``, ``0``)."""
    value = str(text).strip()
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            percent = math.nan
        if not math.isfinite(percent) or percent < 0:
            raise GraceError(f"--margin: cannot read {text!r}. HINT: write 20% or 30s")
        return Margin(fraction=percent / 100, floor_s=0.0)
    return Margin(fraction=0.0, floor_s=parse_duration(value, what="--margin", allow_zero=True))
