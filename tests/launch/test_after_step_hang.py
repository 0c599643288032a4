"""after_step after a hang or a lost peer: the --retry-on-hang budget remembered across restarts, the stuck node
excluded (requeuehold, update ExcNodeList, release: a running job's ExcNodeList cannot be changed), a restart
that Slurm made itself named as a node failure. The Slurm gateway is swapped for a fake at its one boundary;
tests/integration/test_requeue_exclude_node.py runs the exclusion on the real 2-node cluster."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_jit import slurm
from slurm_jit.launch import after_step, progress
from slurm_jit.train import stop_record

SHOW_JOB = ("JobId=42 JobName=x\n   JobState=RUNNING Reason=None Dependency=(null)\n   Requeue=1 Restarts=0 "
            "BatchFlag=1\n   RunTime=00:02:10 TimeLimit=01:00:00 TimeMin=N/A\n   PreemptTime=None\n"
            "   ReqNodeList=(null) ExcNodeList={excluded}\n")
RANKS = [{"rank": 1, "node": "node2", "step": 6, "phase": "step", "since_s": 31.0, "frame": "t.py:1 in f"},
         {"rank": 0, "node": "node1", "step": 6, "phase": "step", "since_s": 30.5,
          "frame": "distributed_c10d.py:2501 in all_reduce"}]


class Gateway:
    """Answers ``scontrol show job`` with a running job and records every argv; fails the commands named."""

    def __init__(self, excluded: str = "(null)", fail: tuple[str, ...] = ()) -> None:
        self.excluded, self.fail, self.calls = excluded, fail, []  # type: list[list[str]]

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(list(argv))
        if argv[1:2] and argv[1] in self.fail:
            raise slurm.SlurmError(f"scontrol {argv[1]} failed (exit 1): Access/permission denied")
        return SHOW_JOB.format(excluded=self.excluded) if argv[:3] == ["scontrol", "show", "job"] else ""

    def acts(self) -> list[list[str]]:
        return [c for c in self.calls if c[:3] != ["scontrol", "show", "job"]]


def _hung(out: Path, restart: int = 0, **fields: object) -> dict[str, str]:
    stop_record.write(out, "hung", step=6, job_id="42", restart_count=restart, **fields)
    return {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restart)}


def _run(out: Path, env: dict[str, str], *extra: str) -> int:
    return after_step.main([str(out), "--srun-exit", "87", "--max-requeues", "5", *extra], env=env)


def test_hang_budget_is_spent_once_and_remembered_across_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS)) == 0
    out = capsys.readouterr().out
    assert "stopped by hang at step 6 on rank 1 (node node2), stack in the log (restart 0); policy: requeue" in out
    assert gateway.acts() == [["scontrol", "requeue", "42"]]
    saved = progress.read(tmp_path)
    assert progress.hang_retries(saved, "42") == 1 and progress.failure_retries(saved, "42") == 0
    assert _run(tmp_path, _hung(tmp_path, restart=1, ranks=RANKS)) == 87  # the second hang: budget spent
    assert "hang retries used up (--retry-on-hang 1, 1 used)" in capsys.readouterr().out
    assert gateway.acts() == [["scontrol", "requeue", "42"]]


def test_lost_peer_is_requeued_under_the_hang_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(slurm, "runner", Gateway())
    stop_record.write(tmp_path, "failed", step=9, job_id="42", restart_count=0, error="peer lost",
                      lost_peer={"rank": 1, "step": 9, "node": "node2", "how": "side group timed out"})
    assert _run(tmp_path, {"SLURM_JOB_ID": "42"}, "--retry-on-hang", "2") == 0
    assert "stopped by peer rank 1 lost at step 9 (node node2)" in capsys.readouterr().out
    assert progress.hang_retries(progress.read(tmp_path), "42") == 1


def test_exclude_hung_node_requeues_held_excludes_and_releases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    gateway = Gateway(excluded="node7")
    monkeypatch.setattr(slurm, "runner", gateway)
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS[:1]), "--exclude-hung-node") == 0
    assert gateway.acts() == [["scontrol", "requeuehold", "42"],
                              ["scontrol", "update", "JobId=42", "ExcNodeList=node7,node2"],
                              ["scontrol", "release", "42"]]
    assert "excluding node node2" in capsys.readouterr().out


def test_an_exclusion_slurm_refuses_still_requeues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    gateway = Gateway(fail=("update",))
    monkeypatch.setattr(slurm, "runner", gateway)
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS[:1]), "--exclude-hung-node") == 0
    assert gateway.acts()[-1] == ["scontrol", "release", "42"]
    assert "warning: node node2 not excluded" in capsys.readouterr().out


def test_a_release_that_fails_says_the_job_is_held_and_how_to_release_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(slurm, "runner", Gateway(fail=("release",)))
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS[:1]), "--exclude-hung-node") == 1
    assert "requeued but held" in capsys.readouterr().out and "HINT: scontrol release 42" in \
        progress.read(tmp_path)["history"][-1]["outcome"]


def test_a_restart_the_launcher_did_not_make_is_named_a_node_failure(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(slurm, "runner", Gateway())
    stop_record.write(tmp_path, "jit_stop", step=12, job_id="42", restart_count=1,
                      checkpoint=str(tmp_path / "checkpoint-12"))
    _run(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    assert "restart 1 was made by Slurm itself, not by this launcher: node failure" in capsys.readouterr().out
    first = progress.history(progress.read(tmp_path))[0]
    assert (first["restart"], first["cause"], first["outcome"]) == (0, "node failure", "requeued by Slurm")
    stop_record.write(tmp_path, "jit_stop", step=20, job_id="42", restart_count=2,
                      checkpoint=str(tmp_path / "checkpoint-20"))
    progress.write(tmp_path, {**progress.read(tmp_path), "history": [
        *progress.history(progress.read(tmp_path))[:-1],
        {"job_id": "42", "restart": 1, "cause": "time limit", "outcome": "requeued", "requeue": True}]})
    _run(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"})  # restart 2 was after_step's own
    assert "made by Slurm itself" not in capsys.readouterr().out


class SmallCluster(Gateway):
    """A job of ``num_nodes`` nodes in partition ``debug`` of node[1-2]; ``scontrol show hostnames`` expands."""

    def __init__(self, num_nodes: int, required: str = "(null)") -> None:
        super().__init__()
        self.num_nodes, self.required = num_nodes, required

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        if argv[:3] == ["scontrol", "show", "job"]:
            self.calls.append(list(argv))
            return (SHOW_JOB.format(excluded="(null)").replace("ReqNodeList=(null)", f"ReqNodeList={self.required}")
                    + f"   Partition=debug NumNodes={self.num_nodes} NumCPUs=2\n")
        if argv[:3] == ["scontrol", "show", "partition"]:
            return "PartitionName=debug\n   Nodes=node[1-2]\n   State=UP TotalNodes=2\n"
        if argv[:3] == ["scontrol", "show", "hostnames"]:
            return {"node[1-2]": "node1\nnode2\n"}.get(argv[3], argv[3] + "\n")
        return super().__call__(argv, timeout_s)


@pytest.mark.parametrize(("num_nodes", "required", "node", "why"), [
    (2, "(null)", "node2", "the job needs 2 node(s) and partition debug would have 1 left without it"),
    (1, "node2", "node2", "the job requires it (ReqNodeList=node2)"),
    (1, "(null)", "vm", "it is not a node of partition debug")])  # a host name, not Slurm's node name
def test_an_exclusion_that_cannot_hold_is_a_plain_requeue_said_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], num_nodes: int,
        required: str, node: str, why: str) -> None:
    gateway = SmallCluster(num_nodes, required)
    monkeypatch.setattr(slurm, "runner", gateway)
    assert _run(tmp_path, _hung(tmp_path, ranks=[{**RANKS[0], "node": node}]), "--exclude-hung-node") == 0
    assert gateway.acts() == [["scontrol", "requeue", "42"]]  # never held, never an impossible ExcNodeList
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning:" in line]
    assert len(warning) == 1 and f"node {node} not excluded: {why}" in warning[0] and "HINT:" in warning[0], warning


def test_an_exclusion_that_leaves_enough_nodes_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = SmallCluster(1)
    monkeypatch.setattr(slurm, "runner", gateway)
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS[:1]), "--exclude-hung-node") == 0
    assert ["scontrol", "update", "JobId=42", "ExcNodeList=node2"] in gateway.acts()


def test_a_node_range_job_excludes_a_node_while_its_fewest_are_left(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A job of --nodes 1-2 runs on both nodes (NumNodes=2 while running): the exclusion leaves it 1, its MIN."""
    gateway = SmallCluster(2)
    monkeypatch.setattr(slurm, "runner", gateway)
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS[:1]), "--exclude-hung-node", "--min-nodes", "1") == 0
    assert ["scontrol", "update", "JobId=42", "ExcNodeList=node2"] in gateway.acts()


@pytest.mark.parametrize("node", [None, "node2 ExcNodeList=node1", "node[1-2]", "", 7])
def test_exclude_hung_node_with_no_usable_node_requeues_and_says_none_was_excluded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], node: object) -> None:
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    report = {**RANKS[0], "node": node}
    assert _run(tmp_path, _hung(tmp_path, ranks=[report]), "--exclude-hung-node") == 0
    assert gateway.acts() == [["scontrol", "requeue", "42"]]  # never an ExcNodeList built from the record's words
    out = capsys.readouterr().out
    assert "policy: requeue" in out and "no node excluded: the stop record names no node usable" in out, out


@pytest.mark.parametrize(("stored", "requeued"), [(-3, True), ("x", True), (True, True), ([1], True), (1, False)])
def test_a_hand_edited_hang_count_never_widens_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         stored: object, requeued: bool) -> None:
    """A count that is no count reads as 0 spent: one retry (the default budget), never -3's four."""
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    progress.write(tmp_path, {"job_id": "42", "hang_retries": {"42": stored}})
    assert _run(tmp_path, _hung(tmp_path, ranks=RANKS)) == (0 if requeued else 87)
    assert progress.hang_retries(progress.read(tmp_path), "42") == 1
    if requeued:  # the one retry spent: the next hang is not requeued
        assert _run(tmp_path, _hung(tmp_path, restart=1, ranks=RANKS)) == 87
    assert gateway.acts() == ([["scontrol", "requeue", "42"]] if requeued else [])
