"""Launcher environments and cluster specs shared by the environment-parsing tests."""
from __future__ import annotations

import json

PS = ["ps0:2222", "ps1:2222"]
WORKERS = ["w0:2222", "w1:2222", "w2:2222"]


def torchrun(rank: int = 1, world: int = 4, local: int = 1, local_world: int = 2,
             **extra: str) -> dict[str, str]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
           "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
    env.update(extra)
    return env


def slurm(rank: int = 5, ntasks: int = 8, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "4242"}
    env.update(extra)
    return env


def ompi(rank: int = 2, size: int = 4, **extra: str) -> dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"}
    env.update(extra)
    return env


def tf_config(task_type: str = "worker", index: int = 1, **cluster: list[str]) -> str:
    cluster = cluster or {"ps": PS, "worker": WORKERS}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
