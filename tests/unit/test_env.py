"""Cluster detection (parlay.env): every source, precedence, conflicts. TaskSpec and
``from_env`` are in test_taskspec.py."""
from __future__ import annotations

import pytest

from parlay.env import ClusterEnv, TaskSpec, create_task_spec_def, detect, expand_nodelist
from parlay.errors import ConfigError
from parlay.testing import run_world
from tests._envcases import PS, WORKERS, ompi, slurm, tf_config, torchrun

pytestmark = pytest.mark.timeout(120)


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


def test_slurm_uneven_tasks_per_node_are_read_per_node() -> None:
    # 3 tasks on 2 nodes (2 + 1): the even-spread guess gave the second node 2
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
           "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_NODELIST": "n[1-2]"}
    assert (detect(env).local_rank, detect(env).local_world_size) == (0, 1)
    env.update(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0")
    assert detect(env).local_world_size == 2
    env.update(SLURM_NTASKS="7", SLURM_NNODES="3", SLURM_STEP_TASKS_PER_NODE="3(x2),1")
    assert detect(env).local_world_size == 3  # the step's own list wins over the job's


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


NO_CLUSTER = ['{}', '{"cluster": null}', '{"cluster": {}, "task": {}}',
              '{"task": {"type": "worker", "index": "0"}}']


@pytest.mark.parametrize("cfg", NO_CLUSTER)
def test_tf_config_without_cluster_is_unset(cfg: str) -> None:
    # TensorFlow's local mode (TensorLayer: one local task): the other sources, else one process
    local = TaskSpec.from_env({})
    assert detect({"TF_CONFIG": cfg}).source == "single"
    assert TaskSpec.from_env({"TF_CONFIG": cfg}) == create_task_spec_def({"TF_CONFIG": cfg}) \
        == TaskSpec.from_tf_config(cfg) == local
    env = {**torchrun(rank=1, world=4), "TF_CONFIG": cfg}
    assert (detect(env).source, TaskSpec.from_env(env).rank) == ("torchrun", 1)


@pytest.mark.parametrize("cfg", ['{"task": {"type": "ps", "index": 0}}',
                                 '{"cluster": {}, "task": {"type": "worker", "index": 1}}',
                                 '{"task": "worker"}'])
def test_tf_config_without_cluster_but_another_task_is_refused(cfg: str) -> None:
    with pytest.raises(ConfigError, match="TF_CONFIG\\['task'\\]: expected no task or worker 0 "
                                          "without a 'cluster'.*Hint: add the cluster"):
        detect({"TF_CONFIG": cfg})


def _rank_and_size() -> tuple[int, int]:
    import parlay

    return parlay.rank(), parlay.size()


def test_tf_config_without_cluster_lets_init_run() -> None:
    assert run_world(_rank_and_size, 2, env={"TF_CONFIG": '{"cluster": {}, "task": {}}'}) == [
        (0, 2), (1, 2)]


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



def test_torchrun_variables_exported_beside_a_launcher_take_its_node_layout() -> None:
    # sbatch: `export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=... MASTER_PORT=...`
    # then `srun python train.py`: task 5 of 8 is local task 1 of 4 on node 1 of 2, not 0 of 1.
    env = {**slurm(), "RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu007",
           "MASTER_PORT": "29500"}
    c = detect(env)
    assert (c.source, c.local_rank, c.local_world_size, c.node_rank, c.num_nodes) == (
        "torchrun", 1, 4, 1, 2)
    assert TaskSpec.from_env(env).local_rank == 1
    assert detect({**env, "LOCAL_RANK": "1", "GROUP_WORLD_SIZE": "2"}) == c
    assert detect({**ompi(rank=3, size=4), "RANK": "3", "WORLD_SIZE": "4"}).local_rank == 1
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE to agree with slurm's "
                       "local_world_size 4, got 2.*Hint: unset LOCAL_WORLD_SIZE"):
        detect({**env, "LOCAL_WORLD_SIZE": "2"})

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
    ({"TF_CONFIG": '{"task": {"type": "ps"}}'}, "cluster"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}}'}, "task"),
    ({"TF_CONFIG": '{"cluster": {"worker": "a:1"}, "task": {"type": "worker"}}'}, "a list"),
    ({"TF_CONFIG": '{"cluster": {"master": ["a:1"], "chief": ["b:1"]}, "task": {"type": '
                   '"chief"}}'}, "'master' \\(TF1\\) or 'chief'"),
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


@pytest.mark.parametrize("env, expected", [
    ({}, None), ({"TORCHELASTIC_RUN_ID": "none"}, None),
    ({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7"}, "abc"), ({"SLURM_JOB_ID": "7"}, "7"),
    ({"PARLAY_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "abc"}, "mine"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"}, "7"),
])
def test_run_id_is_read_in_one_place(env: dict[str, str], expected: str | None) -> None:
    from parlay.env import run_id
    from parlay.runtime import store_prefix

    assert run_id(env) == expected
    assert store_prefix(env, 0) == (f"parlay/{expected}/attempt0/init0" if expected
                                    else "parlay/attempt0/init0")
