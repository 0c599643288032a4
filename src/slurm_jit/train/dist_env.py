"""torch.distributed environment variables from Slurm's, for one ``srun`` task per rank.

torchrun and the ``deepspeed`` launcher SIGKILL their workers 30 s after forwarding SIGTERM (pytorch#119856), which
can cut a JIT checkpoint short; this project starts one srun task per rank instead, and each task derives
RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the SLURM_* variables, whether
it starts through ``python -m slurm_jit.launch.task`` or as ``srun python train.py`` (one place, so both agree).

LOCAL_WORLD_SIZE matters on CPU: without it accelerate takes each rank for the only one on its node and gives it
every core's threads, so the sums (and the losses' last bits) differ from a local run's.

MASTER_ADDR is the address of the first node of the step, where rank 0 runs (block distribution, Slurm's default)
and listens: its name resolved here, or, when the name does not resolve or resolves to loopback in a job that
spans several nodes (a rank elsewhere would reach its own loopback), the ``NodeAddr`` Slurm reaches it at.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping, MutableMapping

from slurm_jit import slurm

log = logging.getLogger(__name__)

MASTER_PORT_BASE = 20000  # an unprivileged range; offset by the job id so that jobs sharing a node differ
MASTER_PORT_SPAN = 20000


def node_name(env: Mapping[str, str] = os.environ) -> str:
    """This rank's node as Slurm names it (``SLURMD_NODENAME``: what ``ExcNodeList`` takes), else the host name
    (outside Slurm; on several nodes of one host, as the local cluster's, they are all one name)."""
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[3-5,7]`` -> ``node3``, ``a,b`` -> ``a``."""
    match = re.match(r"^([^,\[]+)(?:\[(\d+))?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}")
    return match.group(1) + (match.group(2) or "")


def local_world_size(env: Mapping[str, str]) -> int | None:
    """Ranks on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3)``, ``3,2``) and ``SLURM_NODEID``."""
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")).split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return counts[node] if node < len(counts) else None


def from_slurm(env: MutableMapping[str, str] | None = None) -> bool:
    """Fill the torch.distributed variables from Slurm's when running as an srun task; True if it did."""
    env = os.environ if env is None else env
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", env.get("SLURM_STEP_NUM_TASKS", "1"))
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    local = local_world_size(env)
    if local is not None:
        env.setdefault("LOCAL_WORLD_SIZE", str(local))
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = master_addr(env)
    job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
    env.setdefault("MASTER_PORT", str(MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN))
    return True


def _resolve(host: str) -> str | None:
    """The first address ``host`` resolves to here, or None."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def master_addr(env: Mapping[str, str]) -> str:
    """The address of the step's first node (see the module docstring), as every rank can reach it."""
    nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    host = first_host(nodelist)
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass  # a name
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_JOB_NUM_NODES", "1")) or 1)
    addr = _resolve(host)
    if addr is not None and (num_nodes == 1 or not ipaddress.ip_address(addr.split("%")[0]).is_loopback):
        return addr
    try:
        return slurm.node_address(host)
    except slurm.SlurmError as exc:
        log.warning("MASTER_ADDR: %s resolves to %s and Slurm did not say its address (%s); using the name",
                    host, addr or "nothing", exc)
        return host
