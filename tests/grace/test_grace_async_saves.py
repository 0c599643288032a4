"""Async periodic saves in the timing log and the grace calculator (issue #23 item 4): the blocked time and the
background write are two figures; the JIT save's term stays the synchronous saves' own; the wait a JIT stop may
have for the async save in flight is a term of its own (``async_save``). Timing logs written line by line here,
so every number of the expected grace is known exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from grace_helpers import grace_calc

from slurm_jit import timing
from slurm_jit.grace import calc as grace
from slurm_jit.train import runtime_grace

MIB = 1024**2


def _records(rank: int) -> list[dict[str, Any]]:
    """One run on 2 ranks: 30 steps of 0.5 s (read overlapped: 2 steps to the stop), async periodic saves at steps 10
    and 20 (rank 0's background includes the commit, so it is the longer), a JIT stop at step 30."""
    base = {"v": 1, "rank": rank, "world_size": 2, "run_id": "r1"}
    blocked = {10: (0.2, 0.3), 20: (0.4, 0.25)}  # step -> (rank 0, rank 1); step 20's waited for step 10's write
    background = {10: (6.0, 4.0), 20: (5.0, 3.5)}
    out: list[dict[str, Any]] = [{**base, "event": "start", "job_id": "7", "restart": 0, "time": 1.7e9}]
    for step in range(1, 31):
        out.append({**base, "event": "step", "step": step, "dur_s": 0.5, "warmup": step <= 2})
        if step == 3:
            out.append({**base, "event": "agreement", "step": 3, "dur_s": 0.0004, "mode": "overlapped",
                        "step_s": 0.5, "threshold_s": 0.5, "kill_wait_s": 3.0})
        if step in blocked:
            out.append({**base, "event": "save_blocked", "step": step, "dur_s": blocked[step][rank],
                        "kind": "periodic", "staged_bytes": (3 + rank) * MIB,
                        "phases": {"wait_previous": 0.0, "stage": 0.1}})
        if step in background:  # seen committed by the next save's wait
            out.append({**base, "event": "save_background", "step": step, "dur_s": background[step][rank],
                        "kind": "periodic", "bytes": 9 * MIB, "write_s": 2.0, "fsync_s": 1.0, "commit_s": 0.5,
                        "staged_bytes": (3 + rank) * MIB})
    out.append({**base, "event": "save", "step": 30, "dur_s": (2.0, 2.5)[rank], "kind": "jit", "bytes": 9 * MIB})
    out.append({**base, "event": "stop", "step": 30, "dur_s": 9.0, "signal_step": 29, "mode": "overlapped",
                "kill_wait_s": 3.0, "teardown_s": 0.5})
    return out


def _write(out: Path, records_of: Any = _records) -> Path:
    directory = timing.timing_dir(out)
    directory.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        lines = [json.dumps(r) for r in records_of(rank)]
        (directory / f"timing-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def test_the_summary_keeps_blocked_and_background_apart_and_out_of_the_saves(tmp_path: Path) -> None:
    summary = timing.load_summary(_write(tmp_path))
    assert summary.async_saves == timing.AsyncSaveStats(
        count=2, blocked_max_s=0.4, blocked_median_s=0.3, n_background=2, background_max_s=6.0,
        background_median_s=5.0, staged_max_bytes=4 * MIB)
    assert set(summary.saves) == {"jit"} and summary.saves["jit"].count == 1  # the async saves are no "save"


def test_a_jit_stop_is_sized_with_the_wait_for_the_async_save_in_flight(tmp_path: Path) -> None:
    measured = grace.measured_terms(timing.load_summary(_write(tmp_path)))
    assert measured.save_s == 2.5  # the synchronous JIT save only, never the 6 s background write
    assert measured.async_save_s == 0.4 + 6.0  # worst instant: just before step 20's end
    assert "longest training block 0.4 s + longest background write and commit 6 s (of 2 async" \
        in measured.async_save_source
    result = grace.compute_grace(grace.GraceInputs(
        step_s=measured.step_s, save_s=measured.save_s, kill_wait_s=measured.kill_wait_s,
        latency_steps=measured.latency_steps, teardown_s=measured.teardown_s, async_save_s=measured.async_save_s,
        margin=grace.Margin(fraction=0, floor_s=0)))
    # the timeline of the worst stop: signal just before step 20 ends (t=0); staging 0.4 s; 2 steps to the stop
    # read (overlapped), kill_wait 3 s; the JIT save waits the rest of step 20's write (at most all 6 s); JIT save
    # 2.5 s; teardown 0.5 s
    assert [(t.name, t.seconds) for t in result.terms] == [
        ("step", 1.0), ("eval", 0.0), ("save", 2.5), ("kill_wait", 3.0), ("teardown", 0.5), ("async_save", 6.4),
        ("margin", 0.0)]
    assert result.needed_s == pytest.approx(13.4) and result.lead_s == 14


def test_the_margin_counts_the_async_term_and_a_log_without_async_saves_keeps_its_terms(tmp_path: Path) -> None:
    inputs = grace.GraceInputs(step_s=30.0, save_s=20.0, kill_wait_s=3.0, async_save_s=50.0)
    result = grace.compute_grace(inputs)
    assert result.term("margin") == pytest.approx(0.2 * (30 + 20 + 50)) and "+async_save" in result.terms[-1].source
    plain = grace.compute_grace(grace.GraceInputs(step_s=30.0, save_s=20.0, kill_wait_s=3.0))
    assert [t.name for t in plain.terms] == ["step", "eval", "save", "kill_wait", "teardown", "margin"]
    with pytest.raises(grace.GraceError, match="async_save time -1"):
        grace.GraceInputs(step_s=1.0, save_s=1.0, async_save_s=-1.0)


def test_a_killed_run_whose_background_write_never_ended_is_a_warning(tmp_path: Path) -> None:
    def killed(rank: int) -> list[dict[str, Any]]:
        return [r for r in _records(rank) if r["event"] != "save_background"]

    measured = grace.measured_terms(timing.load_summary(_write(tmp_path, killed)))
    assert measured.async_save_s == 0.4  # the staging only
    assert any("none of the 2 async periodic saves in the timing log was seen written to its end" in w and "HINT:" in w
               for w in measured.warnings)


def test_grace_calc_shows_both_figures_and_the_term(tmp_path: Path) -> None:
    out = _write(tmp_path)
    proc = grace_calc("--from", str(out), "--no-slurm", "--margin", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["signal_lead_s"] == 14
    assert {t["name"]: t["seconds"] for t in doc["terms"]}["async_save"] == pytest.approx(6.4)
    assert doc["samples"]["async_saves"] == {
        "count": 2, "blocked_max_s": 0.4, "blocked_median_s": 0.3, "n_background": 2, "background_max_s": 6.0,
        "background_median_s": 5.0, "staged_max_bytes": 4 * MIB, "set_aside_max_s": None,
        "file_max_s": None}  # these records hold no one file's write time
    text = grace_calc("--from", str(out), "--no-slurm", "--margin", "0")
    assert text.returncode == 0, text.stderr
    assert "async_save       6.40  longest training block 0.4 s + longest background" in text.stdout
    assert ("async periodic saves: 2 in the timing log; training blocked per save median 0.3 s, longest 0.4 s; "
            "background write and commit median 5 s, longest 6 s (of 2); staging buffer up to 4.0 MiB per rank"
            in text.stdout)


def test_the_runtime_check_counts_the_wait_for_an_async_save() -> None:
    # 1 x 2 s step + 1 s save + 3 s kill_wait = 6 s fit a 10 s lead; the 6.4 s wait for an async save does not
    assert runtime_grace.assess(step_s=2.0, save_s=1.0, kill_wait_s=3.0, lead_s=10.0, facts=None,
                                latency_steps=1) == []
    warnings = runtime_grace.assess(step_s=2.0, save_s=1.0, kill_wait_s=3.0, lead_s=10.0, facts=None,
                                    latency_steps=1, async_save_s=6.4)
    assert len(warnings) == 1 and "signal lead 10 s < needed 12 s" in warnings[0]
    assert "async save in flight 6.4 s" in warnings[0]


def _with_a_set_aside_save(rank: int) -> list[dict[str, Any]]:
    """The run above, and at step 25 an async save a JIT stop set aside 30 s after its submission (still being
    written: async_save/stop_wait.py records its time so far)."""
    base = {"v": 1, "rank": rank, "world_size": 2, "run_id": "r1"}
    return [*_records(rank), {**base, "event": "save_background", "step": 25, "dur_s": 30.0 - rank, "kind": "periodic",
                              "bytes": 0, "set_aside": True, "staged_bytes": 3 * MIB}]


def test_a_set_aside_write_counts_as_at_least_its_time_so_far_and_says_so(tmp_path: Path) -> None:
    stats = timing.load_summary(_write(tmp_path, _with_a_set_aside_save)).async_saves
    assert stats is not None and stats.set_aside_max_s == 30.0 and stats.count == 3
    assert stats.n_background == 2 and stats.background_max_s == 6.0  # the writes seen to their end, apart
    measured = grace.measured_terms(timing.load_summary(tmp_path))
    assert measured.async_save_s == 0.4 + 30.0, measured
    assert "set aside after 30 s, at least" in measured.async_save_source
    assert any("set aside an async save still being written after 30 s" in w for w in measured.warnings), measured


def test_a_run_whose_only_async_save_was_set_aside_is_sized_with_it(tmp_path: Path) -> None:
    def only_set_aside(rank: int) -> list[dict[str, Any]]:
        base = {"v": 1, "rank": rank, "world_size": 2, "run_id": "r1"}
        kept = [r for r in _with_a_set_aside_save(rank) if r["event"] != "save_background" or r.get("set_aside")]
        return [r for r in kept if r["event"] != "save_blocked" or r["step"] == 10] + [
            {**base, "event": "save_blocked", "step": 25, "dur_s": 0.1, "kind": "periodic", "staged_bytes": MIB,
             "phases": {}}]
    measured = grace.measured_terms(timing.load_summary(_write(tmp_path, only_set_aside)))
    assert measured.async_save_s == pytest.approx(0.3 + 30.0), measured  # not the block alone, unwarned
    assert any("set aside" in w for w in measured.warnings), measured
