"""Signal names as users write them (``TERM``, ``SIGUSR1``, ``15``): shared by the trainer and the sbatch checks."""

from __future__ import annotations

import signal


def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
    """``"TERM"``, ``"SIGUSR1"``, ``15`` or a ``signal.Signals`` -> ``signal.Signals``."""
    if isinstance(name, signal.Signals):
        return name
    if isinstance(name, int) and not isinstance(name, bool):
        try:
            return signal.Signals(name)
        except ValueError:
            raise ValueError(f"unknown signal number {name}. HINT: use a name such as TERM or USR1") from None
    if not isinstance(name, str):
        raise ValueError(f"signal {name!r} is not a name. HINT: use a name such as TERM or USR1")
    upper = name.strip().upper()
    try:
        return signal.Signals[upper if upper.startswith("SIG") else f"SIG{upper}"]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}. HINT: use a name such as TERM or USR1") from None
