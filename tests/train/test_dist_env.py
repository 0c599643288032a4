"""The distributed environment mapped from Slurm's (train/dist_env.py).
"""

from __future__ import annotations

from slurm_jit.train import dist_env


def test_dist_env_from_slurm() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "node[3-5,7]", "SLURM_JOB_ID": "1234"}
    assert dist_env.from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "2", "1", "node3")
    assert env["MASTER_PORT"] == str(dist_env.MASTER_PORT_BASE + 1234)
    assert not dist_env.from_slurm({"RANK": "0", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert not dist_env.from_slurm({"SLURM_PROCID": "0"})  # the batch shell, not an srun task
    assert dist_env.first_host("a,b") == "a"


def test_a_ranks_node_is_slurms_name_for_it_and_the_host_name_outside_slurm():
    import socket

    assert dist_env.node_name({"SLURMD_NODENAME": "node2"}) == "node2"  # what ExcNodeList takes
    assert dist_env.node_name({}) == socket.gethostname()
