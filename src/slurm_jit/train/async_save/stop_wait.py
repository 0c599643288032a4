"""A JIT stop's wait for the async periodic save in flight, bounded by the signal lead (issue #23: "wait for it if
the grace allows").

The stop's own checkpoint is the newest state; the save in flight is the newest but one, worth waiting for only
while the wait still leaves the JIT save its time before Slurm's SIGKILL. Past that, the save in flight is set
aside: its writer stops before its next file, rank 0 writes no manifest for it (its sentinel stays: ``ckpt-check``
calls it ``incomplete``, never complete), and the JIT save begins. The JIT save is then the resume point; if it
too is cut off, the newest complete checkpoint before both is.

The deadline is the earliest stop signal on any rank plus the signal lead, ``SLURM_JIT_SIGNAL_LEAD_S`` (the N of
``--signal=TERM@N``, exported by this project's launchers and sbatch scripts; Slurm's warning may come up to 60 s
earlier than N before the limit, which only leaves more time). The JIT save is taken to need as long as the
longest background write of this run or as long as the save in flight has taken so far, whichever is longer (it
writes the same states; a disk that slowed down slows both), plus grace-calc's margin (20 %, at least 10 s) and the
end of train()'s wait for the set-aside writer to finish its current file (:data:`SET_ASIDE_CLOSE_WAIT_S`). No
lead known (no launcher exported it, a bare ``scancel --signal``), or the stop at the step of the save in flight
(that save is the JIT checkpoint: never two writers on one directory): the stop waits without a bound, as a
synchronous save in flight would make it.

Rank 0 computes the bound and broadcasts it, every rank waits that long for its own writer, and the ranks agree
(one all-reduce) whether every rank's share was written: the same decision on every rank.
"""

from __future__ import annotations

import os

from slurm_jit.grace.formula import Margin
from slurm_jit.grace.rules import LEAD_ENV_VAR

SET_ASIDE_CLOSE_WAIT_S = 5.0  # at the end of train(): how long a set-aside write may take to stop (its current file)
_BISECT_ROUNDS = 60  # the bound to far below a millisecond for any lead


def signal_lead_s() -> float | None:
    """``SLURM_JIT_SIGNAL_LEAD_S`` as seconds, or None (unset, not a number, not positive)."""
    raw = os.environ.get(LEAD_ENV_VAR, "").strip()
    try:
        lead = float(raw) if raw else None
    except ValueError:
        return None
    return lead if lead is not None and lead > 0 and lead != float("inf") else None


def bound_s(*, lead_s: float | None, earliest_signal: float, now: float, submitted_at: float,
            longest_write_s: float, margin: Margin | None = None) -> float | None:
    """How long the stop may still wait for the save in flight (0: not at all), None without a deadline. Pure.

    All times are one monotonic clock: ``earliest_signal`` (the first stop signal on any rank), ``now``,
    ``submitted_at`` (the save in flight's submission). Waiting until ``t`` leaves the JIT save
    ``max(longest_write_s, t - submitted_at)``, the margin of that and :data:`SET_ASIDE_CLOSE_WAIT_S` before
    ``earliest_signal + lead_s``."""
    if lead_s is None:
        return None
    margin = margin or Margin()
    deadline = earliest_signal + lead_s

    def fits(t: float) -> bool:
        need = max(longest_write_s, t - submitted_at, 0.0)
        return t + need + margin.seconds(need) + SET_ASIDE_CLOSE_WAIT_S <= deadline

    if not fits(now):
        return 0.0
    low, high = now, max(now, deadline)  # fits(low); the wait ends before the deadline whatever the need
    for _ in range(_BISECT_ROUNDS):
        mid = (low + high) / 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low - now
