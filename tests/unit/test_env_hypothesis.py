"""Fuzzing cluster detection: any environment gives a valid answer or a ConfigError only."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from parlay.env import ClusterEnv, TaskSpec, detect, expand_nodelist
from parlay.errors import ConfigError

NAMES = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PARLAY_NUM_PS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_JOB_NODELIST",
    "SLURM_NTASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "TF_CONFIG", "HOME", "PATH", "JUNK",
]

small_ints = st.integers(min_value=-2, max_value=9).map(str)
numbers = st.one_of(small_ints, st.integers().map(str), st.sampled_from(["", " 1", "1.0", "x"]))
nodelists = st.sampled_from(["node[01-04,07]", "a[1-2],b3", "gpu-[001-003]-x", "n[", "", "h,",
                             "[1-2]", "x[3-1]", "::1", "[::1]"])
hosts = st.one_of(
    st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["a", "b", "c", "[::1]"]),
              st.integers(min_value=1, max_value=3)),
    st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["a", "b", "[::1]", "", "c d", "::1"]),
              st.integers(min_value=-1, max_value=70000)),
    st.text(max_size=8), st.integers(), st.none())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


def _cluster(n_ps: int, n_chief: int, n_workers: int, same_host: bool) -> dict[str, list[str]]:
    host = (lambda i: f"h:{1000 + i}") if same_host else (lambda i: f"h{i}:2222")
    names = [host(i) for i in range(n_ps + n_chief + n_workers)]
    return {"ps": names[:n_ps], "chief": names[n_ps:n_ps + n_chief],
            "worker": names[n_ps + n_chief:]}


valid_tf = st.builds(
    lambda cluster, task_type, index: json.dumps(
        {"cluster": cluster, "task": {"type": task_type, "index": index}}),
    st.builds(_cluster, st.integers(0, 2), st.integers(0, 1), st.integers(0, 3), st.booleans()),
    st.sampled_from(["ps", "worker", "chief", "evaluator"]), st.integers(0, 2))
tf_configs = st.one_of(
    valid_tf,
    st.text(max_size=40),
    json_values.map(json.dumps),
    st.builds(
        lambda cluster, task_type, index, extra: json.dumps(
            {"cluster": cluster, "task": {"type": task_type, "index": index, **extra}}),
        st.dictionaries(st.sampled_from(["ps", "worker", "chief", "evaluator", "master"]),
                        st.one_of(st.lists(hosts, max_size=4), json_values), max_size=4),
        st.one_of(st.sampled_from(["ps", "worker", "chief", "evaluator", "boss"]), json_values),
        st.one_of(st.integers(min_value=-1, max_value=4), json_values),
        st.dictionaries(st.text(max_size=4), json_values, max_size=2)),
)


def value_for(name: str) -> st.SearchStrategy[str]:
    if name == "TF_CONFIG":
        return tf_configs
    if name.endswith("NODELIST"):
        return st.one_of(nodelists, st.text(max_size=12))
    if name == "MASTER_ADDR":
        return st.one_of(st.sampled_from(["127.0.0.1", "node0", "::1", "[::1]", ""]),
                         st.text(max_size=8))
    if name == "SLURM_NTASKS_PER_NODE":
        return st.one_of(st.sampled_from(["4", "2(x3),1", "0"]), numbers)
    return st.one_of(numbers, st.text(max_size=8))


random_envs = st.lists(st.sampled_from(NAMES), unique=True, max_size=12).flatmap(
    lambda names: st.fixed_dictionaries({n: value_for(n) for n in names}))
# Near-valid launches (one source complete, small numbers, a little noise) reach the success
# paths of every source, which fully random dictionaries almost never do.
SOURCES = [
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"],
    ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID"],
    ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"],
    ["TF_CONFIG"],
]
plausible = st.sampled_from(["0", "1", "2", "3", "4", "29500"])
launch_envs = st.tuples(
    st.sampled_from(SOURCES).flatmap(lambda names: st.fixed_dictionaries(
        {n: (nodelists if "NODELIST" in n else st.just("node0") if n == "MASTER_ADDR"
             else tf_configs if n == "TF_CONFIG" else plausible) for n in names})),
    st.dictionaries(st.sampled_from(["PARLAY_NUM_PS", "GROUP_RANK", "SLURM_NNODES",
                                     "SLURM_NODEID", "TORCHELASTIC_RUN_ID", "JUNK"]),
                    plausible, max_size=2),
).map(lambda parts: {**parts[0], **parts[1]})
environments = st.one_of(random_envs, launch_envs)


@settings(max_examples=300, deadline=None)
@given(environments)
def test_detect_returns_valid_env_or_config_error(env: dict[str, str]) -> None:
    try:
        c = detect(env)
    except ConfigError:
        return
    assert isinstance(c, ClusterEnv)
    assert 0 <= c.rank < c.world_size and 0 <= c.local_rank < c.local_world_size
    assert 0 <= c.num_ps < c.world_size and 0 <= c.node_rank < c.num_nodes
    assert c.role == ("ps" if c.rank < c.num_ps else "worker")


@settings(max_examples=300, deadline=None)
@given(environments)
def test_task_spec_from_env_returns_valid_spec_or_config_error(env: dict[str, str]) -> None:
    try:
        spec = TaskSpec.from_env(env)
    except ConfigError:
        return
    assert isinstance(spec, TaskSpec)
    if spec.rank is not None:
        assert 0 <= spec.rank < spec.world_size
        c = detect(env)  # from_env and detect agree on where this process is
        assert (c.rank, c.world_size, c.num_ps) == (spec.rank, spec.world_size, spec.num_ps)
        assert spec.is_ps == (c.role == "ps")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["TF_CONFIG", "PARLAY_NUM_PS", "RANK", "WORLD_SIZE"]),
                       tf_configs, max_size=2))
def test_random_tf_config(env: dict[str, str]) -> None:
    for fn in (detect, TaskSpec.from_env):
        try:
            fn(env)
        except ConfigError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.one_of(nodelists, st.text(alphabet="ab0129[]-,", max_size=16)))
def test_expand_nodelist_never_crashes(text: str) -> None:
    try:
        hosts = expand_nodelist(text)
    except ConfigError:
        return
    assert hosts and all(hosts)
