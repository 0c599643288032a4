"""The grace-period calculator (slurm_jit.grace.calc) and the sbatch script reader (slurm_jit.grace.sbatch_script).

Exact timelines for the docs' 243 s example, property tests for the sum, and each mistake `check` knows.
"""

from __future__ import annotations

import math
from pathlib import Path

import ckpt_factory
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_jit import timing
from slurm_jit.checkpoint import protocol
from slurm_jit.grace import calc as grace
from slurm_jit.grace import cli as grace_cli
from slurm_jit.grace.calc import ClusterFacts, Event, GraceError, GraceInputs, Margin, compute_grace
from slurm_jit.grace.sbatch_script import ScriptError, parse_script, parse_signal, parse_time_limit
from slurm_jit.grace.script_check import check_script

DOCS = GraceInputs(step_s=120, save_s=120, margin=Margin(fraction=0, floor_s=0))  # the transformers docs
LOCAL = ClusterFacts(kill_wait_s=30, kill_wait_source="test", partition="debug", grace_time_s=20,
                     preemptable=True)


# --- parsing user input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("2m", 120), ("1h30m", 5400), ("243", 243), ("2.5", 2.5), ("1.5m", 90), ("1h", 3600),
    ("45sec", 45), ("2min", 120), ("1h 30m", 5400), ("1m30s", 90), (".5", 0.5),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert grace.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "-5", "nan", "NaN", "inf", "0", "0s", "1h-3m", "5x", "m", "1e3",
                                  "2m 2h", "--1"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(GraceError, match="HINT"):
        grace.parse_duration(text, what="--step-time")


def test_zero_duration_only_where_allowed() -> None:
    assert grace.parse_duration("0", allow_zero=True) == 0
    with pytest.raises(GraceError, match="more than 0"):
        grace.parse_duration("0s")


@pytest.mark.parametrize(("text", "margin"), [
    ("0", Margin(fraction=0, floor_s=0)), ("30s", Margin(fraction=0, floor_s=30)),
    ("25%", Margin(fraction=0.25, floor_s=0)), ("1m", Margin(fraction=0, floor_s=60)),
])
def test_parse_margin(text: str, margin: Margin) -> None:
    assert grace.parse_margin(text) == margin


@pytest.mark.parametrize("text", ["-1%", "abc%", "nan%", "-5", "x"])
def test_parse_margin_rejects(text: str) -> None:
    with pytest.raises(GraceError, match="HINT"):
        grace.parse_margin(text)


@pytest.mark.parametrize(("text", "nbytes"), [
    ("512MB", 512 * 10**6), ("3.5GiB", int(3.5 * 2**30)), ("800MB/s", 800 * 10**6), ("1e9", 10**9),
    ("4096", 4096), ("2 KiB", 2048), ("1T", 10**12),
])
def test_parse_size(text: str, nbytes: int) -> None:
    assert grace.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "-1GB", "0", "12XB", "GB", "nan", "1e400", "0.1"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(GraceError, match="HINT"):
        grace.parse_size(text)


@pytest.mark.parametrize(("text", "count"), [("7B", 7 * 10**9), ("350M", 350 * 10**6), ("1.3e9", 13 * 10**8),
                                             ("125k", 125_000)])
def test_parse_params(text: str, count: int) -> None:
    assert grace.parse_params(text) == count


@pytest.mark.parametrize("text", ["", "0", "lots", "1e400", "7X", "-7B"])
def test_parse_params_rejects(text: str) -> None:
    with pytest.raises(GraceError, match="HINT"):
        grace.parse_params(text)


# --- the calculation ------------------------------------------------------------------------------------


def test_docs_example_is_243() -> None:
    result = compute_grace(DOCS)
    assert result.needed_s == 243
    assert result.lead_s == 243
    assert result.option == "--signal=TERM@243"
    assert result.sbatch_line == "#SBATCH --signal=TERM@243"
    assert result.export_line == "export SLURM_JIT_SIGNAL_LEAD_S=243"
    assert [(t.name, t.seconds) for t in result.terms] == [
        ("step", 120), ("eval", 0), ("save", 120), ("kill_wait", 3), ("teardown", 0), ("margin", 0)]


def test_default_margin_is_a_fifth_of_the_timed_terms_with_a_floor() -> None:
    assert compute_grace(GraceInputs(step_s=120, save_s=120)).lead_s == 120 + 120 + 3 + 48
    assert compute_grace(GraceInputs(step_s=1, save_s=2)).lead_s == 1 + 2 + 3 + 10
    assert compute_grace(GraceInputs(step_s=60, save_s=60, eval_s=30)).lead_s == 60 + 60 + 30 + 3 + 30


def test_lead_rounds_up_but_not_float_noise() -> None:
    no_margin = Margin(fraction=0, floor_s=0)
    assert compute_grace(GraceInputs(step_s=0.1, save_s=0.2, kill_wait_s=0, margin=no_margin)).lead_s == 1
    assert compute_grace(GraceInputs(step_s=100.5, save_s=100, kill_wait_s=3, margin=no_margin)).lead_s == 204
    assert compute_grace(GraceInputs(step_s=0.1, save_s=0.2, kill_wait_s=2.7, latency_steps=1,
                                     margin=no_margin)).lead_s == 3


@pytest.mark.parametrize("bad", [
    {"step_s": math.nan}, {"step_s": -1}, {"step_s": 0}, {"save_s": math.inf}, {"save_s": 0},
    {"eval_s": -0.5}, {"kill_wait_s": math.nan}, {"kill_wait_s": -3},
])
def test_inputs_reject_bad_numbers(bad: dict[str, float]) -> None:
    with pytest.raises(GraceError, match="HINT"):
        GraceInputs(**{"step_s": 1.0, "save_s": 1.0, **bad})


def test_margin_rejects_negative_and_nan() -> None:
    with pytest.raises(GraceError):
        Margin(fraction=-0.1, floor_s=0)
    with pytest.raises(GraceError):
        Margin(fraction=0, floor_s=math.nan)


def test_lead_beyond_slurm_maximum_is_an_error() -> None:
    with pytest.raises(GraceError, match="65535"):
        compute_grace(GraceInputs(step_s=60_000, save_s=6_000))


# Capped so that every sum stays under Slurm's largest --signal lead (65535 s); that refusal has its own test.
durations = st.floats(min_value=0.001, max_value=2_000, allow_nan=False, allow_infinity=False)
maybe_zero = st.floats(min_value=0, max_value=2_000, allow_nan=False, allow_infinity=False)
margins = st.builds(Margin, fraction=st.floats(min_value=0, max_value=2), floor_s=maybe_zero)


latencies = st.sampled_from([None, 1, 2])


@given(step=durations, save=durations, evaluation=maybe_zero, kill_wait=maybe_zero, margin=margins,
       latency=latencies, teardown=maybe_zero)
def test_result_never_below_the_sum_of_its_terms(
    step: float, save: float, evaluation: float, kill_wait: float, margin: Margin, latency: int | None,
    teardown: float,
) -> None:
    result = compute_grace(GraceInputs(step_s=step, save_s=save, eval_s=evaluation, kill_wait_s=kill_wait,
                                       latency_steps=latency, teardown_s=teardown, margin=margin))
    assert result.needed_s == pytest.approx(sum(t.seconds for t in result.terms))
    steps = latency or (1 if step >= grace.BLOCKING_MIN_STEP_S else 2)  # the trainer's rule
    assert result.latency_steps == steps
    timed = steps * step + save + evaluation + teardown
    assert result.lead_s >= timed + kill_wait + margin.seconds(timed) - 1e-6
    assert result.lead_s >= step + save + kill_wait - 1e-6  # the docs' formula
    assert result.lead_s == max(1, math.ceil(round(result.needed_s, 6)))


@given(step=durations, save=durations, evaluation=maybe_zero, kill_wait=maybe_zero, margin=margins,
       latency=st.sampled_from([1, 2]), teardown=maybe_zero,
       extra=st.floats(min_value=0, max_value=1_000), which=st.sampled_from(
           ["step_s", "save_s", "eval_s", "kill_wait_s", "teardown_s", "fraction", "floor_s", "latency_steps"]))
def test_result_grows_with_each_term(step: float, save: float, evaluation: float, kill_wait: float,
                                     margin: Margin, latency: int, teardown: float, extra: float,
                                     which: str) -> None:
    base = {"step_s": step, "save_s": save, "eval_s": evaluation, "kill_wait_s": kill_wait,
            "teardown_s": teardown, "latency_steps": latency}
    bigger = dict(base)
    bigger_margin = margin
    if which == "fraction":
        bigger_margin = Margin(fraction=margin.fraction + extra / 1000, floor_s=margin.floor_s)
    elif which == "floor_s":
        bigger_margin = Margin(fraction=margin.fraction, floor_s=margin.floor_s + extra)
    elif which == "latency_steps":
        bigger["latency_steps"] = 2
    else:
        bigger[which] += extra
    small = compute_grace(GraceInputs(**base, margin=margin))
    large = compute_grace(GraceInputs(**bigger, margin=bigger_margin))
    assert large.needed_s >= small.needed_s
    assert large.lead_s >= small.lead_s


@pytest.mark.parametrize(("step_s", "allreduce_s", "mode", "steps"), [
    (0.49, 0.0, grace.AGREE_OVERLAPPED, 2), (0.5, 0.0, grace.AGREE_BLOCKING, 1), (120, 0.0, grace.AGREE_BLOCKING, 1),
    (0.5, 0.006, grace.AGREE_OVERLAPPED, 2),  # a 6 ms round would cost over 1 % of a 0.5 s step
    (0.6, 0.006, grace.AGREE_BLOCKING, 1),
])
def test_latency_follows_the_trainers_agreement_rule(step_s: float, allreduce_s: float, mode: str,
                                                     steps: int) -> None:
    assert grace.agreement_mode(step_s, allreduce_s) == mode
    no_margin = Margin(fraction=0, floor_s=0)
    result = compute_grace(GraceInputs(step_s=step_s, save_s=1, kill_wait_s=3, margin=no_margin,
                                       latency_steps=grace.LATENCY_STEPS[mode]))
    assert result.latency_steps == steps and result.term("step") == pytest.approx(steps * step_s)


def test_short_steps_count_twice_long_steps_once() -> None:
    no_margin = Margin(fraction=0, floor_s=0)
    short = compute_grace(GraceInputs(step_s=0.25, save_s=2, kill_wait_s=3, teardown_s=0.5, margin=no_margin))
    assert short.needed_s == 0.5 + 2 + 3 + 0.5 and short.latency_steps == 2
    # the example: 60 s steps and a 60 s save; one step of latency, as the trainer now stops
    long = compute_grace(GraceInputs(step_s=60, save_s=60, teardown_s=1, margin=no_margin))
    assert long.needed_s == 60 + 60 + 3 + 1 and long.latency_steps == 1
    with pytest.raises(GraceError, match="HINT"):
        GraceInputs(step_s=1, save_s=1, latency_steps=3)


# --- timelines ------------------------------------------------------------------------------------------


def test_time_limit_timeline_of_the_docs_example() -> None:
    t0 = 1_000.0  # the caller's clock when the signal arrives
    line = grace.time_limit_timeline(compute_grace(DOCS), LOCAL, signal_at_s=t0)
    assert [(e.at_s - t0, e.what) for e in line.events] == [
        (0, "--signal=TERM@243 arrives"),
        (120, "the step (and evaluation) in progress ends"),
        (123, "kill wait over: the checkpoint starts"),
        (243, "the checkpoint is complete"),
        (243, "time limit: SIGTERM again"),
        (273, "KillWait (30 s) over: SIGKILL"),
    ]
    assert (line.checkpoint_done_s, line.second_sigterm_s, line.sigkill_s) == (1243, 1243, 1273)
    assert line.fits and line.survives


def test_time_limit_timeline_of_short_steps_with_a_teardown() -> None:
    # 0.25 s steps are read one step late: two steps, then kill_wait, the save and the teardown.
    result = compute_grace(GraceInputs(step_s=0.25, save_s=2, kill_wait_s=3, teardown_s=0.5,
                                       margin=Margin(fraction=0, floor_s=0)))
    line = grace.time_limit_timeline(result, LOCAL, signal_at_s=0)
    assert [(e.at_s, e.what) for e in line.events] == [
        (0, "--signal=TERM@6 arrives"),
        (0.5, "the step in progress and the next one (and evaluation) end"),
        (3.5, "kill wait over: the checkpoint starts"),
        (5.5, "the checkpoint is complete"),
        (6, "train() returns"),
        (6, "time limit: SIGTERM again"),
        (36, "KillWait (30 s) over: SIGKILL"),
    ]
    assert (line.checkpoint_done_s, line.exit_s) == (5.5, 6) and line.fits and line.survives


def test_early_signal_only_adds_time() -> None:
    early_s = grace.SLURM_SIGNAL_EARLY_S
    line = grace.time_limit_timeline(compute_grace(DOCS), LOCAL, signal_at_s=0, early_s=early_s)
    assert (line.checkpoint_done_s, line.second_sigterm_s, line.sigkill_s) == (243, 303, 333)
    assert line.fits


def test_too_short_a_lead_does_not_fit_but_may_survive_killwait() -> None:
    short = compute_grace(GraceInputs(step_s=120, save_s=120, margin=Margin(fraction=0, floor_s=0)))
    late = grace.GraceResult(terms=short.terms, needed_s=short.needed_s, lead_s=230)  # a script's TERM@230
    line = grace.time_limit_timeline(late, LOCAL, signal_at_s=0)
    assert line.checkpoint_done_s == 243 and line.second_sigterm_s == 230 and line.sigkill_s == 260
    assert not line.fits and line.survives


def test_torchrun_kills_the_workers_30_s_after_the_signal() -> None:
    line = grace.time_limit_timeline(compute_grace(DOCS), LOCAL, signal_at_s=0, launcher="torchrun")
    assert Event(at_s=30, what="torchrun SIGKILLs workers") in line.events
    assert line.sigkill_s == 30 and not line.survives


def test_preemption_timeline_on_the_local_debug_partition() -> None:
    line = grace.preemption_timeline(compute_grace(DOCS), LOCAL, preempted_at_s=0)
    assert [(e.at_s, e.what) for e in line.events if "checkpoint" not in e.what and "step" not in e.what] == [
        (0, "preempted: SIGTERM (not the --signal)"),
        (20, "GraceTime (20 s) over: SIGTERM again"),
        (50, "KillWait (30 s): SIGKILL"),
    ]
    assert line.checkpoint_done_s == 243 and not line.survives
    roomy = ClusterFacts(kill_wait_s=30, grace_time_s=300, preemptable=True, preempt_send_user_signal=True)
    line = grace.preemption_timeline(compute_grace(DOCS), roomy, preempted_at_s=0)
    assert line.fits and line.events[0].what == "preempted: the --signal"


# --- the cluster ----------------------------------------------------------------------------------------


def _facts(config: dict[str, str], partitions: dict[str, dict[str, str]], partition: str | None = None):
    import slurm_jit.slurm as gateway

    return grace.read_cluster_facts(
        partition, show_config=lambda: config, show_partition=lambda name: partitions[name],
        default_partition=lambda: "debug", seconds=gateway.seconds,
    )


def test_read_cluster_facts_from_scontrol_values() -> None:
    config = {"KillWait": "45 sec", "PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE",
              "SlurmctldParameters": "enable_configless,preempt_send_user_signal"}
    parts = {"debug": {"GraceTime": "20", "PreemptMode": "REQUEUE"}, "urgent": {"GraceTime": "0",
                                                                                "PreemptMode": "OFF"}}
    facts = _facts(config, parts)
    assert (facts.kill_wait_s, facts.partition, facts.grace_time_s) == (45, "debug", 20)
    assert facts.preemptable
    assert facts.preempt_send_user_signal and facts.kill_wait_source == "scontrol show config"
    assert _facts(config, parts, "urgent").preemptable is False
    assert _facts({"PreemptType": "preempt/none"}, parts).preemptable is False
    assert _facts({}, parts).kill_wait_s == grace.SLURM_KILL_WAIT_DEFAULT_S


def test_cluster_notes_warn_when_grace_time_is_short() -> None:
    result = compute_grace(DOCS)
    notes, warnings = grace.cluster_notes(result, LOCAL)
    assert any("up to 60 s early" in n and "303 s before the time limit" in n for n in notes)
    assert any("hard deadline 273 s" in n for n in notes)
    assert len(warnings) == 1 and "GraceTime 20 s < needed 243 s" in warnings[0] and "HINT" in warnings[0]
    assert not grace.cluster_notes(result, ClusterFacts(grace_time_s=600, preemptable=True))[1]
    assert not grace.cluster_notes(result, ClusterFacts(grace_time_s=0, preemptable=False))[1]
    assert any("not read" in n for n in grace.cluster_notes(result, ClusterFacts())[0])


# --- measured and estimated terms -----------------------------------------------------------------------


def write_log(out: Path, world_size: int, steps: list[float], saves: list[float], evals: list[float] = (),
              rank: int = 0) -> None:
    log = timing.TimingLog(out, rank=rank, world_size=world_size, run_id=f"run-{world_size}-{rank}")
    for i, dur in enumerate(steps, start=1):
        log.step(i, dur)
    for i, dur in enumerate(saves, start=1):
        log.save(i * 10, "periodic", dur, 1000 * i)
    for i, dur in enumerate(evals, start=1):
        log.evaluation(i * 10, dur, aborted=False)
    log.close()


def test_measured_terms_from_a_real_timing_log(tmp_path: Path) -> None:
    # The first WARMUP_STEPS steps (here the 50 s one) are left out of the statistics.
    write_log(tmp_path, 2, [50.0, 1.0] + [2.0] * 30 + [7.0], saves=[4.0, 9.0], evals=[3.0])
    measured = grace.measured_terms(timing.load_summary(tmp_path))
    assert (measured.step_s, measured.save_s, measured.eval_s) == (7.0, 9.0, 3.0)
    assert measured.step_source == "max of 31 steps over 1 run in the timing log"
    assert "2 saves" in measured.save_source and not measured.warnings
    p99 = grace.measured_terms(timing.load_summary(tmp_path), step_stat="p99")
    assert p99.step_s == 7.0  # nearest rank of 31 samples: the largest


def test_measured_terms_use_the_agreement_mode_and_the_stop_the_trainer_recorded(tmp_path: Path) -> None:
    # run "a": 2 s steps read blocking; run "b": 0.4 s steps read overlapped, then a JIT stop with a 0.7 s teardown
    for run_id, step_s, mode in (("a", 2.0, grace.AGREE_BLOCKING), ("b", 0.4, grace.AGREE_OVERLAPPED)):
        log = timing.TimingLog(tmp_path, rank=0, world_size=2, run_id=run_id)
        for i in range(1, 25):
            log.step(i, step_s)
        log.agreement(3, mode=mode, allreduce_s=0.0003, step_s=step_s, threshold_s=0.5, kill_wait_s=1.5)
        log.save(24, "jit", 1.0, 1000)
        if run_id == "b":
            log.stop(24, signal_to_end_s=3.0, fields={"teardown_s": 0.7, "kill_wait_s": 1.5, "mode": mode})
        log.close()
    summary = timing.load_summary(tmp_path)
    assert sorted(summary.steps_by_mode) == [grace.AGREE_BLOCKING, grace.AGREE_OVERLAPPED]
    measured = grace.measured_terms(summary)
    # 1 x 2 s beats 2 x 0.4 s: the blocking runs' step is the worst window
    assert (measured.step_s, measured.latency_steps) == (2.0, 1)
    assert measured.step_source == "max of 22 steps over 2 runs in the timing log (blocking runs)"
    assert "as the trainer recorded" in measured.latency_source
    assert (measured.kill_wait_s, measured.teardown_s) == (1.5, 0.7)
    assert "longest of 1 JIT stops" in measured.teardown_source
    result = compute_grace(GraceInputs(step_s=measured.step_s, save_s=1.0, kill_wait_s=1.5, teardown_s=0.7,
                                       latency_steps=measured.latency_steps, margin=Margin(fraction=0, floor_s=0)))
    assert result.needed_s == pytest.approx(1.5 + 2.0 + 1.0 + 0.7)


def test_a_log_without_modes_gets_the_trainers_rule(tmp_path: Path) -> None:
    write_log(tmp_path, 2, [0.3] * 30, saves=[1.0])  # written before the modes existed: no agreement record
    measured = grace.measured_terms(timing.load_summary(tmp_path))
    assert (measured.step_s, measured.latency_steps) == (0.3, 2)
    assert measured.teardown_s is None and "no JIT stop" in measured.teardown_source


def test_few_samples_are_flagged(tmp_path: Path) -> None:
    write_log(tmp_path, 1, [1.0] * 5, saves=[])
    measured = grace.measured_terms(timing.load_summary(tmp_path))
    assert measured.save_s is None and "only 3 step samples" in measured.warnings[0]


def test_select_world_size(tmp_path: Path) -> None:
    write_log(tmp_path, 2, [1.0] * 5, saves=[1.0])
    records = timing.read_records(tmp_path)
    assert grace.select_world_size(records, None) == records
    assert grace.select_world_size(records, 2) == records
    with pytest.raises(GraceError, match=r"world size \[2\], not 4. HINT"):
        grace.select_world_size(records, 4)
    write_log(tmp_path, 4, [3.0] * 5, saves=[2.0], rank=1)
    mixed = timing.read_records(tmp_path)
    with pytest.raises(GraceError, match=r"mixes world sizes \[2, 4\]. .*HINT: pass --world-size"):
        grace.select_world_size(mixed, None)
    assert {r["world_size"] for r in grace.select_world_size(mixed, 4)} == {4}


@pytest.mark.parametrize(("kwargs", "nbytes"), [
    ({}, 14 * 10**9),  # bf16 weights 2 + fp32 master 4 + Adam moments 8 bytes per parameter
    ({"dtype": "fp32"}, 12 * 10**9),  # no separate master copy
    ({"optimizer": "none"}, 2 * 10**9),
    ({"optimizer": "sgd"}, 10 * 10**9),
    ({"zero_stage": 2, "world_size": 8}, 14 * 10**9),  # one node writes all shards
    ({"zero_stage": 2, "world_size": 8, "nodes": 2}, 8 * 10**9),  # 2 + 12 * 4/8
    ({"zero_stage": 3, "world_size": 8, "nodes": 2}, 7 * 10**9),  # 14 * 4/8
    ({"zero_stage": 1, "world_size": 8, "nodes": 8}, int(3.5 * 10**9)),  # 2 + 12/8
])
def test_checkpoint_bytes_per_node(kwargs: dict[str, object], nbytes: int) -> None:
    assert grace.checkpoint_bytes_per_node(params=10**9, **kwargs) == nbytes


def test_checkpoint_bytes_rejects_bad_layouts() -> None:
    with pytest.raises(GraceError, match="HINT"):
        grace.checkpoint_bytes_per_node(params=10, world_size=2, nodes=4)
    with pytest.raises(GraceError, match="HINT"):
        grace.checkpoint_bytes_per_node(params=10, dtype="int4")


def test_estimate_save_s() -> None:
    assert grace.estimate_save_s(10**9, 5 * 10**8) == 2.0
    with pytest.raises(GraceError, match="--probe"):
        grace.estimate_save_s(10, 0)


def test_probe_really_writes_and_times_with_the_given_clock(tmp_path: Path) -> None:
    ticks = iter([10.0, 12.0])
    seen: list[list[str]] = []

    def clock() -> float:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        return next(ticks)

    bandwidth = grace_cli.probe_write_bandwidth(tmp_path, size_bytes=3 * 2**20 + 5, clock=clock)
    assert bandwidth == (3 * 2**20 + 5) / 2.0
    assert seen[1] and seen[1][0].startswith(".grace-calc-probe-")  # the file exists when the clock stops
    assert list(tmp_path.iterdir()) == []  # and is gone afterwards


def test_probe_of_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(GraceError, match="HINT: give a writable directory"):
        grace_cli.probe_write_bandwidth(tmp_path / "nope", size_bytes=10)
    (tmp_path / "file").write_text("x")
    with pytest.raises(GraceError):
        grace_cli.probe_write_bandwidth(tmp_path / "file", size_bytes=10)


def test_newest_checkpoint_bytes_uses_the_protocol(tmp_path: Path) -> None:
    assert grace_cli.newest_checkpoint_bytes(tmp_path) is None
    assert grace_cli.newest_checkpoint_bytes(tmp_path / "missing") is None
    done = ckpt_factory.checkpoint(tmp_path, 10)
    (done / "notes.txt").write_bytes(b"w" * 5000)  # an extra file, outside the manifest: still counted
    protocol.write_sentinel(tmp_path / "checkpoint-20", 20, "jit")  # newer, but cut short: passed over
    found = grace_cli.newest_checkpoint_bytes(tmp_path)
    assert found is not None
    assert found[0] == sum(p.stat().st_size for p in done.iterdir()) > 5000
    assert "checkpoint-10, step 10, complete" in found[1]


# --- reading scripts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "name", "lead", "batch"), [
    ("TERM@243", "TERM", 243, False), ("B:TERM@243", "TERM", 243, True), ("SIGUSR1@90", "USR1", 90, False),
    ("15@100", "TERM", 100, False), ("TERM", "TERM", 60, False), ("R:TERM@5", "TERM", 5, False),
    ("usr1@0", "USR1", 0, False),
])
def test_parse_signal(value: str, name: str, lead: int, batch: bool) -> None:
    sig = parse_signal(value)
    assert (sig.name, sig.lead_s, sig.batch_only) == (name, lead, batch)


@pytest.mark.parametrize("value", ["X:TERM@1", "TERM@abc", "TERM@70000", "FOO@1", "TERM@-5", ""])
def test_parse_signal_rejects(value: str) -> None:
    with pytest.raises(ScriptError, match="HINT"):
        parse_signal(value)


@pytest.mark.parametrize(("value", "seconds"), [
    ("30", 1800), ("5:30", 330), ("1:00:00", 3600), ("1-12", 36 * 3600), ("1-0:30", 24 * 3600 + 1800),
    ("1-0:0:30", 24 * 3600 + 30), ("UNLIMITED", None), ("0", None), ("00:30:00", 1800),
])
def test_parse_time_limit(value: str, seconds: int | None) -> None:
    assert parse_time_limit(value) == seconds


def test_parse_time_limit_rejects() -> None:
    with pytest.raises(ScriptError, match="HINT"):
        parse_time_limit("half an hour")


def script(*body: str, header: str = "#SBATCH --signal=TERM@300\n#SBATCH --time=01:00:00\n") -> str:
    return "#!/bin/bash\n" + header + "\n".join(body) + "\n"


def test_parse_script_reads_directives_and_the_launch() -> None:
    text = script(
        "set -euo pipefail",
        "export SLURM_JIT_SIGNAL_LEAD_S=300",
        'python -c "import torch"',  # a one-line check: not the training
        "OMP_NUM_THREADS=4 srun --ntasks-per-node 2 --cpu-bind none \\",
        "    python -u train.py --out x > log.txt 2>&1",
        header=("#SBATCH -t 90 --partition=debug  # a comment\n"
                "#SBATCH --signal=USR1@30\n#SBATCH --signal=TERM@300\n"),
    )
    parsed = parse_script(text, "x.sbatch")
    assert parsed.signal is not None and (parsed.signal.name, parsed.signal.lead_s) == ("TERM", 300)
    assert parsed.signal_lineno == 4 and parsed.time_limit_s == 5400 and parsed.partition == "debug"
    assert parsed.exported_lead == "300" and not parsed.traps_signal
    (launch,) = parsed.launches
    assert (launch.lineno, launch.via_srun, launch.background, launch.launcher, launch.runs_python) == (
        8, True, False, None, True)


@pytest.mark.parametrize(("line", "launcher"), [
    ("srun torchrun --nproc-per-node=2 train.py", "torchrun"),
    ("srun python -m torch.distributed.run --nproc-per-node=2 train.py", "torchrun"),
    ("srun deepspeed train.py", "deepspeed"),
    ("srun accelerate launch train.py", "accelerate"),
    ("srun /opt/venv/bin/python3.11 train.py", None),
])
def test_parse_script_finds_launchers(line: str, launcher: str | None) -> None:
    (launch,) = parse_script(script(line)).launches
    assert launch.launcher == launcher and launch.runs_python


def test_a_directive_after_the_first_command_is_ignored_as_sbatch_does() -> None:
    parsed = parse_script(script("echo start", "#SBATCH --signal=TERM@300", "srun python t.py", header=""))
    assert parsed.signal is None and parsed.ignored_signal_lineno == 3


def test_lead_set_on_the_launch_line_counts_as_exported() -> None:
    parsed = parse_script(script("SLURM_JIT_SIGNAL_LEAD_S=300 srun python t.py"))
    assert parsed.exported_lead == "300"
    echoed = parse_script(script("echo SLURM_JIT_SIGNAL_LEAD_S=300 x", "srun python t.py"))
    assert echoed.exported_lead is None


def test_srun_of_an_opaque_program_is_the_launch_when_no_python_is_seen() -> None:
    (launch,) = parse_script(script("srun hostname", "srun ./train.sh")).launches
    assert launch.via_srun and not launch.runs_python and launch.lineno == 5  # the last srun


def test_python_beside_an_srun_training_is_a_side_step() -> None:
    parsed = parse_script(script("srun python train.py", 'python -m report "$OUT" || true'))
    assert [launch.lineno for launch in parsed.launches] == [4]
    assert [launch.lineno for launch in parsed.side_launches] == [5]
    code, text = verdict(script("srun python train.py", "python report.py",
                                header="#SBATCH --signal=TERM@120\n"))
    assert code == 0 and "line 4: `python report.py` runs in the batch shell and gets no signal" in text


def needed(step_s: float = 10, save_s: float = 45) -> grace.GraceResult:
    return compute_grace(GraceInputs(step_s=step_s, save_s=save_s))  # 10 + 45 + 3 + 11 = 69


def verdict(text: str, result: grace.GraceResult | None = None) -> tuple[int, str]:
    report = check_script(parse_script(text, "t.sbatch"), result or needed(), ClusterFacts())
    return report.exit_code, "\n".join(f"{f.level}: {f.message}" for f in report.findings)


def test_check_passes_a_correct_script() -> None:
    code, text = verdict(script("export SLURM_JIT_SIGNAL_LEAD_S=120", "srun python train.py",
                                header="#SBATCH --signal=TERM@120\n#SBATCH --time=60\n"))
    assert code == 0, text
    assert "fail" not in text and "warn" not in text


@pytest.mark.parametrize(("body", "header", "expected"), [
    (["srun python t.py"], "#SBATCH --signal=TERM@30\n",
     "lead 30 s < needed 69 s. HINT: use #SBATCH --signal=TERM@69"),
    (["srun python t.py"], "#SBATCH --signal=TERM\n",
     "lead 60 s (sbatch's default when no @N is given) < needed"),
    (["python t.py"], "#SBATCH --signal=TERM@300\n", "never reaches Python. HINT: start it with srun"),
    (["exec python t.py"], "#SBATCH --signal=TERM@300\n", "runs in the batch shell"),
    (["srun python t.py"], "#SBATCH --signal=B:TERM@300\n", "with B: only the batch shell gets SIGTERM"),
    (["trap 'kill -TERM $pid' TERM", "srun python t.py"], "#SBATCH --signal=B:TERM@300\n",
     "bash runs a trap only after the foreground command ends. HINT: start the launch with `&`"),
    (["srun torchrun --nproc-per-node=2 t.py"], "#SBATCH --signal=TERM@300\n",
     "torchrun SIGKILLs its workers 30 s after it forwards SIGTERM: the checkpoint gets 30 s < needed 69 s"),
    (["srun deepspeed t.py"], "#SBATCH --signal=TERM@300\n", "deepspeed SIGKILLs its workers 30 s"),
    (["export SLURM_JIT_SIGNAL_LEAD_S=120", "srun python t.py"], "#SBATCH --signal=TERM@300\n",
     "exports SLURM_JIT_SIGNAL_LEAD_S=120 but the --signal lead is 300 s"),
    (["srun python t.py"], "#SBATCH --signal=TERM@600\n#SBATCH --time=5\n",
     "the signal is due as soon as the job"),
])
def test_check_catches_each_mistake(body: list[str], header: str, expected: str) -> None:
    code, text = verdict(script(*body, header=header))
    assert code == 1, text
    assert expected in text


@pytest.mark.parametrize(("body", "header"), [
    (["exec python t.py"], "#SBATCH --signal=B:TERM@300\n"),
    (["exec srun python t.py"], "#SBATCH --signal=B:TERM@300\n"),
    (["srun python t.py &", "pid=$!", "trap 'kill -TERM $pid' TERM", "wait $pid"],
     "#SBATCH --signal=B:TERM@300\n"),
])
def test_check_accepts_batch_signals_that_reach_python(body: list[str], header: str) -> None:
    code, text = verdict(script(*body, header=header))
    assert code == 0, text


def test_check_warns_without_failing() -> None:
    header = "#SBATCH --signal=USR1@3000\n#SBATCH --time=120\n"
    code, text = verdict(script("srun python t.py", header=header))
    assert code == 0, text
    assert "Python dies of SIGUSR1 unless the trainer handles it" in text
    assert "more than needed, thrown away at every job end" in text
    assert "of --time" in text  # (3000 + 60) s is 42 % of 2 h
    assert "does not export SLURM_JIT_SIGNAL_LEAD_S" in text


def test_launcher_within_its_30_s_is_fine() -> None:
    code, text = verdict(script("srun torchrun t.py", header="#SBATCH --signal=TERM@60\n"), needed(1, 5))
    assert code == 0 and "needed 19 s fits" in text


def test_check_errors_on_scripts_it_cannot_judge() -> None:
    with pytest.raises(ScriptError, match="no #SBATCH --signal. HINT: add #SBATCH --signal=TERM@69"):
        check_script(parse_script(script("srun python t.py", header=""), "t"), needed(), ClusterFacts())
    with pytest.raises(ScriptError, match="after the first command, and sbatch ignores it"):
        check_script(parse_script(script("cd /x", "#SBATCH --signal=TERM@99", "srun python t.py", header=""),
                                  "t"), needed(), ClusterFacts())
    with pytest.raises(ScriptError, match="no training launch found"):
        check_script(parse_script(script("echo hi"), "t"), needed(), ClusterFacts())


def test_a_need_over_slurms_largest_signal_lead_is_refused_with_a_hint() -> None:
    with pytest.raises(GraceError, match=r"exceeds Slurm's largest --signal lead 65535 s.*HINT"):
        compute_grace(GraceInputs(step_s=40_000, save_s=30_000, kill_wait_s=3, margin=Margin(fraction=0, floor_s=0)))


def test_a_node_range_warns_that_its_fewest_nodes_need_their_own_lead() -> None:
    header = "#SBATCH --signal=TERM@300\n#SBATCH --time=60\n#SBATCH -N 1-2\n"
    code, text = verdict(script("export SLURM_JIT_SIGNAL_LEAD_S=300", "srun python t.py", header=header))
    assert code == 0 and "warn: t.sbatch: #SBATCH --nodes=1-2: a start (a requeue too) may get 1 node(s)" in text, text
    assert "HINT: check it for the fewest: --world-size <ranks on 1 node(s)>" in text, text
    fixed = verdict(script("export SLURM_JIT_SIGNAL_LEAD_S=300", "srun python t.py",
                           header=header.replace("1-2", "2")))[1]
    assert "--nodes" not in fixed, fixed


@pytest.mark.parametrize("value", ["2-1", "0", "1-16:4"])
def test_a_node_range_sbatch_refuses_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(ScriptError, match=rf"^t.sbatch:4: #SBATCH --nodes={value}: .* HINT: "):
        parse_script(script("srun python t.py", header=f"#SBATCH --signal=TERM@300\n#SBATCH --time=60\n"
                                                        f"#SBATCH --nodes={value}\n"), "t.sbatch")
