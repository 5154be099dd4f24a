"""TaskSpec (parlay.taskspec): rank layout, validation, ``from_env`` on every launcher, and the
purity of the environment modules."""
from __future__ import annotations

import json

import pytest

from parlay.env import ClusterEnv, TaskSpec, detect
from parlay.errors import ConfigError
from parlay.testing import run_world
from tests._envcases import PS, WORKERS, ompi, slurm, tf_config, torchrun

pytestmark = pytest.mark.timeout(120)


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
    (dict(task_type="master"), "master's host:port with task_type='master'"),
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
    (dict(worker_hosts="w0:1,x"), "worker_hosts\\[1\\]: expected 'host:port'"),
    (dict(worker_hosts=5), "worker_hosts: expected a list"),
    (dict(worker_hosts=None), "at least one worker"),
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
    as_text = json.dumps({"cluster": {"worker": WORKERS}, "task": {"type": "worker",
                                                                   "index": "1"}})
    assert TaskSpec.from_env({"TF_CONFIG": as_text}).index == 1  # TensorFlow's int(index)


def test_from_env_tf_config_checked_against_launcher() -> None:
    env = {**torchrun(rank=1, world=5), "TF_CONFIG": tf_config("ps", 1)}
    assert TaskSpec.from_env(env).rank == 1
    env["TORCHELASTIC_RUN_ID"] = "x"
    env["RANK"] = "2"  # torchrun's world: detect() reads TF_CONFIG too (its ps count holds)
    with pytest.raises(ConfigError, match="torchrun .* and tf_config .* to agree"):
        TaskSpec.from_env(env)
    env["WORLD_SIZE"] = "4"  # another world: detect() does not read it, from_env() refuses it
    assert detect(env).num_ps == 0
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


# -- device_fn before init: the device the runtime will use ------------------------------------

SLURM_2X2 = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
             "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77",
             "SLURM_TASKS_PER_NODE": "2(x2)"}
ONE_HOST_PS = [torchrun(rank=r, world=3, local=r, local_world=3, PARLAY_NUM_PS="1")
               for r in range(3)]  # parlay run -n 3 --ps 1 on one host


@pytest.mark.parametrize("env, gpus, want", [
    (SLURM_2X2, 4, "cuda:0"),  # rank 2 = node 1, local rank 0
    (torchrun(rank=2, world=4, local=0, local_world=2, GROUP_RANK="1",
              TORCHELASTIC_RUN_ID="j"), 4, "cuda:0"),
    (ompi(rank=3), 4, "cuda:1"),
    (ONE_HOST_PS[0], 2, "cpu"), (ONE_HOST_PS[1], 2, "cuda:1"), (ONE_HOST_PS[2], 2, "cuda:0"),
    ({"TF_CONFIG": tf_config("worker", 0, ps=["h:1"], worker=["h:2", "h:3"])}, 2, "cuda:1"),
])
def test_device_fn_before_init_is_the_runtime_s(monkeypatch: pytest.MonkeyPatch,
                                                 env: dict[str, str], gpus: int,
                                                 want: str) -> None:
    import torch
    import torch.distributed as dist

    from parlay import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a host with `gpus` GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    spec, found = TaskSpec.from_env(env), detect(env)
    # what init() picks for this rank (parameter servers compute on the CPU)
    rule = runtime.resolve_backend("auto", found.local_rank)[1]
    assert spec.device_fn() == torch.device(want) == (torch.device("cpu") if spec.is_ps
                                                       else rule)
    assert spec.local_index() == found.local_rank


def _local_index_and_local_rank() -> tuple[int, int, bool]:
    from parlay import runtime

    spec = TaskSpec.from_env()
    return spec.local_index(), runtime.local_rank(), bool(spec.is_ps)


def test_local_index_is_the_launcher_s_local_rank_on_real_ranks() -> None:
    # 2 nodes x 2 ranks, one parameter server: made-up hosts must not decide the device
    got = run_world(_local_index_and_local_rank, 4, local_world_size=2,
                    env={"PARLAY_NUM_PS": "1"})
    assert got == [(0, 0, True), (1, 1, False), (0, 0, False), (1, 1, False)]


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


@pytest.mark.parametrize("module", ["parlay.env", "parlay.discovery", "parlay.taskspec",
                                    "parlay._validate", "parlay.tfconfig"])
def test_env_modules_are_pure(module: str) -> None:
    import importlib

    source = open(importlib.import_module(module).__file__, encoding="utf-8").read()
    # Module level: parsing needs neither torch nor the runtime. Only TaskSpec.device_fn, which
    # answers with a torch.device chosen the runtime's way, imports them when it is called.
    imports = [line for line in source.splitlines() if line.startswith(("import", "from"))]
    assert not [line for line in imports if "torch" in line]
    allowed = ("from parlay.errors ", "from parlay._validate ", "from parlay.discovery ",
               "from parlay.taskspec ", "from parlay.tfconfig ")
    assert all(line.startswith(allowed) for line in imports if "parlay" in line)
    lazy = [line.strip() for line in source.splitlines()
            if line.startswith(" ") and line.strip().startswith(("import ", "from "))]
    assert set(lazy) <= {"import torch", "from parlay import runtime"}, lazy
