"""grace-calc and an elastic resume: the next start on another number of ranks converts its checkpoint before its
first step (issue 13). The estimate and the --time check are pure (calc.py); the CLI reads a real timing log
(written by the real writer) and a checkpoint written by the real protocol (tests/helpers/ckpt_factory.py).
Under 2 s."""

from __future__ import annotations

import json
from pathlib import Path

import ckpt_factory
from grace_helpers import grace_calc

from slurm_jit import timing
from slurm_jit.grace import calc as grace

CONVERT_S, CONVERT_BYTES = 30.0, 3 * 10**9  # an earlier conversion: 10 ns per byte


def _conversion(seconds: float | None) -> grace.Conversion:
    return grace.Conversion(written_by=2, world_size=1, checkpoint="out/checkpoint-5", seconds=seconds,
                            source="given")


def test_the_estimate_scales_the_slowest_rate_by_the_checkpoint_bytes() -> None:
    seconds, source = grace.conversion_estimate([(CONVERT_S, CONVERT_BYTES), (1.0, 10**9)], 6 * 10**9)
    assert seconds == 60.0 and "2 conversions in the timing log" in source, source
    assert grace.conversion_estimate([(CONVERT_S, 0)], 6 * 10**9) == (CONVERT_S, "longest of 1 conversion in "
                                                                                  "the timing log")
    seconds, source = grace.conversion_estimate([], 10**9)
    assert seconds is None and "not estimated" in source


def test_a_time_limit_that_cannot_fit_the_conversion_and_one_step_is_a_warning() -> None:
    # --time 300 s, lead 100 s: 140 s before the signal can come (Slurm sends it up to 60 s early).
    assert grace.conversion_finding(_conversion(120.0), 300, 100, step_s=10.0) is None  # 130 s fits
    late = grace.conversion_finding(_conversion(135.0), 300, 100, step_s=10.0)
    assert late is not None and "leaves 140 s before the signal" in late and "= 145 s" in late, late
    assert "HINT: ask for a longer --time, or resume on 2 ranks" in late
    assert grace.conversion_finding(_conversion(None), 300, 100, step_s=10.0) is None  # unknown: nothing said
    assert grace.conversion_finding(_conversion(135.0), None, 100, step_s=10.0) is None  # no --time
    assert "~120 s" in grace.conversion_note(_conversion(120.0))


def _out_converting(tmp_path: Path) -> Path:
    """OUT_DIR: a ZeRO-2 checkpoint of 2 ranks (a few KiB), and a timing log of a 1-rank run that converted one
    of 1000 bytes in 30 s: the next one is estimated at about 90 s."""
    out = tmp_path / "out"
    ckpt_factory.checkpoint(out, 5, world=2, deepspeed=True)
    log = timing.TimingLog(out, rank=0, world_size=1, run_id="r1")
    log.conversion(3, CONVERT_S, 1000, from_world_size=2)
    for step in range(4, 30):
        log.step(step, 0.5)
    log.save(29, "jit", 4.0, 123_456)
    log.close()
    return out


def test_grace_calc_says_the_next_start_converts_and_check_warns_on_a_short_time(tmp_path: Path) -> None:
    out = _out_converting(tmp_path)
    proc = grace_calc("--from", str(out), "--world-size", "1", "--no-slurm")
    assert proc.returncode == 0, proc.stderr
    assert "the next start on 1 ranks converts" in proc.stdout and "(written by 2 ranks)" in proc.stdout
    assert "1 conversion in the timing log" in proc.stdout and "~8" in proc.stdout, proc.stdout
    as_json = json.loads(grace_calc("--from", str(out), "--world-size", "1", "--no-slurm", "--json").stdout)
    assert as_json["conversion"]["written_by"] == 2 and as_json["conversion"]["seconds"] > 0, as_json
    same = json.loads(grace_calc("--from", str(out), "--world-size", "2", "--step-time", "1s", "--save-time",
                                 "5s", "--no-slurm", "--json").stdout)
    assert same["conversion"] is None, same  # on the 2 ranks that wrote it: nothing to convert
    script = tmp_path / "short.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --time=1:40\n#SBATCH --signal=TERM@30\nexec srun python t.py\n")
    check = grace_calc("check", str(script), "--from", str(out), "--world-size", "1", "--no-slurm")
    # 100 s - lead 30 s - 60 s early = 10 s before the signal: not enough for ~90 s of conversion and a step.
    assert "leaves 10 s before the signal" in check.stdout, check.stdout + check.stderr
    assert "but the next start converts first" in check.stdout, check.stdout


def test_given_times_size_a_job_on_another_world_size_than_the_timing_log(tmp_path: Path) -> None:
    """A job resubmitted on fewer ranks: the log's times are another world size's (refused as before without given
    times), but --step-time and --save-time were refused too, against the error's own HINT."""
    out = _out_converting(tmp_path)  # a timing log of 1 rank
    refused = grace_calc("--from", str(out), "--world-size", "2", "--no-slurm")
    assert refused.returncode == 2 and "give --step-time and --save-time" in refused.stderr, refused.stderr
    given = grace_calc("--from", str(out), "--world-size", "2", "--step-time", "1s", "--save-time", "5s",
                       "--no-slurm", "--json")
    assert given.returncode == 0, given.stderr
    terms = {t["name"]: t["seconds"] for t in json.loads(given.stdout)["terms"]}
    assert (terms["step"], terms["save"]) == (1.0, 5.0), terms


def test_a_conversion_record_with_odd_bytes_is_estimated_from_its_seconds_alone(tmp_path: Path) -> None:
    """A hand-edited or foreign timing log: bytes true (taken as 1 byte: an estimate of a day), or larger than any
    file (a traceback: int too large to convert to float). Such bytes are unknown: the longest conversion stands."""
    for odd in (True, 10**400, -5, 1e3):
        out = _out_converting(tmp_path / str(hash(odd)))
        log = timing.TimingLog(out, rank=0, world_size=1, run_id="r2")
        log.conversion(29, 40.0, odd, from_world_size=2)  # type: ignore[arg-type]
        log.close()
        proc = grace_calc("--from", str(out), "--world-size", "1", "--no-slurm", "--json")
        assert proc.returncode == 0 and proc.stderr == "", (odd, proc.stderr)
        seconds = json.loads(proc.stdout)["conversion"]["seconds"]
        assert 80 < seconds < 100, (odd, seconds)  # the 30 s for 1000 bytes, scaled to the checkpoint


def test_given_times_size_a_job_whose_output_dir_has_checkpoints_but_no_timing_log(tmp_path: Path) -> None:
    """Checkpoints copied to a new OUT_DIR (no timing log there): --step-time and --save-time were refused with
    the HINT to give them; they size the job, and the note still says the next start converts."""
    out = tmp_path / "out"
    ckpt_factory.checkpoint(out, 5, world=2, deepspeed=True)
    given = grace_calc("--from", str(out), "--world-size", "1", "--step-time", "1s", "--save-time", "5s",
                       "--no-slurm")
    assert given.returncode == 0, given.stderr
    assert "the next start on 1 ranks converts" in given.stdout and "time unknown" in given.stdout, given.stdout
    alone = grace_calc("--from", str(out), "--world-size", "1", "--no-slurm")
    assert alone.returncode == 2 and "no timing log" in alone.stderr and "HINT" in alone.stderr, alone.stderr


def _two_rank_log(out: Path) -> None:
    """A 2-rank run's timing log: 29 steps of 1.5 s, then a 4 s JIT save."""
    log = timing.TimingLog(out, rank=0, world_size=2, run_id="r1")
    for step in range(1, 30):
        log.step(step, 1.5)
    log.save(29, "jit", 4.0, 123_456)
    log.close()


def _sized_for_one_rank(out: Path) -> dict:
    sized = grace_calc("--from", str(out), "--world-size", "1", "--no-slurm", "--json")
    assert sized.returncode == 0, sized.stderr
    return json.loads(sized.stdout)


def test_a_job_on_fewer_ranks_than_the_log_scales_its_step_and_save_and_says_so(tmp_path: Path) -> None:
    """After a shrink (2 ranks -> 1, the global batch kept) each rank runs twice the micro-batches of a step: the
    2-rank log's step and save are scaled by 2, with a warning that the step time of 1 rank is not 2 ranks'."""
    out = tmp_path / "out"
    _two_rank_log(out)
    report = _sized_for_one_rank(out)
    terms = {t["name"]: t["seconds"] for t in report["terms"]}
    assert terms["save"] == 8.0 and max(v for k, v in terms.items() if k.startswith("step")) >= 3.0, terms
    assert any("world size 1 is not 2" in t["source"] for t in report["terms"]), report["terms"]
    assert any("no step at world size 1" in w and "HINT:" in w for w in report["warnings"]), report["warnings"]
    grown = grace_calc("--from", str(out), "--world-size", "4", "--no-slurm")  # more ranks: not estimated
    assert grown.returncode == 2 and "give --step-time and --save-time" in grown.stderr, grown.stderr


def test_a_shrunk_run_that_never_saved_takes_the_larger_world_sizes_save_scaled(tmp_path: Path) -> None:
    """A 2 -> 1 resume that ran (its steps are in the log) but never saved (stopped by a crash, or no periodic
    saves before its end): its own steps, and the 2-rank save scaled by 2. Before: 'a checkpoint of N MiB but no
    write bandwidth' (found with a real DDP 2 -> 1 resume), so the requeue of such a job could not be sized."""
    out = tmp_path / "out"
    _two_rank_log(out)
    one = timing.TimingLog(out, rank=0, world_size=1, run_id="r2")
    for step in range(30, 60):
        one.step(step, 2.5)
    one.close()
    report = _sized_for_one_rank(out)
    terms = {t["name"]: t["seconds"] for t in report["terms"]}
    assert terms["save"] == 8.0 and max(v for k, v in terms.items() if k.startswith("step")) == 2.5, terms
    assert any("no save at world size 1: world size 2's is scaled" in w for w in report["warnings"]), report


def test_shrunk_terms_scale_step_and_save_by_the_ratio_of_world_sizes() -> None:
    measured = grace.Measured(step_s=2.0, step_source="max", latency_steps=1, latency_source="", save_s=5.0,
                              save_source="longest", eval_s=None, eval_source="", kill_wait_s=3.0, teardown_s=None,
                              teardown_source="", warnings=())
    shrunk = grace.shrunk_terms(measured, 4, 1)
    assert (shrunk.step_s, shrunk.save_s, shrunk.kill_wait_s) == (8.0, 20.0, 3.0)
    assert len(shrunk.warnings) == 1 and "scaled by 4" in shrunk.warnings[0]
