"""Numbers as a person reads them at a terminal: ``0.27 s``, ``13.5 s``, ``243 s``, ``21 h``, ``1 in 510,000``.

The launcher's plan and ``status`` print these; the exact figures stay in the timing log and behind
``--dry-run --explain``.
"""

from __future__ import annotations

import math

MINUTE_S = 60.0
HOUR_S = 3600.0
DAY_S = 86_400.0
SIGNIFICANT = 2  # digits kept below 10 (0.27 s, 5.3 s): a step's or a save's time varies more than that


def number(value: float) -> str:
    """``value`` rounded for reading: 2 significant digits below 10, one decimal below 100, whole from 100 on
    (thousands grouped); never an exponent."""
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return _trim(f"{value:.1f}")
    if size == 0:
        return "0"
    digits = max(0, SIGNIFICANT - 1 - math.floor(math.log10(size)))
    return _trim(f"{value:.{digits}f}")


def seconds(value_s: float) -> str:
    """A time in seconds: ``0.27 s``, ``13.5 s``, ``243 s``."""
    return f"{number(value_s)} s"


def duration(value_s: float) -> str:
    """A time in the unit it is best read in: seconds under 2 minutes, minutes under 2 hours, hours under 2 days,
    else days (``48 s``, ``3 min``, ``21 h``, ``1,056 days``)."""
    for unit_s, unit in ((DAY_S, "days"), (HOUR_S, "h"), (MINUTE_S, "min")):
        if abs(value_s) >= 2 * unit_s:
            return f"{number(value_s / unit_s)} {unit}"
    return seconds(value_s)


def one_in(chance: float) -> str:
    """A small chance as ``1 in N`` (N to 2 significant digits, grouped): ``1 in 510,000``."""
    if chance <= 0:
        return "never"
    n = 1 / chance
    if n < 100:
        return f"1 in {number(n)}"
    rounded = round(n, SIGNIFICANT - 1 - math.floor(math.log10(n)))
    return f"1 in {rounded:,.0f}"


def _trim(text: str) -> str:
    return text.rstrip("0").rstrip(".") if "." in text else text
