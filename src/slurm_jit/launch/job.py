"""``JitJob``: submitit's Job for a JIT job: state, cancel and interrupt through the Slurm gateway, results only
after the whole requeue chain.

The result files (``%j_%t_result.pkl``) are written by :mod:`slurm_jit.launch.runner` only when the job is over
(never by a run that is requeued), so ``done()`` is False while the job waits or runs again. Job state comes from
``scontrol show job`` (no ``sacct``: accounting is often off); after MinJobAge Slurm forgets the job and the
result files are what is left.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from submitit.core import core, utils
from submitit.slurm.slurm import SlurmJob

from slurm_jit import safe_read, slurm

# States in which the job may still write results (or run again): not done. REQUEUED/REQUEUE_* between a
# requeue and the next run; COMPLETING while the batch shell's last line (the runner's finish) may still write.
NOT_DONE = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SIGNALING", "SUSPENDED", "REQUEUED",
                      "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "STAGE_OUT", "RESV_DEL_HOLD", "UNKNOWN"})
# slurmctld no longer knows the job (MinJobAge after its end, or its state reset): done, where submitit's
# UNKNOWN would wait forever (scontrol and squeue forget a job that sacct keeps); job.state reads the result files
PURGED = "PURGED"
LOG_TAIL_LINES = 40  # of a log quoted in the error of a job without a result (submitit: tail -40 of stdout)
LOG_TAIL_BYTES = 64 * 1024  # read from the end of the log for those lines (a requeued job's log keeps growing)
STATE_POLL_MAX_S = 30  # the gateway is asked at most this often by done()/state (submitit: 2 s, 4 s, ... then this)


class GatewayWatcher(core.InfoWatcher):
    """submitit's InfoWatcher, reading ``scontrol show job`` through :mod:`slurm_jit.slurm` instead of sacct."""

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        return self.get_state(job_id, mode=mode) not in NOT_DONE

    def forget(self, job_id: str) -> None:
        """A newly submitted job: nothing known of an earlier job of the same id (slurmctld reuses ids after its
        state is reset; a test's fake gateway used one) may make it look done."""
        self._finished.discard(job_id)
        self._info_dict.pop(job_id, None)

    def update(self) -> None:
        self._num_calls += 1
        for job_id in sorted(self._registered - self._finished):
            self._info_dict[job_id] = {"State": _gateway_state(job_id)}
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


def _gateway_state(job_id: str) -> str:
    try:
        state = slurm.state_of(job_id)
    except slurm.SlurmError:
        return "UNKNOWN"  # slurmctld does not answer: not done, ask again later
    return PURGED if state is None else state


class JitJob(SlurmJob):  # type: ignore[type-arg]
    """A JIT job (see the module docstring). ``result()`` is rank 0's value; ``results()`` every rank's."""

    watcher = GatewayWatcher(delay_s=STATE_POLL_MAX_S)  # type: ignore[assignment]

    def cancel(self, check: bool = True) -> None:
        """``scancel`` through the gateway; a cancelled job is never requeued (after_step checks)."""
        try:
            slurm.cancel(self.job_id)
        except slurm.SlurmError:
            if check:
                raise

    def _interrupt(self, timeout: bool = False) -> None:
        """TERM to every rank, as the time-limit warning sends it (never USR2: its default action kills a rank)."""
        slurm.cancel(self.job_id, signal_name="TERM")

    @property
    def state(self) -> str:
        """Slurm's JobState; once Slurm forgot the job, COMPLETED or FAILED from the result files."""
        state = self.watcher.get_state(self.job_id, mode="standard")
        if state != PURGED:
            return state
        outcomes = [self._outcome_or_none(k) for k in self._tasks]
        if all(o is not None and o[0] == "success" for o in outcomes):
            return "COMPLETED"
        return "FAILED" if any(o is not None for o in outcomes) else PURGED

    def _outcome_or_none(self, task: int) -> tuple[str, Any] | None:
        path = utils.JobPaths(self.paths.folder, job_id=self.job_id, task_id=task).result_pickle
        if not path.exists():
            return None
        try:
            return utils.pickle_load(path)  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - a torn or foreign file: not a result
            return None

    def done(self, force_check: bool = False) -> bool:
        """Over: Slurm says the job ended (or forgot it). The result files are written before the job ends, so
        once done they are there (unless the job ended without a run that wrote them: a cancel, a kill)."""
        return bool(self.watcher.is_done(self.job_id, mode="force" if force_check else "standard"))

    def result(self) -> Any:
        """Rank 0's return value (of the last run, after the whole requeue chain); raises the job's error."""
        return self.results()[0]

    def results(self) -> list[Any]:
        self.wait()
        if self._sub_jobs:
            return [sub_job.results()[0] for sub_job in self._sub_jobs]
        outcome, value = self._get_outcome_and_result()
        if outcome == "error":
            raise utils.FailedJobError(value)
        return [value]

    def exception(self) -> utils.UncompletedJobError | utils.FailedJobError | None:  # type: ignore[override]
        """The job's error (one line first: the policy's reason, or how the job ended), or None."""
        self.wait()
        if self._sub_jobs:
            errors = [e for e in (sub.exception() for sub in self._sub_jobs) if e is not None]
            return errors[0] if errors else None
        try:
            outcome, value = self._get_outcome_and_result()
        except utils.UncompletedJobError as exc:
            return exc
        return utils.FailedJobError(value) if outcome == "error" else None

    def _get_outcome_and_result(self) -> tuple[str, Any]:
        state = self.watcher.get_state(self.job_id, mode="cache")
        # a shared filesystem may show the file late (submitit waits as long); a cancelled job never writes one
        deadline = time.monotonic() + (0 if state == "CANCELLED" else self._results_timeout_s)
        while (outcome := self._outcome_or_none(self.task_id or 0)) is None and time.monotonic() < deadline:
            time.sleep(1)
        if outcome is not None:
            return outcome
        state = self.watcher.get_state(self.job_id, mode="force")
        if state == "CANCELLED":
            first = (f"job {self.job_id} was cancelled (scancel) and left no result; a cancelled job is never "
                     f"requeued. HINT: the checkpoints are kept: submit again to resume; error log "
                     f"{self.paths.stderr}")
        elif state == PURGED:
            first = (f"job {self.job_id} ended and left no result, and Slurm no longer knows it (MinJobAge after "
                     f"its end, or slurmctld's state was reset). HINT: see its error log {self.paths.stderr}")
        else:
            first = (f"job {self.job_id} ended {state} without a result (killed before its last line ran?). "
                     f"HINT: see its error log {self.paths.stderr}")
        raise utils.UncompletedJobError("\n".join([first, *self._streams()]))

    def _streams(self) -> list[str]:
        """The tail of this task's error log, quoted as submitit quotes it ("Error stream produced:"), else of
        its output log."""
        error = _tail(self.paths.stderr)
        if error:
            return ["Error stream produced:", "-" * 40, error]
        output = _tail(self.paths.stdout)
        if output:
            return [f"No error stream produced. Look at stdout: {self.paths.stdout}", "-" * 40, output]
        return [f"No output/error stream produced ! Check: {self.paths.stdout}"]


def _tail(path: Path) -> str:
    """The last :data:`LOG_TAIL_LINES` lines of a log ("" when there is none): the log grows with every requeue."""
    try:
        with safe_read.open_regular(path) as f:  # a FIFO or device in the log folder is never waited on
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            data = f.read()
    except safe_read.READ_ERRORS:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]).strip()
