"""What ``parlay run`` adds to torchrun's elastic agent: a loopback rendezvous for one node,
droppable workers, and launcher errors a user can act on.

Everything here composes ``torch.distributed.elastic``'s own pieces; nothing replaces them.

Loopback rendezvous (one node)
    torchrun's ``--standalone`` hosts its c10d store with a ``TCPStore`` that listens on every
    interface, and shares a second one, also on every interface, with the workers. A
    single-node ``parlay run`` instead registers the rendezvous backend ``parlay-local``: the
    same c10d ``DynamicRendezvousHandler`` over a ``TCPStore`` whose listening socket is bound
    to ``127.0.0.1`` (``TCPStore(master_listen_fd=...)``: the store has no bind-address
    option), and that one store is shared with the workers, so ``MASTER_ADDR=127.0.0.1`` and
    ``MASTER_PORT`` is ``--master-port`` when given (else a free port). Gloo's own sockets are
    kept on loopback too (``GLOO_SOCKET_IFNAME=lo`` unless the user set it).

Droppable workers (the contract with parameter-server code)
    ``parlay run`` sets ``PARLAY_RUN_DIR`` to a fresh private temporary directory for the job
    (removed at exit). A worker that may be lost without ending the job (an asynchronous or
    bounded-staleness parameter-server worker) creates the empty file
    ``$PARLAY_RUN_DIR/droppable/<global rank>`` (see :func:`mark_droppable`). When a local
    worker process exits with a failure and its marker exists, the agent logs
    ``parlay run: rank N (droppable parameter-server worker) was lost; the other ranks go on``
    and keeps monitoring the others instead of stopping them. If every remaining process then
    succeeds the job exits 0 and says how many ranks were lost. A failure of a rank without a
    marker behaves as torchrun's always does: every worker is stopped and restarted while
    ``--max-restarts`` allows, else the job fails. Markers are cleared before every (re)start
    of the workers, so each attempt's processes declare themselves again.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch's elastic agent loads only when `parlay run` launches
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

__all__ = ["LOOPBACK_BACKEND", "mark_droppable", "droppable_marker", "run_torchrun",
           "register_loopback_rendezvous", "DropPolicy"]

log = logging.getLogger("parlay.launch")

#: Name of the loopback rendezvous backend registered with torchrun.
LOOPBACK_BACKEND = "parlay-local"


def droppable_marker(rank: int, run_dir: str | None = None) -> Path | None:
    """Path of rank ``rank``'s droppable marker, or ``None`` outside ``parlay run``."""
    run_dir = run_dir or os.environ.get("PARLAY_RUN_DIR")
    return Path(run_dir, "droppable", str(rank)) if run_dir else None


def mark_droppable(rank: int) -> bool:
    """Declare global rank ``rank`` droppable: its loss will not end the job.

    Returns:
        Whether a marker was written (``False`` outside ``parlay run``).
    """
    path = droppable_marker(rank)
    if path is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return True


# ---------------------------------------------------------------- loopback rendezvous
def _loopback_store(port: int, timeout_s: float) -> Any:
    """A TCPStore server listening on 127.0.0.1 only (port 0: a free one)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, multi_tenant=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on 127.0.0.1:{port}: {e.strerror}") from e
    return store


def _create_loopback_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import \
        C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    class LoopbackBackend(C10dRendezvousBackend):
        """torch's c10d rendezvous state on the loopback store, under this backend's name."""

        @property
        def name(self) -> str:
            return LOOPBACK_BACKEND

    store = _loopback_store(port, float(params.get_as_int("read_timeout", 60) or 60))
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The workers' store is this same loopback server (torch would open a second one on
    # every interface); the agent's own keys live under torch's rendezvous prefix.
    # torch has no argument for an existing store: replace this one handler's factory.
    handler._create_tcp_store_server = (  # type: ignore[method-assign]  # noqa: SLF001
        lambda master_addr, master_port: store)
    return handler


def register_loopback_rendezvous() -> None:
    """Register :data:`LOOPBACK_BACKEND` with torchrun's rendezvous registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    with contextlib.suppress(ValueError):  # already registered
        registry.register(LOOPBACK_BACKEND, _create_loopback_handler)


# ---------------------------------------------------------------- droppable workers
class DropPolicy:
    """Which failed local workers may be dropped, and which were."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.lost: list[int] = []

    def reset(self) -> None:
        """Forget the previous attempt's markers and losses (called at every worker start)."""
        self.lost = []
        d = Path(self.run_dir, "droppable")
        if d.is_dir():
            for f in d.iterdir():
                f.unlink(missing_ok=True)

    def drop(self, global_rank: int) -> bool:
        """Whether ``global_rank``'s failure is dropped (it has a marker); logs and counts it."""
        marker = droppable_marker(global_rank, self.run_dir)
        if marker is None or not marker.exists():
            return False
        self.lost.append(global_rank)
        print(f"parlay run: rank {global_rank} (droppable parameter-server worker) was lost; "
              "the other ranks go on", file=sys.stderr, flush=True)
        return True


def _capture_with_drops(pc: Any, policy: DropPolicy, ranks: dict[int, int],
                        done_local_ranks: set[int]) -> None:
    """SubprocessContext's failure capture, except that droppable failures count as done."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for local_rank in pc._running_local_ranks:  # noqa: SLF001 - torch's own bookkeeping
        handler = pc.subprocess_handlers[local_rank]
        exitcode = handler.proc.poll()
        if exitcode is None:
            continue
        done_local_ranks.add(local_rank)
        if exitcode != 0 and not policy.drop(ranks[local_rank]):
            pc._failures[local_rank] = ProcessFailure(  # noqa: SLF001
                local_rank=local_rank, pid=handler.proc.pid, exitcode=exitcode,
                error_file=pc.error_files[local_rank])


def _agent_class(policy: DropPolicy) -> type[LocalElasticAgent]:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    class ParlayAgent(LocalElasticAgent):
        """torchrun's local agent with the droppable-worker policy of this module."""

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            policy.reset()
            pids: dict[int, Any] = super()._start_workers(worker_group)
            pc = self._pcontext
            if isinstance(pc, SubprocessContext):
                ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
                pc._capture_process_failures = functools.partial(  # type: ignore[method-assign]
                    _capture_with_drops, pc, policy, ranks)
            return pids

    return ParlayAgent


@contextlib.contextmanager
def _parlay_agent(policy: DropPolicy) -> Iterator[None]:
    """torchrun's launcher builds ``LocalElasticAgent`` by name: use ours for this launch."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _agent_class(policy)  # type: ignore[misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]


# ---------------------------------------------------------------- running torchrun
def run_torchrun(argv: list[str], run_dir: str, own_run_id: str | None = None) -> int:
    """Run ``torch.distributed.run`` with parlay's agent; report failures; return the exit code.

    Args:
        argv: torchrun's arguments (see :func:`parlay.cli.torchrun_argv`).
        run_dir: The job's ``PARLAY_RUN_DIR``.
        own_run_id: A run id ``parlay run`` generated for this job (no later job can have
            it): its in-memory snapshots are removed when this returns, and by the next
            ``parlay run`` on the host should this process be killed
            (:mod:`parlay.snapshot.owner`). ``None``: the user chose the id; snapshots stay
            for a relaunch with it.
    """
    from parlay.snapshot.owner import claim, sweep

    sweep()  # runs whose launcher was killed before it could remove their snapshots
    owner = claim(own_run_id) if own_run_id else None
    try:
        return _run_agent(argv, run_dir)
    finally:
        if owner is not None:
            owner.release()


def _run_agent(argv: list[str], run_dir: str) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    register_loopback_rendezvous()
    policy = DropPolicy(run_dir)
    try:
        with _parlay_agent(policy):
            torchrun.main(argv)
    except ChildFailedError as e:
        print(_child_failure_text(e), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return _interrupted(int(e.sigval))
    except KeyboardInterrupt:
        return _interrupted(int(signal.SIGINT))
    except SystemExit as e:  # argparse inside torchrun
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except Exception as e:  # noqa: BLE001 - the launcher itself failed: say what and why
        print(_launcher_error_text(e, argv), file=sys.stderr, flush=True)
        return 1
    if policy.lost:
        print(f"parlay run: finished; {len(policy.lost)} droppable rank(s) lost "
              f"({', '.join(map(str, policy.lost))}), every other rank succeeded",
              file=sys.stderr, flush=True)
    return 0


def _interrupted(signum: int) -> int:
    name = signal.Signals(signum).name
    print(f"parlay run: interrupted by {name}; every rank was stopped", file=sys.stderr,
          flush=True)
    return 128 + signum


def _child_failure_text(e: Any) -> str:
    lines = []
    for rank, f in sorted(e.failures.items()):
        how = (f"killed by {f.signal_name()}" if f.exitcode < 0
               else f"exit code {f.exitcode}")
        lines.append(f"parlay run: rank {rank} failed ({how}, pid {f.pid}); its traceback, if "
                     "any, is above")
    return "\n".join(lines) or f"parlay run: a rank failed: {e}"


def _launcher_error_text(e: BaseException, argv: list[str]) -> str:
    chain: list[str] = []
    cur: BaseException | None = e  # the root cause is usually the innermost exception
    while cur is not None and len(chain) < 5:
        chain.append(f"{type(cur).__name__}: {str(cur).strip() or '(no message)'}")
        cur = cur.__cause__ or cur.__context__
    text = "\n  caused by ".join(chain)
    lowered = text.lower()
    if "address already in use" in lowered or "errno 98" in lowered:
        hint = ("Hint: the rendezvous port is in use (another job, or a previous one still "
                "exiting); pass a free one with --master-port, or omit it to pick a free port.")
    elif "connect" in lowered or "timed out" in lowered:
        hint = ("Hint: the rendezvous endpoint did not answer; check --rdzv-endpoint / "
                "--master-addr, that the first node is up, and firewalls between the nodes.")
    else:
        hint = "Hint: the launcher failed before any rank ran; the error above says why."
    return f"parlay run: the launcher failed: {text}\n{hint}"
