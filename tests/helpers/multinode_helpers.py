"""The two-node local cluster (``tools/local-slurm up --nodes 2``) for tests: its settings and its command.

A second instance beside the single-node one; the fixtures ``two_nodes`` and ``two_node_jobs`` (conftest) use it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LOCAL_SLURM = Path(__file__).resolve().parents[2] / "tools" / "local-slurm"
UP_TIMEOUT_S = 300  # a fresh CI machine may apt-install first; then up waits <= 60 s for the nodes
USE_LINE = "local-slurm: use it with: export SLURM_CONF="
# Settings of one instance, which the two-node one must not inherit from the caller's environment.
INSTANCE_VARS = ("SLURM_CONF", "SLURM_JIT_LOCAL_STATE")
CALLER_ENV = dict(os.environ)  # as the session started, before the module points SLURM_CONF at two nodes
TWO_NODE_ENV = {k: v for k, v in CALLER_ENV.items() if k not in INSTANCE_VARS}


def local_slurm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """tools/local-slurm ARGS, by default with the two-node cluster's own settings."""
    return subprocess.run([str(LOCAL_SLURM), *args], capture_output=True, text=True, timeout=UP_TIMEOUT_S,
                          check=False, env=TWO_NODE_ENV if env is None else env)
