"""Process-group lifecycle: the one piece of global state parlay owns.

``init()`` reads the cluster from the environment (:func:`parlay.discovery.detect`), chooses the
backend and device in one place, and creates the default process group with a collective
timeout, so a lost or silent peer raises :class:`~parlay.errors.CommError` instead of hanging.
A single process with no launcher and no environment works too: it gets a world of one.
"""
from __future__ import annotations

import atexit
import datetime as _dt
import logging
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any group: see init()'s atexit note

from parlay import lifeline
from parlay._validate import MAX_TIMEOUT_S
from parlay.discovery import ClusterEnv, detect, run_id
from parlay.errors import CommError, ConfigError

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_chief", "role", "device", "backend", "timeout",
    "cluster", "DEFAULT_TIMEOUT_S", "store_prefix", "generation", "new_group", "resolve_backend",
]

log = logging.getLogger("parlay")

#: Default collective timeout in seconds; ``PARLAY_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 300.0

_BACKENDS = ("auto", "gloo", "nccl", "mpi")


@dataclass
class _Runtime:
    cluster: ClusterEnv
    backend: str
    device: torch.device
    timeout: _dt.timedelta
    owns_group: bool


_rt: _Runtime | None = None

# Re-initialisation: every init() rendezvouses under a fresh store prefix, because the store may
# outlive the group (torchrun's agent store always does, across restart attempts too) and a peer
# could otherwise read the previous group's stale addresses and dial a dead process. The prefix
# names the launcher's run and restart attempt (a restarted process counts its inits from 0
# again) and this process's init count; every rank derives the same prefix.
_generation = 0

#: Callables run after every successful init() and before shutdown() destroys the group, so
#: layers such as parlay.horovod can set up and tear down per-group state (background threads,
#: subgroups) without this module knowing them. Append with :func:`on_init` / :func:`on_shutdown`.
_init_hooks: list[Callable[[], None]] = []
_exit_registered: list[bool] = []  # _at_exit is registered once
_shutdown_hooks: list[Callable[[], None]] = []


def on_init(fn: Callable[[], None]) -> None:
    """Run ``fn()`` after every successful :func:`init` (now too, if already initialised)."""
    _init_hooks.append(fn)
    if _rt is not None:
        fn()


def on_shutdown(fn: Callable[[], None]) -> None:
    """Run ``fn()`` at the start of every :func:`shutdown` of an initialised runtime."""
    _shutdown_hooks.append(fn)


def _as_timedelta(timeout: float | _dt.timedelta | None) -> _dt.timedelta:
    if timeout is None:
        raw = os.environ.get("PARLAY_TIMEOUT")
        if raw is None:
            return _dt.timedelta(seconds=DEFAULT_TIMEOUT_S)
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigError(f"PARLAY_TIMEOUT must be a number of seconds, got {raw!r}. "
                              "Hint: export PARLAY_TIMEOUT=300") from None
    if isinstance(timeout, _dt.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ConfigError(f"timeout must be seconds or a timedelta, got {type(timeout).__name__}.")
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ConfigError(f"timeout must be positive and at most {MAX_TIMEOUT_S:g} s, got "
                          f"{seconds} s. Hint: e.g. timeout=300.")
    return _dt.timedelta(seconds=seconds)


def _choose_backend(requested: str, local_rank: int) -> tuple[str, torch.device]:
    requested, dev = resolve_backend(requested, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return requested, dev


def resolve_backend(requested: str, local_rank: int) -> tuple[str, torch.device]:
    """The backend and device ``init(backend=requested)`` picks here, initialising nothing
    (``parlay env`` shows it); ``ConfigError`` for a backend this process cannot run."""
    if requested not in _BACKENDS:
        raise ConfigError(f"backend must be one of {_BACKENDS}, got {requested!r}.")
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        # One group, two transports: CPU tensors (parameter-server traffic, objects) go over
        # gloo and CUDA tensors over NCCL. NCCL has no any-source receive, gloo does.
        requested = "cpu:gloo,cuda:nccl" if has_cuda and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and not (has_cuda and dist.is_nccl_available()):
        raise ConfigError("backend='nccl' needs CUDA and an NCCL build of PyTorch; "
                          "this process has neither. Hint: use backend='gloo' (or 'auto') on CPU.")
    if requested == "mpi" and not dist.is_mpi_available():
        raise ConfigError("backend='mpi' needs a PyTorch built with MPI. Hint: use 'auto'.")
    if has_cuda and "nccl" in requested:
        return requested, torch.device("cuda", local_rank % torch.cuda.device_count())
    return requested, torch.device("cpu")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def init(backend: str = "auto", timeout: float | _dt.timedelta | None = None, *,
         environ: Mapping[str, str] | None = None, **explicit: object) -> None:
    """Initialise parlay's process group from the environment.

    Safe to call more than once (later calls are no-ops). If the user already created a default
    process group with ``torch.distributed.init_process_group``, parlay adopts it.

    Args:
        backend: ``"auto"`` (NCCL for CUDA tensors and gloo for CPU ones when CUDA is present,
            gloo otherwise), ``"gloo"``, ``"nccl"`` or ``"mpi"``.
        timeout: Collective timeout, seconds or a ``timedelta``. Default ``PARLAY_TIMEOUT`` or
            300 s. A peer silent for longer makes the waiting rank raise ``CommError``.
        environ: Environment to detect the cluster from (default ``os.environ``).
        **explicit: Explicit ``rank``, ``world_size``, ``local_rank``, ``local_world_size``,
            ``master_addr``, ``master_port``, ``num_ps`` (see :func:`~parlay.discovery.detect`)
            and ``node_rank``, ``num_nodes`` (default: consecutive ranks fill each node); they
            win over every environment source.

    Raises:
        ConfigError: Bad arguments or an inconsistent environment.
        CommError: The rendezvous with the other ranks failed or timed out.
    """
    global _rt, _generation
    if _rt is not None:
        return
    td = _as_timedelta(timeout)
    lifeline.bind_to_launcher()  # a rank of `parlay run` never outlives its launcher
    nodes = {k: explicit.pop(k) for k in ("node_rank", "num_nodes") if k in explicit}
    cluster = replace(detect(environ, **explicit), **nodes)  # type: ignore[arg-type]
    if dist.is_available() and dist.is_initialized():
        be = str(dist.get_backend())
        _, dev = _choose_backend("auto", cluster.local_rank)
        _generation += 1
        _rt = _Runtime(cluster=cluster, backend=be, device=dev, timeout=td, owns_group=False)
        _run_hooks(_init_hooks)
        return
    be, dev = _choose_backend(backend, cluster.local_rank)
    try:
        if cluster.world_size == 1 and cluster.master_port is None:
            # No launcher: a world of one still gets a real group so every op works unchanged.
            _generation += 1
            dist.init_process_group(be, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
        else:
            cluster = replace(_rendezvous(be, cluster, td, os.environ if environ is None
                                          else environ), **nodes)  # type: ignore[arg-type]
    except CommError:
        raise
    except (RuntimeError, TimeoutError, OSError) as e:
        raise CommError(
            f"rendezvous failed on rank {cluster.rank} of {cluster.world_size} "
            f"(master {cluster.master_addr}:{cluster.master_port}, source {cluster.source}): {e}. "
            f"Hint: {_rendezvous_hint(str(e), cluster)}.", op="init", rank=cluster.rank) from e
    _rt = _Runtime(cluster=cluster, backend=be, device=dev, timeout=td, owns_group=True)
    if not _exit_registered:
        # Destroy the group (joining its gloo threads) before finalisation ("terminate called"
        # at exit otherwise); torch.distributed.nn.functional is imported above, as if imported
        # later (first torch.optim optimizer) its `group=group.WORLD` defaults pin the group.
        atexit.register(_at_exit)
        _exit_registered.append(True)
    log.debug("parlay initialised: rank %d/%d backend %s device %s (source %s)",
              cluster.rank, cluster.world_size, be, dev, cluster.source)
    _run_hooks(_init_hooks)


def _rendezvous_hint(msg: str, cluster: ClusterEnv) -> str:
    """What to check when the rendezvous failed with ``msg``."""
    if "EADDRINUSE" in msg or "already in use" in msg:
        return ("MASTER_PORT is taken on this host: by another job, or by a second process also "
                "given rank 0 (each process needs its own RANK); pick a free port or fix the ranks")
    # gloo's own connections, made after the store rendezvous worked: an interface gloo cannot
    # use, or (several nodes) one whose address is loopback (a hostname resolving to 127.x).
    loopback = re.search(r"\b127(\.\d+){3}\b|\[::1\]", msg) and "gloo" in msg.lower()
    if "Unable to find address for" in msg or cluster.num_nodes > 1 and (
            "connectFullMesh" in msg or loopback):
        return ("the rendezvous worked, gloo's own connections did not: export "
                "GLOO_SOCKET_IFNAME=<the interface of this host's routable address> on each host "
                "(see `ip -brief address`; a hostname resolving to 127.x puts gloo on loopback)")
    return ("check that every rank was started, MASTER_ADDR is reachable from this host and "
            "MASTER_PORT is free on the master")


def generation() -> int:
    """This process's init generation: it changes with every :func:`init` (and every
    rendezvous attempt). State tied to a process group, such as subgroups or background
    engines, is dead once the generation it was made in is over."""
    return _generation


def store_prefix(environ: Mapping[str, str] | None = None, generation: int | None = None) -> str:
    """The store prefix of the next rendezvous: unique per run, restart attempt and init.

    Args:
        environ: Environment holding the run id (:func:`parlay.discovery.run_id`) and
            torchrun's ``TORCHELASTIC_RESTART_COUNT`` (default ``os.environ``).
        generation: This process's init count (default: the current one).
    """
    env = os.environ if environ is None else environ
    run = run_id(env)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    gen = _generation if generation is None else generation
    return f"parlay/{run}/attempt{attempt}/init{gen}" if run else \
        f"parlay/attempt{attempt}/init{gen}"


def _rendezvous(be: str, cluster: ClusterEnv, td: _dt.timedelta,
                environ: Mapping[str, str]) -> ClusterEnv:
    """Connect to the store, wait for every rank, then create the default group; ``cluster``
    with the node index and count MPI does not name, from the hostnames (:func:`_hosts_nodes`).

    Each phase is bounded by ``td``. The store connect and its waits get ``td`` (torch's
    TCPStore client retries a refused connect once, so a master that never comes up is reported
    after at most about twice that). The check-in waits ``td`` for every rank and names the
    absent ones (ranks that disagree on the world are refused at once). Only then does gloo
    build its full mesh: every peer is alive and past the check-in, so the mesh gets a short
    budget; gloo retries a refused connect several times, each try waiting the group timeout,
    which made a peer that died mid-rendezvous cost several timeouts. The group's collective
    timeout is set to ``td`` right after.
    """
    global _generation
    url = (f"tcp://{_host_for_url(cluster.master_addr or '127.0.0.1')}:"
           f"{cluster.master_port}?rank={cluster.rank}&world_size={cluster.world_size}")
    store = _base_store(url, cluster, td)
    prefix = store_prefix(environ)
    _generation += 1
    try:
        hosts = _check_in(dist.PrefixStore(prefix, store), cluster, td, prefix,
                          named_nodes=bool(environ.get("GROUP_WORLD_SIZE")))
    except ConfigError:
        raise  # the store answered: the ranks disagree
    except BaseException:
        _stores.pop(url, None)  # a store that failed a rendezvous is not trusted again
        raise
    store = dist.PrefixStore(prefix, store)
    mesh = min(td, max(td / 5, _dt.timedelta(seconds=_MESH_MIN_S)))
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    dist.init_process_group(be, store=store, rank=cluster.rank, world_size=cluster.world_size,
                            timeout=mesh if set_timeout is not None else td)
    if set_timeout is not None and mesh != td:
        set_timeout(td)
    return cluster if hosts is None else _hosts_nodes(cluster, hosts)


def _base_store(url: str, cluster: ClusterEnv, td: _dt.timedelta) -> dist.Store:
    """The rendezvous store of ``url``, connected once per process and kept across re-inits.

    Without torchrun's agent store, rank 0's process hosts the store and drops it when its
    group is destroyed. A peer that re-initialised first could then connect to the old server
    just before it closed ("Failed to recv" on one rank, "1/2 clients joined" on the other).
    Keeping the connection makes a re-init reuse it: nothing to close, nothing to dial, and the
    fresh prefix of every init keeps the rendezvous apart from the previous ones. A kept store
    that no longer answers (its host went away) is replaced.

    Rank 0's store does not wait for the other ranks to connect (torch's ``tcp://`` rendezvous
    does, and its timeout says only how many came): the check-in then names the absent ones.
    """
    store = _stores.get(url)
    if store is not None:
        try:
            store.set_timeout(td)
            store.check(["parlay/alive"])
            return store
        except (RuntimeError, TimeoutError, OSError):
            _stores.pop(url, None)
    fresh: dist.Store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts it
        fresh = next(dist.rendezvous(url, timeout=td))[0]
    else:
        assert cluster.master_port is not None  # detect() refuses a world without one
        fresh = dist.TCPStore(cluster.master_addr or "127.0.0.1", cluster.master_port,
                              cluster.world_size, is_master=cluster.rank == 0, timeout=td,
                              wait_for_workers=False, multi_tenant=True)
    fresh.set_timeout(td)
    _stores[url] = fresh
    return fresh


#: Rendezvous stores by URL (address, port, rank, world size), kept for the process lifetime.
_stores: dict[str, dist.Store] = {}

#: Floor of the full-mesh connect budget once every rank has checked in.
_MESH_MIN_S = 10.0


#: Sources that name no node index (``node_rank`` is a guess): the hostnames number the nodes.
_HOSTS_TELL_NODES = ("openmpi", "pmi")


def _check_in(store: dist.Store, cluster: ClusterEnv, td: _dt.timedelta,
              prefix: str, named_nodes: bool = False) -> list[str] | None:
    """Block until every rank of this rendezvous checked in; name the absent ones otherwise.

    A rank checked in twice (two processes given one rank), or a world size, node count or
    (for its node) local size other than the first rank to check in expects (those two where
    the launcher names the nodes, ``named_nodes``: torchrun's GROUP_WORLD_SIZE), ends the
    rendezvous at once: that rank sets the verdict every rank waits for, and each raises
    ``ConfigError`` naming the disagreement. Returns every rank's ``"<local size> <hostname>"``
    when the source names no node index, else ``None``.
    """
    world, rank, node = cluster.world_size, cluster.rank, cluster.node_rank
    views = [("world", world, "a world of {} ranks, the first rank to check in one of {}")]
    by_host = cluster.source in _HOSTS_TELL_NODES
    if by_host:
        store.set(f"host/{rank}", f"{cluster.local_world_size} {socket.gethostname()}")
    elif named_nodes:  # (else each rank's count is a guess from its own local size)
        views += [("nodes", cluster.num_nodes, "{} nodes, the first rank to check in {}"),
                  (f"node{node}/size", cluster.local_world_size,
                   f"{{}} ranks on node {node}, the first rank of that node to check in {{}}")]
    firsts = [(text, mine, store.compare_set(key, "", str(mine)).decode())
              for key, mine, text in views]
    clash = [text.format(mine, first) for text, mine, first in firsts if first != str(mine)]
    copies = store.add(f"arrived/{rank}", 1)
    why = (f"rank {rank} checked in {copies} times (processes were given the same rank)"
           if copies > 1 else f"rank {rank} expects {clash[0]}" if clash else "")
    if why:
        store.compare_set("all-arrived", "", why)  # the first verdict holds
    elif store.add("arrived", 1) == world:
        store.compare_set("all-arrived", "", "1")
    try:
        verdict = store.get("all-arrived").decode()
    except (RuntimeError, TimeoutError) as e:  # DistStoreError on timeout
        try:
            missing = [r for r in range(world) if not store.check([f"arrived/{r}"])]
        except (RuntimeError, TimeoutError, OSError):
            missing = []
        who = (f"rank(s) {missing} never arrived" if missing
               else "the store stopped answering")
        raise CommError(
            f"rendezvous timed out on rank {cluster.rank} of {world} after "
            f"{td.total_seconds():g} s: {who} (store {cluster.master_addr}:{cluster.master_port}, "
            f"{prefix}). Hint: check those ranks' logs (crashed, or started late); raise "
            "PARLAY_TIMEOUT if they need longer to start.", op="init", rank=cluster.rank,
            peer=missing[0] if len(missing) == 1 else None) from e
    if why or verdict != "1":
        raise ConfigError(f"rendezvous refused on rank {rank} of {world}: the processes "
                          f"disagree about the cluster: {why or verdict}. Hint: give every "
                          "process its own rank and the same world (TF_CONFIG's task index and "
                          "host lists, RANK and WORLD_SIZE) and node count (`parlay run "
                          "--nnodes`, GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE).")
    if by_host:
        return [h.decode() for h in store.multi_get([f"host/{r}" for r in range(world)])]
    return None


def _hosts_nodes(cluster: ClusterEnv, seen: list[str]) -> ClusterEnv:
    """``cluster`` with its nodes numbered by hostname in rank order, when the hostnames
    match every rank's local size (ranks may be dealt round-robin: ``mpirun --map-by node``)."""
    sizes, hosts = zip(*(entry.split(" ", 1) for entry in seen))
    if any(hosts.count(host) != int(n) for n, host in zip(sizes, hosts)):
        log.warning("parlay: the hostnames do not tell the nodes apart (containers sharing one "
                    "name?); node_rank assumes consecutive ranks fill each node. Hint: pass "
                    "node_rank= and num_nodes= to parlay.init() if ranks are placed round-robin.")
        return cluster
    names = list(dict.fromkeys(hosts))
    return replace(cluster, node_rank=names.index(hosts[cluster.rank]), num_nodes=len(names))


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for fn in list(hooks):
        fn()


def shutdown() -> None:
    """Destroy the process group parlay created; a no-op when not initialised."""
    global _rt
    if _rt is not None:
        _run_hooks(_shutdown_hooks)
    rt, _rt = _rt, None
    if rt is not None and rt.owns_group and dist.is_initialized():
        lifeline.track_groups()  # every group, weakly, to see which outlive their destruction
        dist.destroy_process_group()


def _at_exit() -> None:
    """Destroy the group, then drop the kept rendezvous stores, before finalisation."""
    try:
        shutdown()
        lifeline.settle_groups()  # groups an object still holds: see parlay.lifeline
    finally:
        _stores.clear()


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not)."""
    return _rt is not None


def _get() -> _Runtime:
    if _rt is None:
        raise ConfigError("parlay is not initialised. Hint: call parlay.init() first.")
    return _rt


def cluster() -> ClusterEnv:
    """The detected cluster description of this process."""
    return _get().cluster


def rank() -> int:
    """Global rank of this process."""
    return _get().cluster.rank


def size() -> int:
    """Number of processes in the world."""
    return _get().cluster.world_size


def local_rank() -> int:
    """Rank of this process on its node."""
    return _get().cluster.local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return _get().cluster.local_world_size


def cross_rank() -> int:
    """Index of this node among the nodes."""
    return _get().cluster.node_rank


def cross_size() -> int:
    """Number of nodes."""
    return _get().cluster.num_nodes


def is_chief() -> bool:
    """True on the one process that logs, saves checkpoints and prints (the first worker)."""
    c = _get().cluster
    return c.rank == c.num_ps


def role() -> str:
    """``"ps"`` on parameter-server ranks, ``"worker"`` otherwise."""
    return _get().cluster.role


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<local_rank>`` with NCCL, else CPU."""
    return _get().device


def backend() -> str:
    """The backend string of the default process group."""
    return _get().backend


def timeout() -> _dt.timedelta:
    """The configured collective timeout."""
    return _get().timeout


def new_group(ranks: Any = None, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` bounded by the configured timeout (torch's default for a
    new group is 30 minutes), so a silent peer in a subgroup surfaces as fast as in the world.
    Before :func:`parlay.init` (a process group of the caller's own) torch's default holds."""
    if "timeout" not in kwargs and is_initialized():
        kwargs["timeout"] = timeout()
    return dist.new_group(ranks, **kwargs)
