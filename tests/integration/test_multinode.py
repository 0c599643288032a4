"""Multi-node, for real: the two-node local cluster (``tools/local-slurm up --nodes 2``), two slurmd with their
own names and addresses (node2 in its own network namespace), one rank per node talking over those addresses,
and a DeepSpeed JIT stop and resume across them. Plus unit tests of how each rank finds MASTER_ADDR.

The two-node cluster is a second instance beside the single-node one: the ``two_nodes`` fixture (conftest)
points the Slurm gateway at its config for the module's duration, and ``two_node_jobs`` cancels this module's jobs
there. 2.4 min measured on 2 cores under load ~13: the all-reduce job 13 s, the two DeepSpeed jobs (start, JIT
stop; resume, finish) 87 s, the cluster's down and up 16 s (~5 s to start it on first use).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, losses
from multinode_helpers import CALLER_ENV, UP_TIMEOUT_S, local_slurm

from slurm_jit import slurm
from slurm_jit.checkpoint import protocol
from slurm_jit.train import dist_env, stop_record

NETNS = "slurm-jit-node2"  # tools/local-slurm's names for node2's network namespace and node1's veth end
HOST_VETH = "sjl-node1"
NODES = ("node1", "node2")  # tools/local-slurm names them so
START_TIMEOUT_S = 240  # the cluster is free within seconds; a loaded machine is slow to start python
JOB_TIMEOUT_S = 300  # a 2-rank DeepSpeed run to its end, on 2 busy cores
STOP_TIMEOUT_S = 120  # signal -> JIT checkpoint -> both ranks exit -> job COMPLETED
POLL_S = 0.5
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
RUNNING = {"PENDING", "CONFIGURING", "RUNNING"}
JIT_AFTER_STEPS = 5
RESUMED_EXTRA_STEPS = 3


# --- MASTER_ADDR: unit tests, Slurm faked at the gateway -------------------------------------------------


class NodeAddrRunner:
    """Answers ``scontrol show node NAME`` with NodeAddr=``addr`` (or fails); records the argv."""

    def __init__(self, addr: str | None) -> None:
        self.addr = addr
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(list(argv))
        if self.addr is None:
            raise slurm.SlurmError("scontrol show node failed (exit 1): Node node1 not found")
        return f"NodeName={argv[-1]} Arch=x86_64 CoresPerSocket=1\n   NodeAddr={self.addr} NodeHostName={argv[-1]}\n"


def task_env(nodelist: str, num_nodes: int) -> dict[str, str]:
    return {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(num_nodes), "SLURM_JOB_ID": "7"}


def unresolvable_name() -> str:
    name = "slurm-jit-no-such-node.invalid"  # RFC 2606: .invalid never resolves
    with pytest.raises(OSError):
        socket.getaddrinfo(name, None)
    return name


def test_master_addr_of_an_unresolvable_node_is_its_nodeaddr_from_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    name = unresolvable_name()
    runner = NodeAddrRunner("10.213.47.1")
    monkeypatch.setattr(slurm, "runner", runner)
    env = task_env(f"{name},other", 2)

    assert dist_env.from_slurm(env)

    assert env["MASTER_ADDR"] == "10.213.47.1"
    assert runner.calls == [["scontrol", "show", "node", name]]


def test_master_addr_of_a_loopback_name_in_a_multi_node_job_is_asked_of_slurm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``localhost`` on rank 0's node would be each rank's own loopback elsewhere."""
    runner = NodeAddrRunner("10.213.47.1")
    monkeypatch.setattr(slurm, "runner", runner)
    assert dist_env.master_addr(task_env("localhost,node2", 2)) == "10.213.47.1"
    assert dist_env.master_addr(task_env("localhost", 1)) in {"127.0.0.1", "::1"}  # one node: loopback is right
    assert dist_env.master_addr(task_env("192.0.2.7,node2", 2)) == "192.0.2.7"  # an address stays
    assert len(runner.calls) == 1


def test_master_addr_falls_back_to_the_name_when_slurm_cannot_say(monkeypatch: pytest.MonkeyPatch) -> None:
    name = unresolvable_name()
    monkeypatch.setattr(slurm, "runner", NodeAddrRunner(None))
    assert dist_env.master_addr(task_env(f"{name}[3-4]", 2)) == f"{name}3"


# --- the real two-node cluster ---------------------------------------------------------------------------




def wait_job(job_id: str, done: set[str], timeout_s: float, log: Path) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = slurm.show_job(job_id)
        if job["JobState"] in done:
            return job
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no job log)"
            raise AssertionError(f"job {job_id} still {job['JobState']} (Reason={job.get('Reason')}) after "
                                 f"{timeout_s:.0f} s:\n{tail}")
        time.sleep(POLL_S)


def submit(script: Path, body: str, jobs: list[str]) -> tuple[str, Path]:
    """sbatch a job of one task on each of the two nodes; returns its id and its log."""
    script.write_text(f"#!/bin/bash\nexport PATH={Path(sys.executable).parent}:$PATH\n{body}")
    job_id = slurm.submit(script, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10",
                                   f"--output={script.parent}/{script.stem}-%j.out"])
    jobs.append(job_id)
    return job_id, script.parent / f"{script.stem}-{job_id}.out"


# Each task: its node, its rank, MASTER_ADDR from dist_env, the IPv4 addresses its network namespace has, and a
# gloo all-reduce of rank + 1 with the other node (3.0 when both ranks took part).
TASK_PROBE = """\
import datetime, json, os, subprocess
from slurm_jit.train import dist_env
dist_env.from_slurm()
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # unreachable peers: fail, not hang
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
dist.destroy_process_group()
addrs = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
print("PROBE " + json.dumps({"node": os.environ["SLURMD_NODENAME"], "rank": int(os.environ["RANK"]),
      "master_addr": os.environ["MASTER_ADDR"], "sum": total.item(),
      "addrs": sorted(line.split()[3].split("/")[0] for line in addrs.splitlines())}), flush=True)
"""


@pytest.mark.slurm
@pytest.mark.timeout(START_TIMEOUT_S + 60)
def test_two_nodes_have_own_names_and_addresses_and_their_ranks_all_reduce_over_them(
    tmp_path: Path, two_node_jobs: list[str]
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(TASK_PROBE)
    job_id, log = submit(tmp_path / "probe.sh", f"srun python {probe}\n", two_node_jobs)

    job = wait_job(job_id, FINISHED, START_TIMEOUT_S, log)

    text = log.read_text(errors="replace")
    assert job["JobState"] == "COMPLETED", text[-3000:]
    tasks = sorted((json.loads(line.removeprefix("PROBE ")) for line in text.splitlines()
                    if line.startswith("PROBE ")), key=lambda task: task["rank"])
    node_addr = {node: slurm.node_address(node) for node in NODES}
    assert [(t["rank"], t["node"]) for t in tasks] == [(0, "node1"), (1, "node2")], text[-3000:]
    assert node_addr["node1"] != node_addr["node2"]
    for task in tasks:
        other = NODES[1 - task["rank"]]
        # Its own node's address is on its interfaces, the other node's is not: two network stacks.
        assert node_addr[task["node"]] in task["addrs"] and node_addr[other] not in task["addrs"], task
        # MASTER_ADDR: the first node of the node list, resolved to the address Slurm reaches it at.
        assert task["master_addr"] == node_addr["node1"], task
        assert task["sum"] == 3.0, task


# The training job: which rank runs where with which MASTER_ADDR (cheap: no torch), then one rank per node.
TRAIN_JOB = """\
srun python -c 'import os; from slurm_jit.train import dist_env; dist_env.from_slurm(); \
print("RANK", os.environ["RANK"], os.environ["SLURMD_NODENAME"], os.environ["MASTER_ADDR"], flush=True)'
srun python -m slurm_jit.demo_train --model gpt2 --zero-stage 2 --output-dir {out} --max-steps {max_steps} \
  --step-sleep {step_sleep} --kill-wait 1 --resume
python -m slurm_jit.train.stop_record {out}
echo "stop_record exit $?"
"""


@pytest.mark.slurm
@pytest.mark.deepspeed
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + STOP_TIMEOUT_S)
def test_deepspeed_jit_stop_across_two_nodes_then_a_second_job_resumes_and_finishes(
    tmp_path: Path, two_node_jobs: list[str]
) -> None:
    out = tmp_path / "out"
    first_id, first_log = submit(tmp_path / "first.sh",
                                 TRAIN_JOB.format(out=out, max_steps=3000, step_sleep=0.03), two_node_jobs)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(losses(out)) < JIT_AFTER_STEPS:
        state = slurm.show_job(first_id)["JobState"]
        assert state in RUNNING and time.monotonic() < deadline, \
            f"{state}: " + (first_log.read_text(errors="replace")[-3000:] if first_log.exists() else "")
        time.sleep(POLL_S)
    slurm.cancel(first_id, signal_name="TERM")  # to every task of the job's steps, as --signal=TERM@N does

    first = wait_job(first_id, FINISHED, STOP_TIMEOUT_S, first_log)

    text = first_log.read_text(errors="replace")
    assert (first["JobState"], first["NodeList"]) == ("COMPLETED", "node[1-2]"), text[-4000:]
    master = slurm.node_address("node1")
    assert {line for line in text.splitlines() if line.startswith("RANK ")} == {
        f"RANK 0 node1 {master}", f"RANK 1 node2 {master}"}, text[-4000:]
    assert "stop_record exit 10" in text, text[-4000:]  # jit_stop: the requeue code
    record = stop_record.read(out)
    assert record is not None and (record["state"], record["job_id"]) == ("jit_stop", first_id), record
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == record["checkpoint"], check.stdout
    assert protocol.inspect(Path(record["checkpoint"]), record["step"], deep=True).kind == "jit"

    stop_step = record["step"]
    second_id, second_log = submit(tmp_path / "second.sh", TRAIN_JOB.format(
        out=out, max_steps=stop_step + RESUMED_EXTRA_STEPS, step_sleep=0), two_node_jobs)
    second = wait_job(second_id, FINISHED, JOB_TIMEOUT_S, second_log)

    text = second_log.read_text(errors="replace")
    assert (second["JobState"], second["NodeList"]) == ("COMPLETED", "node[1-2]"), text[-4000:]
    assert "stop_record exit 0" in text, text[-4000:]  # finished
    done = stop_record.read(out)
    assert done is not None and (done["state"], done["job_id"]) == ("finished", second_id), done
    steps = [step for step, _ in losses(out)]
    # The second job went on from the JIT checkpoint's step: nothing lost, nothing repeated.
    assert steps == list(range(1, stop_step + RESUMED_EXTRA_STEPS + 1)), steps


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if any(text.encode() in arg for arg in argv):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def daemon_lines(status: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in status.stdout.splitlines() if not line.startswith("sinfo:")]


@pytest.mark.slurm
@pytest.mark.timeout(3 * UP_TIMEOUT_S)
def test_two_node_up_again_is_a_no_op_and_down_removes_its_daemons_and_network(two_nodes: Path) -> None:
    """Last in this module: it takes the two-node cluster down and brings it up again."""
    single_before = local_slurm("status", env=CALLER_ENV)
    again = local_slurm("up", "--nodes", "2")
    status = local_slurm("status", "--nodes", "2")
    addrs = [slurm.node_address(node) for node in NODES]

    assert again.returncode == 0 and again.stdout.startswith("local-slurm: already up;"), again.stderr
    assert status.returncode == 0, status.stdout
    assert "slurmd node1: running" in status.stdout and "slurmd node2: running" in status.stdout
    assert f"network: node1 {addrs[0]} ({HOST_VETH}), node2 {addrs[1]} (sjl-node2 in netns {NETNS})" \
        in status.stdout.splitlines()

    down = local_slurm("down", "--nodes", "2")

    assert down.returncode == 0 and down.stdout.startswith("local-slurm: stopped slurmd node1, slurmd node2, "
                                                           "slurmctld, munged, netns "), down.stdout + down.stderr
    assert NETNS not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", HOST_VETH], capture_output=True).returncode != 0
    assert processes_mentioning(str(two_nodes)) == []  # slurmctld and both slurmd ran with -f CONF
    assert local_slurm("status", "--nodes", "2").returncode == 1
    # The single-node cluster is another cluster: the same daemons, answering (or not) as before.
    single_after = local_slurm("status", env=CALLER_ENV)
    assert (single_after.returncode, daemon_lines(single_after)) == \
        (single_before.returncode, daemon_lines(single_before))

    up = local_slurm("up", "--nodes", "2")
    assert up.returncode == 0 and f"created netns {NETNS}" in up.stdout, up.stdout + up.stderr
    assert slurm.available()
