"""torch.distributed environment variables from Slurm's, for one ``srun`` task per rank.

torchrun and the ``deepspeed`` launcher SIGKILL their workers 30 s after forwarding SIGTERM (pytorch#119856), which
can cut a JIT checkpoint short; this project starts one srun task per rank instead, and each task derives
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the SLURM_* variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

MASTER_PORT_BASE = 20000  # an unprivileged range; offset by the job id so that jobs sharing a node differ
MASTER_PORT_SPAN = 20000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[3-5,7]`` -> ``node3``, ``a,b`` -> ``a``."""
    match = re.match(r"^([^,\[]+)(?:\[(\d+))?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}")
    return match.group(1) + (match.group(2) or "")


def from_slurm(env: MutableMapping[str, str] | None = None) -> bool:
    """Fill the torch.distributed variables from Slurm's when running as an srun task; True if it did."""
    env = os.environ if env is None else env
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", env.get("SLURM_STEP_NUM_TASKS", "1"))
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
    env.setdefault("MASTER_PORT", str(MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN))
    return True
