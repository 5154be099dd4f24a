"""Cluster detection (parlay.env): every source, precedence, conflicts, TaskSpec validation."""
from __future__ import annotations

import json

import pytest

from parlay.env import ClusterEnv, TaskSpec, detect, expand_nodelist
from parlay.errors import ConfigError

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


# -- expand_nodelist ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-003]-x", ["gpu-001-x", "gpu-002-x", "gpu-003-x"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("x[3],y[0-1],z", ["x3", "y0", "y1", "z"]),
    ("h.example.com,10.0.0.2", ["h.example.com", "10.0.0.2"]),
])
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, match", [
    ("", "no empty names"), ("a,,b", "no empty names"), ("a,", "no empty names"),
    ("node[1-2", "unexpected '\\['"), ("node[1-[2]]", "unexpected '\\['"),
    ("node1-2]", "unexpected '\\]'"), ("[1-2][", "unexpected"), ("a b", "unexpected ' '"),
    ("node[3-1]", "LO <= HI"), ("node[a-b]", "LO-HI"), ("node[]", "LO-HI"), (" a", "spaces"),
])
def test_expand_nodelist_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        expand_nodelist(text)


def test_nodelist_first_host_is_lazy() -> None:
    env = slurm(SLURM_JOB_NODELIST="n[000000000001-999999999999]")
    assert detect(env).master_addr == "n000000000001"


# -- detect: each source -----------------------------------------------------------------------

def test_single_process() -> None:
    c = detect({})
    assert c == ClusterEnv(0, 1, 0, 1, "127.0.0.1", None, "single")
    assert (c.role, c.is_chief, c.num_ps, c.node_rank, c.num_nodes) == ("worker", True, 0, 0, 1)


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29501")
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "TF_CONFIG", "PARLAY_NUM_PS"):
        monkeypatch.delenv(name, raising=False)
    c = detect()
    assert (c.rank, c.world_size, c.source) == (2, 3, "torchrun")


def test_explicit() -> None:
    c = detect(torchrun(), rank=3, world_size=8, local_rank=1, master_port=1111)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (3, 8, 1, 8)
    assert (c.source, c.master_addr, c.master_port) == ("explicit", "node0", 1111)
    assert detect({}, rank=0, world_size=1).master_port is None
    c = detect({}, rank=1, world_size=2, master_addr="h", master_port=5, local_world_size=1)
    assert (c.master_addr, c.master_port, c.local_world_size, c.num_nodes) == ("h", 5, 1, 2)


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "rank and world_size together"),
    ({"world_size": 2}, "rank and world_size together"),
    ({"local_rank": 0}, "rank and world_size together"),
    ({"rank": 2, "world_size": 2, "master_port": 1}, "rank < world_size"),
    ({"rank": 0, "world_size": 0}, "world_size"),
    ({"rank": True, "world_size": 2, "master_port": 1}, "an int"),
    ({"rank": 0.0, "world_size": 2, "master_port": 1}, "an int"),
    ({"rank": 0, "world_size": 2}, "master_port is missing"),
    ({"rank": 0, "world_size": 2, "master_port": 70000}, "master_port"),
    ({"rank": 0, "world_size": 2, "master_port": 1, "local_rank": 2, "local_world_size": 2},
     "local rank"),
    ({"rank": 0, "world_size": 2, "master_port": 1, "num_ps": 2}, "num_ps"),
    ({"rank": 0, "world_size": 1, "master_addr": "a b"}, "host name"),
])
def test_explicit_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        detect({}, **kwargs)  # type: ignore[arg-type]


def test_torchrun() -> None:
    c = detect(torchrun(rank=3, world=4, local=1, local_world=2, GROUP_RANK="1"))
    assert c == ClusterEnv(3, 4, 1, 2, "node0", 29400, "torchrun", 0, 1, 2)


def test_torchrun_without_local_vars_is_one_process_per_node() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "m", "MASTER_PORT": "1"}
    c = detect(env)
    assert (c.local_rank, c.local_world_size, c.node_rank, c.num_nodes) == (0, 1, 2, 3)
    c = detect({**env, "LOCAL_RANK": "2"})  # a local rank without size: one node
    assert (c.local_rank, c.local_world_size, c.node_rank, c.num_nodes) == (2, 3, 0, 1)


def test_torchrun_world_of_one_needs_no_master() -> None:
    c = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert (c.source, c.master_addr, c.master_port) == ("torchrun", "127.0.0.1", None)


def test_slurm() -> None:
    c = detect(slurm())
    assert c == ClusterEnv(5, 8, 1, 4, "gpu007", 15000 + 4242 % 10001, "slurm", 0, 1, 2)
    assert detect(slurm(MASTER_PORT="2000", MASTER_ADDR="m")).master_port == 2000
    assert detect(slurm(MASTER_ADDR="m")).master_addr == "m"
    assert detect(slurm(SLURM_NODELIST="a[1-2],b", SLURM_JOB_NODELIST="z")).master_addr == "a1"


def test_slurm_port_is_deterministic_and_in_range() -> None:
    ports = {detect(slurm(SLURM_JOB_ID=job)).master_port for job in ("1", "99999", "abc_1")}
    assert all(15000 <= p <= 25000 for p in ports if p is not None) and len(ports) == 3
    no_job = slurm()
    del no_job["SLURM_JOB_ID"]
    assert detect(no_job).master_port == 29500


def test_slurm_minimal_and_without_tasks_per_node() -> None:
    c = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert c == ClusterEnv(0, 1, 0, 1, "127.0.0.1", 29500, "slurm")
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
           "SLURM_NODELIST": "n1"}
    c = detect(env)  # tasks spread evenly: 2 per node
    assert (c.local_world_size, c.node_rank, c.num_nodes) == (2, 1, 2)
    del env["SLURM_NNODES"]
    c = detect(env)
    assert (c.local_world_size, c.node_rank, c.num_nodes) == (4, 0, 1)


def test_salloc_shell_is_not_a_slurm_launch() -> None:
    assert detect({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}).source == "single"


def test_openmpi() -> None:
    c = detect(ompi(rank=3, size=4))
    assert c == ClusterEnv(3, 4, 1, 2, "10.0.0.1", 12345, "openmpi", 0, 1, 2)
    single = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
              "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert detect(single).master_port is None


def test_openmpi_needs_master() -> None:
    env = ompi()
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT missing"):
        detect(env)
    with pytest.raises(ConfigError, match="MASTER_PORT missing"):
        detect({k: v for k, v in ompi().items() if k != "MASTER_PORT"})


def test_tf_config() -> None:
    env = {"TF_CONFIG": tf_config("worker", 1, ps=PS, chief=["w0:3333"], worker=WORKERS)}
    c = detect(env)
    # ranks: ps0 ps1 | chief | w0 w1 w2  ->  worker 1 is rank 4 of 6
    assert (c.rank, c.world_size, c.num_ps, c.source, c.role) == (4, 6, 2, "tf_config", "worker")
    assert (c.master_addr, c.master_port) == ("ps0", 2222)
    # hosts: ps0, ps1, w0 (chief and worker 0), w1, w2 -> node 3 of 5, alone on it
    assert (c.node_rank, c.num_nodes, c.local_rank, c.local_world_size) == (3, 5, 0, 1)
    chief = detect({"TF_CONFIG": tf_config("chief", 0, ps=PS, chief=["w0:3333"], worker=WORKERS)})
    assert (chief.rank, chief.is_chief, chief.local_rank, chief.local_world_size) == (2, True, 0, 2)


def test_tf_config_blank_is_absent() -> None:
    assert detect({"TF_CONFIG": "  "}).source == "single"


def test_tf_config_evaluator_rejected_by_detect() -> None:
    env = {"TF_CONFIG": tf_config("evaluator", 0)}
    with pytest.raises(ConfigError, match="evaluators are not part of the training world"):
        detect(env)
    spec = TaskSpec.from_env(env)
    assert spec.is_evaluator and spec.rank is None and spec.world_size == 5


# -- precedence and conflicts -------------------------------------------------------------------

def test_precedence_when_sources_agree() -> None:
    # every source says rank 2 of 4 (TF: ps | chief | worker 0 = rank 2)
    agree_tf = tf_config("worker", 0, ps=PS[:1], chief=["c:1"], worker=["w:1", "v:1"])
    env = {**ompi(rank=2, size=4), **torchrun(rank=2, world=4, local=0),
           **slurm(rank=2, ntasks=4, SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="2",
                   SLURM_NODEID="1"), "TF_CONFIG": agree_tf}
    assert (detect(env).source, detect(env).num_ps) == ("torchrun", 1)  # TF_CONFIG's ps count
    del env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]
    assert detect(env).source == "slurm"
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    assert detect(env).source == "openmpi"
    env = {k: v for k, v in env.items() if not k.startswith("OMPI_")}
    assert detect(env).source == "tf_config"


@pytest.mark.parametrize("env, names", [
    ({**torchrun(rank=1, world=4), **ompi(rank=0, size=4)}, "RANK/WORLD_SIZE.*OMPI_COMM_WORLD"),
    ({**torchrun(rank=1, world=4), **slurm(rank=1, ntasks=8)}, "RANK/WORLD_SIZE.*SLURM_PROCID"),
    ({**slurm(rank=1, ntasks=8), **ompi(rank=1, size=4)}, "SLURM_PROCID.*OMPI_COMM_WORLD"),
    ({**torchrun(rank=1, world=4), "TF_CONFIG": tf_config("worker", 0)}, "RANK.*TF_CONFIG"),
])
def test_conflicting_sources(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=f"conflicting cluster environment.*{names}"):
        detect(env)


def test_torchelastic_wins_silently() -> None:
    # torchrun inside a SLURM allocation: SLURM counts one task, torchrun spawned four.
    env = {**slurm(rank=0, ntasks=1, SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1",
                   SLURM_NODEID="0", SLURM_NNODES="1"),
           **torchrun(rank=3, world=4, local=3, local_world=4), "TORCHELASTIC_RUN_ID": "abc",
           "OMPI_COMM_WORLD_RANK": "junk", "TF_CONFIG": "{not json"}
    c = detect(env)
    assert (c.source, c.rank, c.world_size) == ("torchrun", 3, 4)


# -- partial and malformed environments ---------------------------------------------------------

@pytest.mark.parametrize("env, match", [
    ({"RANK": "0"}, "WORLD_SIZE is missing"),
    ({"WORLD_SIZE": "2"}, "RANK is missing"),
    ({"LOCAL_RANK": "0"}, "RANK is missing"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is missing"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_LOCALID is missing"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "2"},
     "SLURM_NODELIST is missing"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is missing"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"},
     "OMPI_COMM_WORLD_LOCAL_RANK is missing"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: expected an integer"),
    ({"RANK": "1.0", "WORLD_SIZE": "2"}, "RANK: expected an integer"),
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK: expected an integer"),
    ({"RANK": "9" * 5000, "WORLD_SIZE": "2"}, "RANK: expected an integer"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK: expected an integer >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE: expected an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK < WORLD_SIZE"),
    (torchrun(local=2, local_world=2), "local rank"),
    (torchrun(local_world=8), "local world size"),
    (torchrun(GROUP_RANK="5"), "GROUP_RANK"),
    (torchrun(MASTER_PORT="0"), "MASTER_PORT"),
    (torchrun(MASTER_PORT="65536"), "MASTER_PORT"),
    (torchrun(MASTER_ADDR=""), "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR missing"),
    (slurm(rank=8), "SLURM_PROCID < SLURM_NTASKS"),
    (slurm(SLURM_NODEID="2"), "SLURM_NODEID"),
    (slurm(SLURM_NTASKS_PER_NODE="four"), "SLURM_NTASKS_PER_NODE"),
    (slurm(SLURM_NTASKS_PER_NODE="0"), "SLURM_NTASKS_PER_NODE: expected an integer >= 1"),
    (slurm(SLURM_NTASKS_PER_NODE="1"), "local rank"),
    (slurm(SLURM_JOB_NODELIST="gpu[1-"), "nodelist"),
    (ompi(OMPI_COMM_WORLD_LOCAL_RANK="2"), "local rank"),
    ({"TF_CONFIG": "{"}, "TF_CONFIG: expected a JSON object"),
    ({"TF_CONFIG": "[1]"}, "TF_CONFIG: expected a JSON object"),
    ({"TF_CONFIG": '{"task": {"type": "worker"}}'}, "cluster"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}}'}, "task"),
    ({"TF_CONFIG": '{"cluster": {"worker": "a:1"}, "task": {"type": "worker"}}'}, "a list"),
    ({"TF_CONFIG": '{"cluster": {"master": ["a:1"]}, "task": {"type": "worker"}}'}, "chief"),
    ({"TF_CONFIG": tf_config("worker", 3)}, "TF_CONFIG: index"),
    ({"TF_CONFIG": "[" * 100000}, "TF_CONFIG: expected a JSON object"),
])
def test_bad_environment(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        detect(env)


def test_partial_environment_message_names_what_is_set() -> None:
    with pytest.raises(ConfigError, match="SLURM_NTASKS is missing: expected it because "
                                          "SLURM_PROCID is set"):
        detect({"SLURM_PROCID": "3"})


# -- parameter servers --------------------------------------------------------------------------

def test_parlay_num_ps_roles() -> None:
    roles = []
    for r in range(4):
        c = detect(torchrun(rank=r, world=4, local=r % 2, PARLAY_NUM_PS="1"))
        roles.append((c.role, c.task_index, c.is_chief))
    assert roles == [("ps", 0, False), ("worker", 0, True), ("worker", 1, False),
                     ("worker", 2, False)]
    assert detect(torchrun(), num_ps=2).num_ps == 2


@pytest.mark.parametrize("env, match", [
    (torchrun(PARLAY_NUM_PS="4"), "PARLAY_NUM_PS"),
    (torchrun(PARLAY_NUM_PS="-1"), "PARLAY_NUM_PS"),
    (torchrun(PARLAY_NUM_PS="one"), "PARLAY_NUM_PS"),
    ({"PARLAY_NUM_PS": "1"}, "at least one worker"),
    ({"TF_CONFIG": tf_config(), "PARLAY_NUM_PS": "1"}, "ps count 2"),
])
def test_bad_num_ps(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        detect(env)


# -- TaskSpec ----------------------------------------------------------------------------------

def test_taskspec_ranks_ps_first_then_chief_then_workers() -> None:
    kw = dict(ps_hosts=PS, chief_hosts=["c:1"], worker_hosts=WORKERS)
    got = [(t, i, TaskSpec(t, i, **kw).rank) for t, n in (("ps", 2), ("chief", 1),
                                                         ("worker", 3)) for i in range(n)]
    assert [r for _, _, r in got] == list(range(6))
    spec = TaskSpec("worker", 0, **kw)
    assert (spec.world_size, spec.num_ps, spec.num_workers, spec.is_chief) == (6, 2, 4, False)
    assert spec.cluster_hosts == (*PS, "c:1", *WORKERS)
    assert TaskSpec("chief", 0, **kw).is_chief and TaskSpec("chief", 0, **kw).is_worker
    assert spec.ps_hosts == tuple(PS) and isinstance(spec.worker_hosts, tuple)


def test_taskspec_without_chief() -> None:
    w0 = TaskSpec("worker", 0, ps_hosts=PS, worker_hosts=WORKERS)
    assert (w0.rank, w0.is_chief, w0.is_worker, w0.is_ps) == (2, True, True, False)
    assert not TaskSpec("worker", 1, ps_hosts=PS, worker_hosts=WORKERS).is_chief
    ps1 = TaskSpec("ps", 1, ps_hosts=PS, worker_hosts=WORKERS)
    assert (ps1.rank, ps1.is_ps, ps1.is_worker, ps1.is_chief) == (1, True, False, False)
    assert (ps1.master_addr, ps1.master_port) == ("ps0", 2222)
    no_ps = TaskSpec("worker", 2, worker_hosts=WORKERS)
    assert (no_ps.rank, no_ps.world_size, no_ps.master_addr) == (2, 3, "w0")
    chief_only = TaskSpec("chief", 0, chief_hosts=["[::1]:7"])
    assert (chief_only.rank, chief_only.master_addr, chief_only.master_port) == (0, "::1", 7)


def test_taskspec_evaluator() -> None:
    ev = TaskSpec("evaluator", 0, worker_hosts=WORKERS)
    assert (ev.rank, ev.world_size, ev.is_chief, ev.is_worker) == (None, 3, False, False)
    ev = TaskSpec("evaluator", 1, worker_hosts=WORKERS, evaluator_hosts=["e0:1", "e1:1"])
    assert ev.rank is None and ev.world_size == 3


def test_taskspec_is_hashable_and_frozen() -> None:
    a = TaskSpec("worker", 0, worker_hosts=["a:1"])
    assert a == TaskSpec("worker", 0, worker_hosts=("a:1",)) and hash(a) == hash(
        TaskSpec("worker", 0, worker_hosts=("a:1",)))
    with pytest.raises(AttributeError):
        a.index = 1  # type: ignore[misc]


@pytest.mark.parametrize("host", ["[::1]:2222", "[fe80::1%eth0]:1", "10.0.0.1:65535",
                                  "host-a.example.org:1"])
def test_taskspec_accepts_addresses(host: str) -> None:
    assert TaskSpec("worker", 0, worker_hosts=[host]).worker_hosts == (host,)


@pytest.mark.parametrize("kwargs, match", [
    (dict(task_type="trainer"), "task_type: expected one of ps, chief, worker, evaluator"),
    (dict(task_type="master"), "'master' is called 'chief'"),
    (dict(task_type=None), "task_type"),
    (dict(index=-1), "index: expected 0 <= index < len\\(worker_hosts\\)"),
    (dict(index=3), "index: expected 0 <= index < len\\(worker_hosts\\) \\(3\\), got 3"),
    (dict(task_type="ps", index=2), "len\\(ps_hosts\\)"),
    (dict(task_type="chief", index=0), "len\\(chief_hosts\\) \\(0\\)"),
    (dict(task_type="evaluator", index=1), "len\\(evaluator_hosts\\)"),
    (dict(index=True), "index: expected an int, got bool"),
    (dict(index=1.0), "index: expected an int, got float"),
    (dict(index="1"), "index: expected an int, got str"),
    (dict(worker_hosts=["w0"]), "add the port"),
    (dict(worker_hosts=[":2222"]), "host name"),
    (dict(worker_hosts=["w0:"]), "port number"),
    (dict(worker_hosts=["w0:http"]), "port number"),
    (dict(worker_hosts=["w0:22.5"]), "port number"),
    (dict(worker_hosts=["w0:0"]), "1..65535"),
    (dict(worker_hosts=["w0:65536"]), "1..65535"),
    (dict(worker_hosts=["w0:-1"]), "port number"),
    (dict(worker_hosts=["::1:2222"]), "IPv6 addresses in brackets"),
    (dict(worker_hosts=["[::1]2222"]), "'\\[ipv6\\]:port'"),
    (dict(worker_hosts=["[]:1"]), "host name"),
    (dict(worker_hosts=["a b:1"]), "host name"),
    (dict(worker_hosts=[2222]), "worker_hosts\\[0\\]: expected a 'host:port' string, got int"),
    (dict(worker_hosts=[None]), "got NoneType"),
    (dict(worker_hosts="w0:1"), "wrap a single address in a list"),
    (dict(worker_hosts=None), "worker_hosts: expected a list"),
    (dict(worker_hosts=["w0:1", "w0:1"]), "worker_hosts\\[1\\].*already worker_hosts\\[0\\]"),
    (dict(worker_hosts=["W0:1"], ps_hosts=["w0:1"]), "already ps_hosts\\[0\\]"),
    (dict(worker_hosts=["w0:1"], chief_hosts=["w0:1"]), "already chief_hosts"),
    (dict(worker_hosts=["w0:1"], evaluator_hosts=["w0:1"]), "already worker_hosts"),
    (dict(worker_hosts=[], ps_hosts=["p:1"]), "at least one worker"),
    (dict(worker_hosts=[], task_type="ps", ps_hosts=["p:1"]), "at least one worker"),
    (dict(chief_hosts=["c:1", "d:1"]), "at most one chief"),
])
def test_taskspec_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(task_type="worker", index=0, worker_hosts=WORKERS)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        TaskSpec(**args)  # type: ignore[arg-type]


def test_errors_say_expected_got_and_hint() -> None:
    with pytest.raises(ConfigError) as info:
        TaskSpec("worker", 5, worker_hosts=WORKERS)
    text = str(info.value)
    assert "expected" in text and "got 5" in text and "Hint:" in text


# -- TaskSpec.from_env -------------------------------------------------------------------------

def test_from_env_tf_config() -> None:
    spec = TaskSpec.from_env({"TF_CONFIG": tf_config("ps", 1)})
    assert spec == TaskSpec("ps", 1, ps_hosts=PS, worker_hosts=WORKERS)
    assert spec.rank == 1
    default_index = json.dumps({"cluster": {"worker": WORKERS}, "task": {"type": "worker"}})
    assert TaskSpec.from_env({"TF_CONFIG": default_index}).index == 0


def test_from_env_tf_config_checked_against_launcher() -> None:
    env = {**torchrun(rank=1, world=5), "TF_CONFIG": tf_config("ps", 1)}
    assert TaskSpec.from_env(env).rank == 1
    env["TORCHELASTIC_RUN_ID"] = "x"
    env["RANK"] = "2"
    with pytest.raises(ConfigError, match="TF_CONFIG: expected the rank the launcher gives"):
        TaskSpec.from_env(env)


def test_from_env_launcher_with_ps() -> None:
    specs = [TaskSpec.from_env({"RANK": str(r), "WORLD_SIZE": "4", "PARLAY_NUM_PS": "1",
                                "MASTER_ADDR": "m", "MASTER_PORT": "5000"}) for r in range(4)]
    assert [(s.task_type, s.index, s.rank) for s in specs] == [
        ("ps", 0, 0), ("worker", 0, 1), ("worker", 1, 2), ("worker", 2, 3)]
    assert specs[0].ps_hosts == ("m:5000",)
    assert specs[0].worker_hosts == ("m:5001", "m:5002", "m:5003")
    assert [s.is_chief for s in specs] == [False, True, False, False]
    assert all(s.world_size == 4 and s.master_addr == "m" for s in specs)


def test_from_env_synthesized_ports_wrap_and_ipv6() -> None:
    spec = TaskSpec.from_env({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "::1",
                              "MASTER_PORT": "65535"})
    assert spec.worker_hosts == ("[::1]:65535", "[::1]:1024", "[::1]:1025")


def test_from_env_empty_and_other_launchers() -> None:
    spec = TaskSpec.from_env({})
    assert spec == TaskSpec("worker", 0, worker_hosts=["localhost:29500"])
    assert TaskSpec.from_env(slurm()).rank == 5
    assert TaskSpec.from_env(ompi(rank=3)).rank == 3


def test_from_env_errors() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE is missing"):
        TaskSpec.from_env({"RANK": "0"})
    with pytest.raises(ConfigError, match="distinct ports"):
        TaskSpec.from_env({"RANK": "0", "WORLD_SIZE": str(10**9), "MASTER_ADDR": "m",
                           "MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="TF_CONFIG: task_type"):
        TaskSpec.from_env({"TF_CONFIG": tf_config("boss", 0)})


# -- ClusterEnv --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=4), "rank"), (dict(world_size=0), "world_size"), (dict(local_rank=2), "local"),
    (dict(num_ps=4), "num_ps"), (dict(node_rank=1), "node_rank"),
    (dict(master_port=0), "master_port"), (dict(master_port=True), "master_port"),
    (dict(master_addr=5), "master_addr"), (dict(rank=1.5), "an int"),
])
def test_cluster_env_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(rank=0, world_size=4, local_rank=0, local_world_size=2,
                                   master_addr="m", master_port=1, source="test")
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        ClusterEnv(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("module", ["parlay.env", "parlay.taskspec", "parlay._validate"])
def test_env_modules_are_pure(module: str) -> None:
    import importlib

    source = open(importlib.import_module(module).__file__, encoding="utf-8").read()
    # Module level: parsing needs neither torch nor the runtime. Only TaskSpec.device_fn, which
    # answers with a torch.device chosen the runtime's way, imports them when it is called.
    imports = [line for line in source.splitlines() if line.startswith(("import", "from"))]
    assert not [line for line in imports if "torch" in line]
    allowed = ("from parlay.errors ", "from parlay._validate ", "from parlay.env ")
    assert all(line.startswith(allowed) for line in imports if "parlay" in line)
    lazy = [line.strip() for line in source.splitlines()
            if line.startswith(" ") and line.strip().startswith(("import ", "from "))]
    assert set(lazy) <= {"import torch", "from parlay import runtime"}, lazy
