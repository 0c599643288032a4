"""Fast unit tests of the small modules: signal latch, worker signal mask, agreement, config, stop record, timing
log, Slurm environment mapping, runtime grace check. Real signals and real processes; no DeepSpeed."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.grace import calc as grace
from slurm_jit.signal_names import parse_signal
from slurm_jit.train import dist_env, runtime_grace, stop_record
from slurm_jit.train.agreement import StopAgreement
from slurm_jit.train.signals import IgnoreSignalsInWorker, SignalLatch, StartWorkersMasked
from slurm_jit.train.trainer import JitConfig


def test_latch_records_first_signal_only_and_restores() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    latch = SignalLatch([signal.SIGUSR1])
    latch.install()
    try:
        assert not latch.seen
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        first = latch.first_at
        assert first is not None and first >= t0 and latch.first_signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)
        assert latch.first_at == first and latch.count == 2
    finally:
        latch.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_latch_keep_ignoring_after_a_stop() -> None:
    latch = SignalLatch([signal.SIGUSR2])
    latch.install()
    latch.restore(keep_ignoring=True)
    try:
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)  # would end the process if not ignored
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_parse_signal() -> None:
    assert parse_signal("TERM") == signal.SIGTERM
    assert parse_signal("sigusr1") == signal.SIGUSR1
    assert parse_signal(15) == signal.SIGTERM
    with pytest.raises(ValueError, match="HINT"):
        parse_signal("NOPE")


def _worker(ready: multiprocessing.synchronize.Event, init: IgnoreSignalsInWorker) -> None:  # type: ignore[name-defined]
    init(0)
    ready.set()
    time.sleep(3)


def test_worker_init_makes_a_forked_worker_survive_sigterm() -> None:
    ctx = multiprocessing.get_context("fork")
    for wrapper, survives in ((IgnoreSignalsInWorker(None, [signal.SIGTERM]), True),
                              (IgnoreSignalsInWorker(None, []), False)):
        ready = ctx.Event()
        proc = ctx.Process(target=_worker, args=(ready, wrapper))
        proc.start()
        assert ready.wait(10)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(0.5 if survives else 10.0)  # dying can take long on a loaded machine; surviving is 0.5 s alive
        assert proc.is_alive() == survives
        proc.kill()
        proc.join()


def test_agreement_single_process_is_pipelined_one_round() -> None:
    agreement = StopAgreement()
    assert not agreement.distributed
    assert agreement.poll(True, 2.0).stop is False  # the answer comes one round later
    decision = agreement.poll(False)
    assert decision.stop is True and 1.5 < decision.wait_s <= 2.0  # the kill_wait left, minus time since sent
    assert agreement.poll(False).stop is False
    assert agreement.poll(False).wait_s == 0.0  # no signal anywhere: nothing to wait for
    late = agreement.agree_now(True, -1.0)
    assert late.stop is True and late.wait_s == 0.0  # kill_wait already over
    assert agreement.broadcast({"x": 1}) == {"x": 1}
    assert agreement.gather(3) == [3]


@pytest.mark.parametrize("kwargs", [{"kill_wait_s": -1}, {"kill_wait_s": float("nan")}, {"signals": ()},
                                    {"signals": ("KILL",)}, {"signals": ("BOGUS",)}])
def test_jit_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="HINT"):
        JitConfig(**kwargs)


def test_stop_record_round_trip_and_cli(tmp_path: Path) -> None:
    def cli() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "slurm_jit.train.stop_record", str(tmp_path)],
                              capture_output=True, text=True, check=False)

    assert cli().returncode == stop_record.EXIT_NO_RECORD
    for state, code in (("running", 1), ("jit_stop", 10), ("finished", 0), ("failed", 1)):
        stop_record.write(tmp_path, state, step=7, checkpoint="c")
        assert stop_record.read(tmp_path)["state"] == state  # type: ignore[index]
        result = cli()
        assert result.returncode == code and result.stdout.startswith(state)
    stop_record.path(tmp_path).write_text("{garbage")
    assert stop_record.read(tmp_path) is None and cli().returncode == stop_record.EXIT_NO_RECORD
    with pytest.raises(ValueError):
        stop_record.write(tmp_path, "exploded")


def test_timing_log_summary_across_ranks_and_restarts(tmp_path: Path) -> None:
    for run_id in ("a", "b"):
        for rank in (0, 1):
            log = timing.TimingLog(tmp_path, rank, 2, run_id)
            for step in range(1, 11):
                log.step(step, 0.1 * step + rank)  # the first WARMUP_STEPS of each run are left out
            log.save(10, "jit", 2.0 + rank, 1000 * (rank + 1))
            log.evaluation(10, 1.5, aborted=False)
            log.close()
    summary = timing.load_summary(tmp_path)
    assert summary.n_runs == 2 and summary.world_sizes == frozenset({2})
    assert summary.n_steps == 2 * 2 * (10 - timing.WARMUP_STEPS)
    assert summary.step_max_s == pytest.approx(2.0)
    assert summary.saves["jit"].max_dur_s == 3.0 and summary.saves["jit"].max_bytes == 2000
    assert summary.eval_max_s == 1.5


def test_timing_log_errors(tmp_path: Path) -> None:
    with pytest.raises(timing.TimingLogError, match="HINT"):
        timing.load_summary(tmp_path)
    path = timing.timing_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    good = json.dumps({"v": 1, "event": "step", "dur_s": 1.0, "rank": 0, "world_size": 1, "run_id": "x"})
    path.write_text(good + "\n" + good[:10])  # a last line cut short by a kill is tolerated
    assert timing.load_summary(tmp_path).n_steps == 1
    path.write_text("not json\n" + good + "\n")
    with pytest.raises(timing.TimingLogError, match=":1: not JSON"):
        timing.load_summary(tmp_path)
    path.write_text(json.dumps({"event": "step", "dur_s": -1}) + "\n")
    with pytest.raises(timing.TimingLogError, match="bad dur_s"):
        timing.load_summary(tmp_path)


def test_dist_env_from_slurm() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "node[3-5,7]", "SLURM_JOB_ID": "1234"}
    assert dist_env.from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "2", "1", "node3")
    assert env["MASTER_PORT"] == str(dist_env.MASTER_PORT_BASE + 1234)
    assert not dist_env.from_slurm({"RANK": "0", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert not dist_env.from_slurm({"SLURM_PROCID": "0"})  # the batch shell, not an srun task
    assert dist_env.first_host("a,b") == "a"


def test_runtime_grace_assess() -> None:
    facts = grace.ClusterFacts(kill_wait_s=30, partition="debug", grace_time_s=20, preemptable=True)
    ok = runtime_grace.assess(step_s=1, save_s=2, kill_wait_s=3, lead_s=60, facts=facts)
    assert ok == []
    short = runtime_grace.assess(step_s=30, save_s=40, kill_wait_s=3, lead_s=60, facts=facts)
    assert len(short) == 2
    assert "signal lead 60 s < needed 73 s" in short[0] and "HINT: #SBATCH --signal=TERM@" in short[0]
    assert "GraceTime 20 s" in short[1]
    unset = runtime_grace.assess(step_s=1, save_s=None, kill_wait_s=3, lead_s=None, facts=None)
    assert len(unset) == 1 and grace.LEAD_ENV_VAR in unset[0]


def test_agreement_mode_is_fixed_after_warm_up_from_the_agreed_step() -> None:
    long = StopAgreement()
    assert long.mode == grace.AGREE_BLOCKING and long.latency_steps == 1
    assert long.at_boundary(True, 1.0, step_s=0.1, choose_mode=False).stop is True  # blocking: read at once
    long.at_boundary(False, None, step_s=2.0, choose_mode=True)
    assert long.choice is not None and long.choice.step_s == 2.0 and long.mode == grace.AGREE_BLOCKING
    assert long.at_boundary(True, 0.5, step_s=0.1, choose_mode=True).stop is True  # chosen once, never again
    assert long.mode == grace.AGREE_BLOCKING
    short = StopAgreement()
    short.at_boundary(False, None, step_s=0.1, choose_mode=True)
    assert short.mode == grace.AGREE_OVERLAPPED and short.latency_steps == 2
    assert short.at_boundary(True, 0.5, step_s=0.1, choose_mode=False).stop is False  # read one boundary later
    assert short.at_boundary(False, None, step_s=0.1, choose_mode=False).stop is True


@pytest.mark.parametrize("masked", [True, False])
def test_spawned_workers_are_born_with_the_stop_signals_blocked(masked: bool) -> None:
    """A signal sent while a spawn worker imports (before worker_init_fn) must not kill it; the parent's latch
    still gets one that arrived while the parent blocked it. SIGUSR1 stands in for the stop signal."""
    from torch.utils.data import DataLoader

    stop = signal.SIGUSR1
    latch = SignalLatch([stop])
    loader = DataLoader(list(range(4)), num_workers=1, multiprocessing_context="spawn",
                        worker_init_fn=IgnoreSignalsInWorker(None, [stop]))

    def start_and_signal():  # type: ignore[no-untyped-def]
        iterator = DataLoader._get_iterator(loader)
        os.kill(os.getpid(), stop)  # inside the blocked window when masked
        for worker in iterator._workers:  # still importing torch: seconds before worker_init_fn
            os.kill(worker.pid, stop)
        return iterator

    loader._get_iterator = StartWorkersMasked(start_and_signal, [stop]) if masked else start_and_signal
    latch.install()
    try:
        if masked:
            assert [int(b) for b in loader] == [0, 1, 2, 3]
        else:
            with pytest.raises(RuntimeError, match="DataLoader worker"):
                list(loader)
        assert latch.seen
        assert stop not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the parent's mask is back
    finally:
        latch.restore()


def test_runtime_grace_counts_latency_steps_and_teardown() -> None:
    # a run that read its rounds overlapped: 2 x 2 s + save 49 + kill_wait 3 + teardown 5 = 61 s > a 60 s lead
    late = runtime_grace.assess(step_s=2, save_s=49, kill_wait_s=3, lead_s=60, facts=None, teardown_s=5,
                                latency_steps=2)
    assert len(late) == 1 and "needed 61 s (2 x longest step 2.0 s" in late[0] and "teardown 5.0 s" in late[0]
    # blocking (recorded, or by the rule for 2 s steps): 59 s fits
    assert runtime_grace.assess(step_s=2, save_s=49, kill_wait_s=3, lead_s=60, facts=None, teardown_s=5) == []
