"""The lost-peer stop record without ranks: which errors mean a lost peer, which rank is named, who writes the
record, what it never replaces, and the line ``python -m slurm_jit.stop_record`` prints for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from slurm_jit.train import lost_peers, stop_record, stop_summary
from slurm_jit.train.save_errors import CheckpointWriteError, peer_gone_line

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:49293: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv"


def test_a_gloo_reset_is_a_lost_peer_said_in_one_short_line() -> None:
    how = lost_peers.how_lost(RuntimeError(GLOO_RESET))
    assert how == "Read error [127.0.0.1]:49293: Connection reset by peer", how


def test_a_gloo_timeout_is_a_lost_peer() -> None:
    assert lost_peers.how_lost(dist.DistBackendError(GLOO_TIMEOUT)) == "Timed out waiting 5000ms for recv"


def test_a_save_s_one_line_over_a_gloo_reset_names_the_reset() -> None:
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as exc:
            raise CheckpointWriteError(peer_gone_line(Path("/out/checkpoint-6"), exc)) from None
    except CheckpointWriteError as save_error:
        assert "Connection reset by peer" in str(save_error) and "pair.cc" not in str(save_error), str(save_error)
        how = lost_peers.how_lost(save_error)
    assert how is not None and how.endswith("Read error [127.0.0.1]:49293: Connection reset by peer"), how


@pytest.mark.parametrize("exc", [TimeoutError("the tokenizer download timed out"), RuntimeError("CUDA out of memory"),
                                 ValueError("Connection reset by peer")])
def test_a_user_s_own_error_is_not_a_lost_peer(exc: BaseException) -> None:
    assert lost_peers.how_lost(exc) is None


def test_the_ranks_without_a_report_are_the_lost_ones() -> None:
    assert lost_peers.lost_ranks(4, {0, 2, 3}) == [1]
    assert lost_peers.lost_ranks(2, {1}) == [0]


def test_when_every_rank_reported_the_late_one_is_named_not_the_one_that_timed_out() -> None:
    # overlapped stop rounds: rank 1 was late past the side group's timeout, both ranks fail at the next boundary,
    # rank 0 with gloo's timeout, rank 1 on rank 0's closed side; whichever rank writes, rank 1 is named
    reports = {0: "wait: Timed out waiting 5000ms for recv", 1: "wait: Connection closed by peer [127.0.0.1]:1"}
    assert lost_peers.named_ranks(2, reports, writer=0) == [1]
    assert lost_peers.named_ranks(2, {0: "Timed out", 1: "Timed out"}, writer=0) == [1]  # no telling: the other one
    assert lost_peers.named_ranks(3, {0: "Timed out", 2: "Connection reset by peer"}, writer=0) == [1]  # no report


@pytest.fixture(autouse=True)
def _short_report_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A survivor waits for every rank's report; the peers these tests leave out never write one."""
    monkeypatch.setattr(lost_peers, "REPORT_WAIT_S", 0.2)


def _survivor(out: Path, rank: int, world: int = 2, step: int = 6) -> SimpleNamespace:
    """The session's fields ``lost_peers.record`` reads, for a survivor of a ``world``-rank run."""
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(out), process_index=rank, world_size=world),
                              state=SimpleNamespace(global_step=step))
    return SimpleNamespace(trainer=trainer, open_agreement=SimpleNamespace(nodes=[f"node{r}" for r in range(world)]))


def _started_run() -> SimpleNamespace:
    """The run fields ``lost_peers.record`` reads, past the output_dir's lock (its timing log exists)."""
    return SimpleNamespace(resumed_from=None, timing=object())


def test_rank0_lost_makes_the_lowest_survivor_write_the_record(tmp_path: Path) -> None:
    stop_record.write(tmp_path, "running", step=None)
    wrote = lost_peers.record(_survivor(tmp_path, 1), _started_run(), "barrier: Connection reset by peer")
    record = stop_record.read(tmp_path)
    assert wrote and record is not None and record["state"] == "failed", record
    assert record["lost_peer"] == {"rank": 0, "step": 6, "node": "node0", "how": "barrier: Connection reset by peer"}


@pytest.mark.parametrize("state", ["jit_stop", "finished", "hung"])
def test_a_peer_lost_after_the_record_was_final_keeps_it(tmp_path: Path, state: str) -> None:
    stop_record.write(tmp_path, state, step=6, checkpoint=str(tmp_path / "checkpoint-6"))
    wrote = lost_peers.record(_survivor(tmp_path, 1), _started_run(), "Connection reset by peer")
    record = stop_record.read(tmp_path)
    assert not wrote and record is not None and record["state"] == state, record


def test_stop_record_cli_prints_the_lost_peer_and_exits_as_a_crash(tmp_path: Path) -> None:
    stop_record.write(tmp_path, "failed", step=7, error="peer rank 1 lost at step 7: barrier: Connection reset",
                      lost_peer={"rank": 1, "step": 7, "node": "n2", "how": "barrier: Connection reset by peer"})
    cli = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(tmp_path)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == stop_record.EXIT_CRASHED, (cli.stdout, cli.stderr)
    assert cli.stdout.strip() == ("failed step=7 peer rank 1 lost (node n2, at step 7: barrier: Connection reset by "
                                  "peer)"), cli.stdout


def test_an_earlier_run_s_peer_lost_reports_are_cleared_with_its_hang_reports(tmp_path: Path) -> None:
    stop_record.write_report(stop_record.peer_lost_report_path(tmp_path, 0), {"rank": 0})
    stop_record.clear_hang_reports(tmp_path)
    assert stop_record.reports(tmp_path, stop_record.PEER_LOST_GLOB) == []


def test_a_late_rank_finding_its_peer_s_report_leaves_the_record_to_the_lowest_rank(tmp_path: Path) -> None:
    stop_record.write(tmp_path, "running", step=None)
    stop_record.write_report(stop_record.peer_lost_report_path(tmp_path, 0),
                             {"rank": 0, "node": "node0", "step": 6, "how": "wait: Timed out waiting 5000ms"})
    wrote = lost_peers.record(_survivor(tmp_path, 1), _started_run(), "wait: Connection closed by peer")
    record = stop_record.read(tmp_path)
    assert not wrote and record is not None and record["state"] == "running", record


def test_a_survivor_before_the_output_dir_s_lock_was_passed_writes_no_record(tmp_path: Path) -> None:
    stop_record.write(tmp_path, "running", step=3)  # another training's, on this output_dir
    wrote = lost_peers.record(_survivor(tmp_path, 1), SimpleNamespace(resumed_from=None, timing=None),
                              "broadcast: Connection reset by peer")
    record = stop_record.read(tmp_path)
    assert not wrote and record is not None and record["state"] == "running", record


def test_a_peer_that_failed_on_its_own_error_is_quoted_and_is_a_crash_not_a_lost_peer(tmp_path: Path) -> None:
    stop_record.write(tmp_path, "running", step=None)
    own = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Terminated."
    stop_record.write_report(stop_record.failed_report_path(tmp_path, 0), {"rank": 0, "step": 6, "error": own})
    wrote = lost_peers.record(_survivor(tmp_path, 1), _started_run(), "all_reduce: Connection closed by peer")
    record = stop_record.read(tmp_path)
    assert wrote and record is not None and record["state"] == "failed", record
    assert record["lost_peer"]["error"] == own and record["error"].endswith(f"; rank 0 failed: {own}"), record
    assert stop_summary.lost_peer(record) is None  # the launcher's policy: a crash (no retry-on-hang, no exclusion)


def test_an_earlier_run_s_failure_reports_are_cleared_with_the_others(tmp_path: Path) -> None:
    stop_record.write_report(stop_record.failed_report_path(tmp_path, 1), {"rank": 1, "step": 2, "error": "x"})
    stop_record.clear_hang_reports(tmp_path)
    assert stop_record.reports(tmp_path, stop_record.FAILED_GLOB) == []
