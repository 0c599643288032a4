"""The async periodic saves as the save and stop paths see them: one :class:`AsyncSaver` per session
(``session.saver``), so that ``save_path`` and ``stop_path`` call the saver without importing it (the saver calls
them: sealing a commit, rotating, feeding the watchdog). Each method is the module function of :mod:`.periodic` or
:mod:`.claim` over this session; with ``JitConfig(async_periodic_saves=False)`` each is the synchronous no-op it
was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_jit.train.async_save import claim, periodic

if TYPE_CHECKING:
    from slurm_jit.train.session import Session


class AsyncSaver:
    """``session.saver``: the async saves of this session's ``train()`` (their state: ``Run.async_saves``)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def before_save(self) -> None:
        """Any save: the async save in flight durable and committed first."""
        periodic.before_save(self.session)

    @contextlib.contextmanager
    def collecting(self, kind: str, ckpt: Path) -> Iterator[Any]:
        """Around upstream's save: what it writes collected for staging (None: this save stays synchronous)."""
        with periodic.collecting(self.session, kind, ckpt) as collected:
            yield collected

    def submit(self, collected: Any, ckpt: Path, step: int, kind: str, phases: Any, t0: float, *,
               fields: dict[str, Any]) -> bool:
        """True when the save goes on in the background (written, committed and told later)."""
        return periodic.submit(self.session, collected, ckpt, step, kind, phases, t0, fields=fields)

    def in_flight_step(self) -> int | None:
        return periodic.in_flight_step(self.session)

    def in_flight_contents(self, step: int) -> str | None:
        return periodic.in_flight_contents(self.session, step)

    def done_step(self) -> int:
        """What this rank sends in the stop round: the save its writer has finished (claim.py)."""
        return claim.done_step(self.session)

    def tell_committed(self, agreed_step: int) -> None:
        claim.tell_committed(self.session, agreed_step)

    def finish(self) -> None:
        """The end of training: the save in flight committed before the best model is loaded."""
        periodic.finish(self.session)

    def close_after_failure(self) -> None:
        periodic.close_after_failure(self.session)
