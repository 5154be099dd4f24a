"""Where is this process in the cluster? Pure functions of an environment mapping.

:func:`detect` reads one :class:`ClusterEnv` from, in order: explicit arguments > torchrun >
SLURM > OpenMPI > MPICH / Intel MPI (PMI) > ``TF_CONFIG`` > a single process (the
ordered-detector idea of Lightning Fabric's cluster environments).

Rank convention, relied on by the launcher and every parlay module: parameter servers first
(ranks ``0..K-1``, rank = ps index), then the chief when there is one, then the workers. The first
non-ps rank (``K``) is the chief: the chief task, or worker 0 when there is none (TF's rule). The
chief trains like any worker, so ``role`` is ``"ps"`` for ranks below ``K`` and ``"worker"``
otherwise. Evaluators (TF semantics) stand outside the training world and have no rank.

This module sits below :mod:`parlay.taskspec` (``TaskSpec.from_env`` detects) and
:mod:`parlay.runtime` (``init()`` detects); users import its names from :mod:`parlay.env`
or :mod:`parlay`. It imports neither torch nor any parlay module but :mod:`parlay.errors`, the
validators it shares with :mod:`parlay.taskspec` (:mod:`parlay._validate`) and the TF-style task
reader (:mod:`parlay.tfconfig`).
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

from parlay._validate import (DEFAULT_MASTER_PORT, TASK_TYPES, addr_var, as_index, ceil_div,
                              check_below, check_host, cluster_order, expand_nodelist, fail,
                              first_node, int_var, local_sizes, need_var, parse_address,
                              port_var, rank_of, show, tasks_on)
from parlay.errors import ConfigError
from parlay.tfconfig import TENSORLAYER_VARS, read_task, tf_config_text

__all__ = ["TASK_TYPES", "DEFAULT_MASTER_PORT", "ClusterEnv", "detect", "expand_nodelist",
           "pipeline_stages", "run_id", "read_task", "tf_config_text", "describes_cluster"]


@dataclass(frozen=True)
class ClusterEnv:
    """Where this process sits in the training world.

    Attributes:
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the GPU).
        local_world_size: Number of processes on this node.
        master_addr: Rendezvous host (rank 0), unbracketed; ``None`` if unknown.
        master_port: Rendezvous port; ``None`` for a single process without a launcher.
        source: Where it came from: ``"explicit"``, ``"torchrun"``, ``"slurm"``, ``"openmpi"``,
            ``"pmi"`` (MPICH, Intel MPI), ``"tf_config"`` or ``"single"``.
        num_ps: Parameter servers, ranks ``0..num_ps-1``; ``0 <= num_ps < world_size``.
        node_rank: Index of this node.
        num_nodes: Number of nodes.
        pipeline_stages: Pipeline stages per replica the launcher asked for
            (``parlay run --pp P`` exports ``PARLAY_PP``); ``None`` when it did not.

    Raises:
        ConfigError: At construction, for values out of range or of the wrong type.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str
    num_ps: int = 0
    node_rank: int = 0
    num_nodes: int = 1
    pipeline_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size", "num_ps",
                     "node_rank", "num_nodes"):
            object.__setattr__(self, name, as_index(getattr(self, name), name))
        if self.world_size < 1 or self.local_world_size < 1 or self.num_nodes < 1:
            raise fail("ClusterEnv", "world_size, local_world_size and num_nodes >= 1",
                       f"{self.world_size}, {self.local_world_size}, {self.num_nodes}",
                       "a world has at least one process on one node")
        check_below("rank", self.rank, "world_size", self.world_size, "ranks count from 0")
        check_below("local_rank", self.local_rank, "local_world_size", self.local_world_size,
                    "local ranks count from 0 on each node")
        check_below("node_rank", self.node_rank, "num_nodes", self.num_nodes,
                    "node ranks count from 0")
        check_below("num_ps", self.num_ps, "world_size", self.world_size,
                    "keep at least one worker")
        if self.master_port is not None and (
                isinstance(self.master_port, bool) or not isinstance(self.master_port, int)
                or not 1 <= self.master_port <= 65535):
            raise fail("master_port", "None or an int in 1..65535", show(self.master_port),
                       "use e.g. 29500")
        if self.pipeline_stages is not None:
            pp = as_index(self.pipeline_stages, "pipeline_stages")
            if pp < 1:
                raise fail("pipeline_stages", "None or an int >= 1", str(pp),
                           "one stage is plain data parallelism")
            object.__setattr__(self, "pipeline_stages", pp)
        if self.master_addr is not None:
            if not isinstance(self.master_addr, str):
                raise fail("master_addr", "None or a host string", show(self.master_addr),
                           "use e.g. '127.0.0.1'")
            object.__setattr__(self, "master_addr", check_host(self.master_addr, "master_addr"))

    @property
    def role(self) -> str:
        """``"ps"`` for ranks below ``num_ps``, else ``"worker"`` (the chief included)."""
        return "ps" if self.rank < self.num_ps else "worker"

    @property
    def chief_rank(self) -> int:
        """Rank of the chief: the first non-ps rank, ``num_ps``."""
        return self.num_ps

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief (rank ``num_ps``)."""
        return self.rank == self.num_ps

    @property
    def task_index(self) -> int:
        """Index within the role: ps index for a ps, ``rank - num_ps`` for a worker."""
        return self.rank if self.rank < self.num_ps else self.rank - self.num_ps

    @property
    def one_host(self) -> bool:
        """Whether every rank of the world runs on this host."""
        return self.num_nodes == 1 and self.local_world_size >= self.world_size


# -- environment readers -----------------------------------------------------------------------

def pipeline_stages(environ: Mapping[str, str] | None = None) -> int | None:
    """The pipeline stage count ``parlay run --pp P`` gave this launch (``PARLAY_PP``).

    The one place ``PARLAY_PP`` is read: :func:`detect` puts it in
    :attr:`ClusterEnv.pipeline_stages`, the default stage count of ``mode="hybrid"`` when its
    ``pp`` option is not given.

    Args:
        environ: Environment mapping; ``None`` reads ``os.environ``.

    Returns:
        The stage count, or ``None`` when the variable is not set.

    Raises:
        ConfigError: ``PARLAY_PP`` is not an integer >= 1.
    """
    return int_var(os.environ if environ is None else environ, "PARLAY_PP", minimum=1)


def run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """This job's id, the same on every rank and across restarts; ``None`` when it has none.

    ``$PARLAY_RUN_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID`` (a fresh id per ``parlay run``
    job, kept across its restarts), else ``$SLURM_JOB_ID``. torchrun's default multi-node id
    ``"none"`` does not count: two jobs would share it. It names the job in rendezvous
    store prefixes (:func:`parlay.runtime.store_prefix`) and in-memory snapshot keys.
    """
    env = os.environ if environ is None else environ
    for var in ("PARLAY_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        run = env.get(var, "")
        if run and run != "none":
            return run
    return None


def _master(env: Mapping[str, str], world_size: int, source: str) -> tuple[str, int | None]:
    """MASTER_ADDR / MASTER_PORT, required for a world of more than one process."""
    addr, port = addr_var(env), port_var(env)
    if world_size > 1 and (addr is None or port is None):
        missing = " and ".join(n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in env)
        raise ConfigError(f"{missing} missing: expected the rendezvous address for {source} with "
                          f"world size {world_size}. Hint: export MASTER_ADDR=<host of rank 0> "
                          "MASTER_PORT=<free port>, or launch with `parlay run` / torchrun.")
    return addr or "127.0.0.1", port


def _torchrun(env: Mapping[str, str]) -> ClusterEnv | None:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not any(k in env for k in keys):
        return None
    rank, world = need_var(env, "RANK", keys), need_var(env, "WORLD_SIZE", keys, minimum=1)
    check_below("RANK", rank, "WORLD_SIZE", world, "ranks count from 0")
    local_rank, local_world = local_sizes(rank, world, int_var(env, "LOCAL_RANK"),
                                          int_var(env, "LOCAL_WORLD_SIZE", 1), "torchrun")
    nodes = int_var(env, "GROUP_WORLD_SIZE", 1) or ceil_div(world, local_world)
    node = int_var(env, "GROUP_RANK")
    node = rank // local_world if node is None else node
    check_below("GROUP_RANK", node, "number of nodes", nodes, "node ranks count from 0")
    addr, port = _master(env, world, "torchrun")
    return ClusterEnv(rank, world, local_rank, local_world, addr, port, "torchrun",
                      node_rank=node, num_nodes=nodes)


def _slurm_port(env: Mapping[str, str]) -> int:
    port = port_var(env)
    if port is not None:
        return port
    job = env.get("SLURM_JOB_ID")
    if job is None:
        return DEFAULT_MASTER_PORT
    # Every task of one job must agree without talking: derive the port from the job id.
    digits = job.strip()
    key = int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 19 else \
        zlib.crc32(job.encode("utf-8", "surrogatepass"))
    return 15000 + key % 10001


def _slurm(env: Mapping[str, str]) -> ClusterEnv | None:
    # SLURM_NTASKS alone only describes an allocation (e.g. an salloc shell): srun sets PROCID.
    if "SLURM_PROCID" not in env:
        return None
    keys = ("SLURM_PROCID",)
    rank = need_var(env, "SLURM_PROCID", keys)
    world = need_var(env, "SLURM_NTASKS", keys, minimum=1)
    check_below("SLURM_PROCID", rank, "SLURM_NTASKS", world, "ranks count from 0")
    local_rank = need_var(env, "SLURM_LOCALID", keys)
    nnodes, node = int_var(env, "SLURM_NNODES", 1), int_var(env, "SLURM_NODEID")
    # --ntasks-per-node sets a plain count; else this node's entry of the per-node list; else
    # assume tasks spread evenly over nodes.
    local_world = (int_var(env, "SLURM_NTASKS_PER_NODE", 1) or tasks_on(node, env.get(
        "SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE"))) or
        ceil_div(world, nnodes or 1))
    local_rank, local_world = local_sizes(rank, world, local_rank, local_world, "SLURM")
    nnodes = nnodes or ceil_div(world, local_world)
    node = rank // local_world if node is None else node
    check_below("SLURM_NODEID", node, "SLURM_NNODES", nnodes, "node ids count from 0")
    addr = addr_var(env)
    if addr is None:
        nodelist = env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST"))
        if nodelist is not None:
            addr = check_host(first_node(nodelist), "first host of SLURM_NODELIST")
        elif world == 1:
            addr = "127.0.0.1"
        else:
            raise ConfigError("SLURM_NODELIST is missing: expected SLURM_NODELIST, "
                              "SLURM_JOB_NODELIST or MASTER_ADDR to find rank 0's host. "
                              "Hint: launch with srun, or export MASTER_ADDR.")
    return ClusterEnv(rank, world, local_rank, local_world, addr, _slurm_port(env), "slurm",
                      node_rank=node, num_nodes=nnodes)


def _openmpi(env: Mapping[str, str]) -> ClusterEnv | None:
    keys = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE")
    if not any(k in env for k in keys):
        return None
    rank, world = need_var(env, keys[0], keys), need_var(env, keys[1], keys, minimum=1)
    check_below(keys[0], rank, keys[1], world, "ranks count from 0")
    local_rank, local_world = local_sizes(rank, world, need_var(env, keys[2], keys),
                                          need_var(env, keys[3], keys, minimum=1), "OpenMPI")
    addr, port = _master(env, world, "OpenMPI (mpirun)")
    return ClusterEnv(rank, world, local_rank, local_world, addr, port, "openmpi",
                      node_rank=rank // local_world, num_nodes=ceil_div(world, local_world))


def _pmi(env: Mapping[str, str], checked_only: bool) -> ClusterEnv | None:
    """MPICH / Intel MPI; ``checked_only``: another source won, no master needed to agree."""
    keys = ("PMI_RANK", "PMI_SIZE")
    if not any(k in env for k in keys):
        return None
    rank, world = need_var(env, keys[0], keys), need_var(env, keys[1], keys, minimum=1)
    check_below(keys[0], rank, keys[1], world, "ranks count from 0")
    local_rank, local_world = local_sizes(rank, world, int_var(env, "MPI_LOCALRANKID"),
                                          int_var(env, "MPI_LOCALNRANKS", 1), "MPI (PMI)")
    addr, port = _master(env, 1 if checked_only else world, "MPICH / Intel MPI (PMI)")
    return ClusterEnv(rank, world, local_rank, local_world, addr, port, "pmi",
                      node_rank=rank // local_world, num_nodes=ceil_div(world, local_world))


#: What describes a cluster to :func:`detect` (torchrun's, TF_CONFIG, TensorLayer's, parlay's
#: own), and the prefixes of SLURM's, OpenMPI's, PMI's and torchelastic's variables.
_CLUSTER_VARS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
                           "JOB_NAME", "TASK_INDEX", *TENSORLAYER_VARS.values(),
                           "PARLAY_NUM_PS", "PARLAY_PP", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"})
_CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")


def describes_cluster(name: str) -> bool:
    """Whether environment variable ``name`` tells :func:`detect` about a cluster (a process
    started without any of them runs alone)."""
    return name in _CLUSTER_VARS or name.startswith(_CLUSTER_PREFIXES)


def _tf_config(env: Mapping[str, str]) -> ClusterEnv | None:
    found = read_task(env)
    if found is None:
        return None
    task_type, index, hosts, _ = found
    rank = rank_of(task_type, index, hosts)
    if rank is None:
        raise ConfigError("TF_CONFIG describes an evaluator: expected a ps, chief or worker task. "
                          "Hint: evaluators are not part of the training world; read them with "
                          "TaskSpec.from_env() and run evaluation without parlay.init().")
    # Tasks sharing a host are one node; local rank counts them in rank order.
    addresses = [parse_address(a, "TF_CONFIG") for a in cluster_order(hosts)]
    names = [host.lower() for host, _ in addresses]
    nodes = list(dict.fromkeys(names))
    mine = names[rank]
    local = [r for r, h in enumerate(names) if h == mine]
    return ClusterEnv(rank, len(names), local.index(rank), len(local), addresses[0][0],
                      addresses[0][1], "tf_config", num_ps=len(hosts["ps"]),
                      node_rank=nodes.index(mine), num_nodes=len(nodes))


_SOURCE_VARS = {"torchrun": "RANK/WORLD_SIZE", "slurm": "SLURM_PROCID/SLURM_NTASKS",
                "openmpi": "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE", "tf_config": "TF_CONFIG",
                "pmi": "PMI_RANK/PMI_SIZE"}


def detect(environ: Mapping[str, str] | None = None, *, rank: int | None = None,
           world_size: int | None = None, local_rank: int | None = None,
           local_world_size: int | None = None, master_addr: str | None = None,
           master_port: int | None = None, num_ps: int | None = None) -> ClusterEnv:
    """Read this process's place in the cluster; a pure function of ``environ``.

    Sources, first match wins: explicit ``rank``/``world_size`` > torchrun (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) > SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``,
    ``SLURM_LOCALID``, optional ``SLURM_NTASKS_PER_NODE``, ``SLURM_NODEID``, ``SLURM_NNODES``;
    master = ``MASTER_ADDR`` or the first host of ``SLURM_NODELIST``/``SLURM_JOB_NODELIST``,
    port = ``MASTER_PORT``, else ``15000 + SLURM_JOB_ID % 10001``, else 29500) > OpenMPI
    (``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``) > MPICH / Intel MPI (``PMI_RANK``,
    ``PMI_SIZE``, optional ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``; both MPIs need
    ``MASTER_ADDR``/``MASTER_PORT``) > ``TF_CONFIG`` (one without a cluster counts as unset)
    > a single process (rank 0 of 1, master ``127.0.0.1``, port ``None``).

    Missing local variables: without a local rank each process is alone on its node (one per
    pod, as Kubernetes launches); with a local rank but no local size, the node holds the world.

    Conflicts: when ``TORCHELASTIC_RUN_ID`` is set (torchrun always sets it) torchrun wins
    silently over SLURM and MPI (inside a SLURM allocation ``SLURM_NTASKS`` counts srun tasks,
    not torchrun's processes); only a ``TF_CONFIG`` of its world size is read (it must agree on
    the rank), for its ps count. Otherwise every source that is present must parse and agree on
    rank and world size with the chosen one (srun's PMI variables beside SLURM's need no
    master), else ``ConfigError``; torchrun's variables set by hand beside SLURM or MPI take
    its local rank and size and node rank and count (those set must agree with them).
    MPI names no node index: OpenMPI's and PMI's ``node_rank`` assumes consecutive ranks fill
    each node, and :func:`parlay.init` numbers the nodes by hostname instead.
    ``SLURM_NTASKS`` without ``SLURM_PROCID`` (an salloc shell) is not a SLURM launch. Note a
    batch script run without srun carries ``SLURM_PROCID=0`` of the whole allocation.

    Args:
        environ: Environment mapping; ``None`` reads ``os.environ``.
        rank: Explicit global rank; needs ``world_size`` too. No environment source is read then.
        world_size: Explicit world size; needs ``rank``.
        local_rank: Explicit local rank (default 0).
        local_world_size: Explicit local size (default 1 without ``local_rank``, else the world).
        master_addr: Rendezvous host; overrides any source (default ``MASTER_ADDR``/127.0.0.1).
        master_port: Rendezvous port; overrides any source (explicit default: ``MASTER_PORT``,
            required when ``world_size > 1``).
        num_ps: Parameter servers; overrides ``PARLAY_NUM_PS`` (and ``TF_CONFIG``'s ps count).

    Returns:
        The detected :class:`ClusterEnv`.
    Raises:
        ConfigError: Partial, malformed, out-of-range or conflicting variables, an evaluator
            ``TF_CONFIG``, or ``num_ps``/``PARLAY_NUM_PS`` outside ``0..world_size-1``.
    """
    env = os.environ if environ is None else environ
    if rank is not None or world_size is not None or local_rank is not None \
            or local_world_size is not None:
        found = _explicit(env, rank, world_size, local_rank, local_world_size, master_addr,
                          master_port)
        present = [found]
    else:
        present = _present(env)
        found = present[0] if present else ClusterEnv(0, 1, 0, 1, "127.0.0.1", None, "single")
    if master_addr is not None or master_port is not None:
        found = replace(found, master_addr=found.master_addr if master_addr is None
                        else master_addr, master_port=found.master_port if master_port is None
                        else master_port)
    pp = pipeline_stages(env)
    if pp is not None:
        found = replace(found, pipeline_stages=pp)
    return _with_num_ps(found, env, num_ps, [c.num_ps for c in present
                                             if c.source == "tf_config"])


def _explicit(env: Mapping[str, str], rank: int | None, world_size: int | None,
              local_rank: int | None, local_world_size: int | None, master_addr: str | None,
              master_port: int | None) -> ClusterEnv:
    """The cluster of explicit ``detect()`` arguments (no launcher variable is read)."""
    if rank is None or world_size is None:
        raise fail("detect()", "rank and world_size together",
                   f"rank={show(rank)}, world_size={show(world_size)}",
                   "pass both, or neither to read them from the environment")
    r, w = as_index(rank, "rank"), as_index(world_size, "world_size")
    if w < 1:
        raise fail("world_size", "an int >= 1", str(w), "count the processes")
    check_below("rank", r, "world_size", w, "ranks count from 0")
    lr, lw = local_sizes(r, w, None if local_rank is None else as_index(local_rank,
                         "local_rank"), None if local_world_size is None else
                         as_index(local_world_size, "local_world_size"), "explicit")
    port = port_var(env) if master_port is None else master_port
    if w > 1 and port is None:
        raise ConfigError(f"master_port is missing: expected it (or MASTER_PORT) with "
                          f"world_size {w}. Hint: pass master_port=<free port>.")
    addr = addr_var(env) if master_addr is None else master_addr
    return ClusterEnv(r, w, lr, lw, addr or "127.0.0.1", port, "explicit",
                      node_rank=r // lw, num_nodes=ceil_div(w, lw))


def _present(env: Mapping[str, str]) -> list[ClusterEnv]:
    """Every launcher source present in ``env``, the winner first; they must agree."""
    first = _torchrun(env)
    if first is not None and "TORCHELASTIC_RUN_ID" in env:
        try:  # torchrun wins silently, but a TF_CONFIG of its world gives the ps count
            tf = _tf_config(env)
        except ConfigError:
            tf = None
        present = [first, *([tf] if tf and tf.world_size == first.world_size else [])]
    else:
        present = [c for c in (first, _slurm(env), _openmpi(env)) if c]
        present += [c for c in (_pmi(env, bool(present)), _tf_config(env)) if c]
    for other in present[1:]:
        found = present[0]
        if (other.rank, other.world_size) != (found.rank, found.world_size):
            raise ConfigError(
                f"conflicting cluster environment: expected {found.source} "
                f"({_SOURCE_VARS[found.source]}) and {other.source} "
                f"({_SOURCE_VARS[other.source]}) to agree, got rank {found.rank} of "
                f"{found.world_size} vs rank {other.rank} of {other.world_size}. Hint: unset "
                "the stale variables, or pass rank= and world_size= explicitly.")
    if first is not None and "TORCHELASTIC_RUN_ID" not in env:
        present[0] = _launcher_layout(present, env)
    return present


#: torchrun's node-layout variables and the fields they set.
_LAYOUT = {"LOCAL_RANK": "local_rank", "LOCAL_WORLD_SIZE": "local_world_size",
           "GROUP_RANK": "node_rank", "GROUP_WORLD_SIZE": "num_nodes"}


def _launcher_layout(present: list[ClusterEnv], env: Mapping[str, str]) -> ClusterEnv:
    """torchrun's variables set by hand (``export RANK=$SLURM_PROCID`` in an sbatch script) beside
    a launcher that knows the node layout: the layout is the launcher's, and those of torchrun's
    layout variables that are set must agree with it."""
    found = present[0]
    launcher = next((c for c in present[1:] if c.source in ("slurm", "openmpi")
                     or c.source == "pmi" and "MPI_LOCALRANKID" in env), None)
    if launcher is None:
        return found
    for var, field in _LAYOUT.items():
        if var in env and getattr(found, field) != getattr(launcher, field):
            raise ConfigError(
                f"conflicting cluster environment: expected {var} to agree with "
                f"{launcher.source}'s {field} {getattr(launcher, field)}, got "
                f"{getattr(found, field)}. Hint: unset {var} (parlay reads the node layout from "
                f"{launcher.source}), or export it from {launcher.source}'s variables.")
    return replace(found, **{field: getattr(launcher, field) for field in _LAYOUT.values()})


def _with_num_ps(found: ClusterEnv, env: Mapping[str, str], num_ps: int | None,
                 tf: list[int]) -> ClusterEnv:
    """``found`` with its parameter-server count: ``num_ps``, TF_CONFIG's, or PARLAY_NUM_PS."""
    k = int_var(env, "PARLAY_NUM_PS") if num_ps is None else as_index(num_ps, "num_ps")
    if tf and num_ps is None:  # TF_CONFIG's ps count holds even when another source won
        if k is not None and k != tf[0]:
            raise fail("PARLAY_NUM_PS", f"TF_CONFIG's ps count {tf[0]}", str(k),
                       f"launch with parlay run --ps {tf[0]}, unset PARLAY_NUM_PS or fix TF_CONFIG")
        k = tf[0]
    if k is None:
        return found
    check_below("num_ps" if num_ps is not None else "PARLAY_NUM_PS", k, "world size",
                found.world_size, "keep at least one worker: parlay run -n N --ps K needs K < N")
    return replace(found, num_ps=k)

