"""SIGKILL at the named instants of an async periodic save (issue #23), on 2 real ZeRO-2 ranks: before the deferred
staging copies, training held at its next optimizer step (both ranks killed), during rank 0's manifest (rank 0
killed), between the ranks' done markers. Each instant is hit deterministically: the save stalls there
(``SLURM_JIT_FAULT_ASYNC``, fault injection) and the harness kills once the stall is logged. After each kill ``ckpt-
check`` (quick and ``--deep``) calls the killed save ``incomplete`` (never ``corrupt``, never ``complete``) and
resumes from the newest complete one; every checkpoint it calls complete holds the uninterrupted run's state
bitwise. In the same chain a JIT stop (SIGTERM) during an in-flight async save waits for it and writes its JIT
checkpoint: both complete. The chain's resumed runs log every step's loss bitwise equal to the uninterrupted run's.
Five short runs (~2-3 min of ranks); the 20-instant sweep with random instants is ``tools/faults --only async-
kills``.

Also: a rank's background writer failing alone (an exception in its thread only) ends train() on every rank at the
next save, at once (rank 0 learns from the rank's failed marker, not from a 300 s deadline), with one line naming
the rank; the checkpoint stays incomplete."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from jit_helpers import ckpt_check, losses, run_logged, start_ranks, wait_for

from slurm_jit import exactness, timing
from slurm_jit.checkpoint import protocol
from slurm_jit.grace import calc
from slurm_jit.local_ranks import Ranks
from slurm_jit.train import stop_record
from slurm_jit.train.async_save import commit, fault_points

ARGS = ["--max-steps", "6", "--save-steps", "1", "--async-periodic-saves"]
STALL_S = 120  # longer than any kill takes to come: the save is still stalled when the ranks die
# (point, step of the stalled save, rank that stalls (None: both), ranks killed first (the others a second later))
TRIALS = [("copy", 2, None, (0, 1)), ("manifest", 3, 0, (0,)), ("marker", 4, 1, (0, 1))]
STOP_STALL_S = 6  # the JIT stop's trial: the async save of step 4 still being written when the stop (step 5) comes
FAIL_WITHIN_S = 200.0  # the whole run (~30-90 s on 2 loaded cores): rank 0 learns at once, not at its 300 s deadline


def _verdict(out: Path, *flags: str) -> dict[str, object]:
    return json.loads(ckpt_check(out, "--json", *flags).stdout)


def _statuses(check: dict[str, object]) -> dict[int, str]:
    """checkpoint-<step> -> its status (a set-aside earlier attempt, checkpoint-<step>.incomplete, left out)."""
    found = {}
    for c in check["checkpoints"]:  # type: ignore[attr-defined]
        if Path(c["path"]).name == f"checkpoint-{c['step']}":
            found[c["step"]] = c["status"]
    return found


def _stalled(ranks: Ranks, point: str, step: int, rank: int | None) -> bool:
    return all(fault_points.STALLED % (point, step, r) in ranks.log(r) for r in ((0, 1) if rank is None else (rank,)))


def _kill(ranks: Ranks, first: tuple[int, ...]) -> None:
    """SIGKILL ``first``; the others only once they had a moment to act on it (a survivor must claim nothing)."""
    for rank in first:
        ranks.signal(rank, signal.SIGKILL)
    time.sleep(1.0)
    ranks.kill()


def _judge(out: Path, killed_step: int, reference: Path) -> int:
    """The killed save incomplete (quick and deep), resume from the newest complete one, every complete one equal
    to the reference's checkpoint of that step. Returns the resume step."""
    quick, deep = _verdict(out), _verdict(out, "--deep")
    assert _statuses(quick) == _statuses(deep), (quick, deep)
    statuses = _statuses(deep)
    assert statuses[killed_step] == "incomplete", statuses
    complete = [step for step, status in statuses.items() if status == "complete"]
    assert complete and max(complete) == killed_step - 1, statuses
    assert quick["resume_from"] == str(out / f"checkpoint-{killed_step - 1}"), quick
    for step in complete:
        if (reference / f"checkpoint-{step}").is_dir():
            comparison = exactness.compare(out / f"checkpoint-{step}", reference / f"checkpoint-{step}", unpickle=True)
            assert comparison.equal, f"checkpoint-{step}: {exactness.report(comparison)}"
    return killed_step - 1


def _jit_stop_during_the_async_save_of_step_4(out: Path) -> None:
    """SIGTERM (each rank to itself, at the end of step 5; kill_wait 0: the stop is taken at once) while the async
    save of step 4 is still being written: the JIT save of step 5 waits for it, then is written; both complete,
    the stop record names the JIT one."""
    result = run_logged(out, [*ARGS, "--resume", "--signal-self-at-step", "5", "--kill-wait", "0"],
                        env={fault_points.FAULT_ASYNC_ENV: f"write:4:{STOP_STALL_S}"})
    assert result.codes == [0, 0], result.log[-3000:]
    assert fault_points.STALLED % ("write", 4, 0) in result.log, result.log[-3000:]
    assert "the save of step 5 waits for the async save of step 4" in result.log, result.log[-3000:]
    check = _verdict(out, "--deep")
    kinds = {c["step"]: (c["status"], c["kind"]) for c in check["checkpoints"]  # type: ignore[attr-defined]
             if Path(c["path"]).name == f"checkpoint-{c['step']}"}
    assert kinds == {**{s: ("complete", "periodic") for s in range(1, 5)}, 5: ("complete", "jit")}, kinds
    assert check["resume_from"] == str(out / "checkpoint-5"), check
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] == 5, record
    # within grace-calc's prediction from the chain's own timing log (its timed terms, no margin): the async term
    # (the longest block + background write, the stalled one's included) covers the stop's wait for step 4's save
    terms = calc.measured_terms(timing.load_summary(out))
    assert terms.step_s is not None and terms.save_s is not None and terms.async_save_s > STOP_STALL_S, terms
    predicted_s = calc.compute_grace(calc.GraceInputs(
        step_s=terms.step_s, save_s=terms.save_s, kill_wait_s=0.0, latency_steps=terms.latency_steps,
        teardown_s=terms.teardown_s or 0.0, async_save_s=terms.async_save_s,
        margin=calc.Margin(fraction=0.0, floor_s=0.0))).needed_s
    stop_s = max(float(r["dur_s"]) for r in timing.read_records(out) if r["event"] == "stop" and r["step"] == 5)
    assert stop_s <= predicted_s, (stop_s, predicted_s, terms)


def test_sigkill_at_each_instant_of_an_async_save_leaves_the_previous_checkpoint_to_resume_bitwise(
        tmp_path: Path, jit_zero2_run: Path) -> None:
    out = tmp_path / "out"
    for i, (point, step, rank, first) in enumerate(TRIALS):
        spec = f"{point}:{step}:{STALL_S}" + ("" if rank is None else f":{rank}")
        ranks = start_ranks(out, [*ARGS, *(["--resume"] if i else [])], env={fault_points.FAULT_ASYNC_ENV: spec})
        wait_for(ranks, f"stalled at {spec}", lambda: _stalled(ranks, point, step, rank))  # noqa: B023
        if point == "marker":  # the instant between the markers: rank 0's is there, rank 1's is not
            marker = commit.marker_path(out / f"checkpoint-{step}", 0)
            wait_for(ranks, "rank 0's marker", marker.exists)
            assert not commit.marker_path(out / f"checkpoint-{step}", 1).exists()
        _kill(ranks, first)
        assert _judge(out, step, jit_zero2_run) == step - 1
        if point == "manifest":
            assert not list((out / f"checkpoint-{step}").glob(f"{commit.MARKER_PREFIX}*"))  # removed, not sealed
    _jit_stop_during_the_async_save_of_step_4(out)
    result = run_logged(out, [*ARGS, "--resume"])
    assert result.codes == [0, 0], result.log[-3000:]
    assert _statuses(_verdict(out, "--deep")) == {s: "complete" for s in range(1, 7)}
    for step in (3, 6):
        comparison = exactness.compare(out / f"checkpoint-{step}", jit_zero2_run / f"checkpoint-{step}", unpickle=True)
        assert comparison.equal, f"checkpoint-{step}: {exactness.report(comparison)}"
    reference = dict(losses(jit_zero2_run))
    logged = losses(out)
    assert {s for s, _ in logged} == set(reference), logged
    assert all(loss == reference[s] for s, loss in logged), (logged, reference)  # retrained steps too, bitwise


def test_a_rank_whose_background_write_fails_alone_ends_training_on_every_rank_at_the_next_save(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    t0 = time.monotonic()
    result = run_logged(out, ["--max-steps", "4", "--save-steps", "2", "--async-periodic-saves"],
                        env={fault_points.FAULT_ASYNC_ENV: f"write:2:{fault_points.RAISE}:1"})
    took_s = time.monotonic() - t0
    assert result.codes[0] not in (0, None) and result.codes[1] not in (0, None), result.log[-3000:]
    assert took_s < FAIL_WITHIN_S, f"{took_s:.0f} s: rank 0 waited for the failed rank's marker"
    assert "failed on rank 1" in result.log or "rank 1's background write failed" in result.log, result.log[-3000:]
    assert "Traceback" not in result.log, result.log[-3000:]
    statuses = _statuses(_verdict(out, "--deep"))
    assert statuses == {2: "incomplete"}, statuses
    assert not (out / "checkpoint-2" / protocol.MANIFEST_NAME).exists()
