"""parlay.discovery: TF_CONFIG's ps count under torchrun, MPICH / Intel MPI (PMI) launches and
MASTER_ADDR values that hold a port."""
from __future__ import annotations

import pytest

from parlay.env import TaskSpec, detect
from parlay.errors import ConfigError
from tests._envcases import slurm, tf_config, torchrun

pytestmark = pytest.mark.timeout(120)

HOSTS = ["127.0.0.1:23001", "127.0.0.1:23002", "127.0.0.1:23003"]


def _under_torchrun(rank: int, **extra: str) -> dict[str, str]:
    task = ("ps", 0) if rank == 0 else ("worker", rank - 1)
    return {**torchrun(rank=rank, world=3, local=rank, local_world=3),
            "TORCHELASTIC_RUN_ID": "job", "TF_CONFIG": tf_config(*task, ps=HOSTS[:1],
                                                                  worker=HOSTS[1:]), **extra}


def test_tf_config_ps_count_holds_under_torchrun() -> None:
    for rank in range(3):
        env = _under_torchrun(rank)
        c, spec = detect(env), TaskSpec.from_env(env)
        assert (c.source, c.rank, c.num_ps, c.role) == ("torchrun", rank, 1,
                                                        "ps" if rank == 0 else "worker")
        assert (spec.rank, spec.num_ps, bool(spec.is_ps)) == (rank, 1, rank == 0)
    # TensorLayer's variables are read as TF_CONFIG
    tl = {**torchrun(rank=0, world=3, local=0, local_world=3), "TORCHELASTIC_RUN_ID": "job",
          "JOB_NAME": "ps", "TASK_INDEX": "0", "PS_HOSTS": HOSTS[0],
          "WORKER_HOSTS": ",".join(HOSTS[1:])}
    assert (detect(tl).num_ps, detect(tl).role, bool(TaskSpec.from_env(tl).is_ps)) == (
        1, "ps", True)
    # `parlay run -n 3` without --ps exports PARLAY_NUM_PS=0: refused, not a third replica
    with pytest.raises(ConfigError, match="ps count 1, got 0.*parlay run --ps 1"):
        detect(_under_torchrun(0, PARLAY_NUM_PS="0"))
    assert detect(_under_torchrun(0, PARLAY_NUM_PS="1")).role == "ps"


def test_tf_config_under_torchrun_must_agree_on_the_rank() -> None:
    env = _under_torchrun(1, RANK="2")  # TF_CONFIG says rank 1, torchrun rank 2, both of 3
    with pytest.raises(ConfigError, match="conflicting cluster environment.*TF_CONFIG"):
        detect(env)
    # A TF_CONFIG of another world (one task per pod, torchrun spawning more) is not read.
    other = _under_torchrun(0, WORLD_SIZE="6", LOCAL_WORLD_SIZE="6")
    assert (detect(other).num_ps, detect(other).world_size) == (0, 6)


PMI = {"PMI_RANK": "3", "PMI_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"}


def test_pmi_launch_is_read() -> None:
    c = detect({**PMI, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size) == (
        "pmi", 3, 4, 1, 2)
    assert (c.node_rank, c.num_nodes, c.master_addr, c.master_port) == (1, 2, "10.0.0.1", 12345)
    alone = detect(PMI)  # without MPI's local variables each rank is alone on its node
    assert (alone.local_rank, alone.local_world_size, alone.num_nodes) == (0, 1, 4)
    spec = TaskSpec.from_env({**PMI, "PARLAY_NUM_PS": "1"})
    assert (spec.task_type, spec.index, spec.rank, spec.world_size) == ("worker", 2, 3, 4)
    assert detect({"PMI_RANK": "0", "PMI_SIZE": "1"}).world_size == 1


@pytest.mark.parametrize("env, match", [
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT missing.*PMI"),
    ({"PMI_RANK": "1"}, "PMI_SIZE is missing"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "PMI_RANK: expected 0 <= PMI_RANK < PMI_SIZE"),
    ({**PMI, "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, "MPI.*local rank"),
    ({**PMI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
     "conflicting.*OMPI_COMM_WORLD_RANK.*PMI_RANK"),
])
def test_pmi_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        detect(env)


def test_pmi_beside_slurm() -> None:
    # srun's PMI plugin sets PMI_RANK/PMI_SIZE beside SLURM's variables: SLURM wins, no master.
    env = {**slurm(rank=5, ntasks=8), "PMI_RANK": "5", "PMI_SIZE": "8"}
    assert (detect(env).source, detect(env).rank, detect(env).master_addr) == (
        "slurm", 5, "gpu007")
    # mpiexec started by srun on each node: SLURM counts nodes, PMI the ranks.
    with pytest.raises(ConfigError, match="conflicting.*SLURM_PROCID.*PMI_RANK"):
        detect({**slurm(rank=1, ntasks=2, SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1"),
                "PMI_RANK": "5", "PMI_SIZE": "8"})


@pytest.mark.parametrize("addr", ["127.0.0.1:51031", "node0:29500", "a:b"])
def test_master_addr_with_a_port_is_refused(addr: str) -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR: expected a host without a port.*"
                                          "Hint: put the port in MASTER_PORT$"):
        detect(torchrun(MASTER_ADDR=addr))
    with pytest.raises(ConfigError, match="put the port in master_port"):
        detect({}, rank=0, world_size=2, master_addr=addr, master_port=29500)


@pytest.mark.parametrize("addr, host", [("::1", "::1"), ("[::1]", "::1"),
                                        ("fe80::1%eth0", "fe80::1%eth0"),
                                        ("[2001:db8::7]", "2001:db8::7"), ("node0", "node0")])
def test_master_addr_ipv6_is_accepted(addr: str, host: str) -> None:
    assert detect(torchrun(MASTER_ADDR=addr)).master_addr == host
