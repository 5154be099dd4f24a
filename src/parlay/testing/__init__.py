"""Test harness: run a function on real gloo ranks spawned on loopback.

``run_world(fn, world_size)`` starts ``world_size`` processes, each with a real process group
(``parlay.init()`` over gloo on 127.0.0.1 and a free port), calls ``fn(*args, **kwargs)`` on
every rank and returns the per-rank results. Exceptions are propagated with the failing rank
named; a rank that hangs past the timeout is killed and reported. Processes come from a
forkserver that has already imported torch, so each rank starts in well under a second.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as _queue
import socket
import time
import traceback
from typing import Any
from collections.abc import Callable, Mapping

from parlay.errors import ParlayError

__all__ = ["run_world", "free_port", "process_alive", "WorldError", "RankFailure"]


class WorldError(ParlayError):
    """One or more ranks of :func:`run_world` failed, hung or died.

    Attributes:
        failures: ``{rank: RankFailure}`` for every rank that did not return normally.
    """

    def __init__(self, message: str, failures: dict[int, RankFailure]) -> None:
        super().__init__(message)
        self.failures = failures


class RankFailure:
    """What went wrong on one rank: the exception (when it could be pickled) and traceback."""

    def __init__(self, rank: int, kind: str, exc: BaseException | None, tb: str) -> None:
        self.rank = rank
        self.kind = kind  # "error" | "died" | "hung"
        self.exc = exc
        self.traceback = tb

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, kind={self.kind!r}, exc={self.exc!r})"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_ctx: Any = None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (ended, not yet reaped by a parent that may not be
    ours) counts as ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _context() -> Any:
    global _ctx
    if _ctx is None:
        method = os.environ.get("PARLAY_TEST_START_METHOD", "forkserver")
        _ctx = mp.get_context(method)
        if method == "forkserver":
            # torch.distributed.pipelining takes ~2 s to import: pay it once in the forkserver.
            _ctx.set_forkserver_preload(["torch", "torch.distributed", "parlay",
                                         "torch.distributed.pipelining"])
    return _ctx


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, q: Any,
               release: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               env: Mapping[str, str], timeout: float, threads: int, local: int) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
    })
    if local != world_size:
        # What torchrun sets on each of several nodes: the runtime then sees a multi-node world.
        os.environ.update({"GROUP_RANK": str(rank // local),
                           "GROUP_WORLD_SIZE": str(world_size // local)})
    os.environ.update(env)
    import torch

    import parlay.runtime as rt

    torch.set_num_threads(threads)
    try:
        rt.init(backend="gloo", timeout=timeout)
        result = fn(*args, **kwargs)
        # Plain pickle bytes: the queue's own pickler would share tensor storage through file
        # descriptors that vanish when this process exits before the parent reads them.
        q.put((rank, "ok", pickle.dumps(result), ""))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(e)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001
            payload = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
        q.put((rank, "error", payload, tb))
    finally:
        # Keep the group (rank 0 hosts its store) alive until every rank has reported, so a
        # rank that finishes early never pulls the store from under one still talking to it.
        release.wait(timeout + 30)
        try:
            rt.shutdown()
        except Exception:  # noqa: BLE001
            pass


class _Reports:
    """What the ranks of one :func:`run_world` reported: results, errors, deaths, hangs."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}

    def _open(self, r: int) -> bool:
        return r not in self.results and r not in self.failures

    def _take(self, r: int, kind: str, payload: bytes, tb: str) -> None:
        if kind == "ok":
            self.results[r] = pickle.loads(payload)
        else:
            self.failures[r] = RankFailure(r, "error", pickle.loads(payload), tb)

    def collect(self, q: Any, procs: list[Any], deadline: float, timeout: float) -> None:
        """Read reports until every rank has one; a dead rank or the deadline makes its own."""
        while len(self.results) + len(self.failures) < self.world_size:
            try:
                self._take(*q.get(timeout=0.2))
                continue
            except _queue.Empty:
                pass
            for r, p in enumerate(procs):
                if self._open(r) and not p.is_alive() and p.exitcode not in (None, 0):
                    # Drain a report that may still be in flight before calling it a death.
                    try:
                        self._take(*q.get(timeout=0.5))
                        continue
                    except _queue.Empty:
                        pass
                    self.failures[r] = RankFailure(r, "died", None, f"rank {r} exited with code "
                                                   f"{p.exitcode} without reporting a result")
            if time.monotonic() > deadline:
                for r in range(self.world_size):
                    if self._open(r):
                        self.failures[r] = RankFailure(
                            r, "hung", None, f"rank {r} did not finish within {timeout} s")
                return

    def outcome(self, return_exceptions: bool) -> list[Any]:
        """Per-rank results; raise :class:`WorldError` for failures unless asked to return them."""
        failures = self.failures
        if failures and not return_exceptions:
            first = min(failures)
            parts = [f"rank {r} {f.kind}:\n{f.traceback}" for r, f in sorted(failures.items())]
            err = WorldError(f"{len(failures)} of {self.world_size} ranks failed (first: rank "
                             f"{first})\n" + "\n".join(parts), failures)
            exc = failures[first].exc
            if exc is not None:
                raise err from exc
            raise err
        return [self.results[r] if r in self.results else
                (failures[r].exc if failures[r].exc is not None
                 else WorldError(failures[r].traceback, {r: failures[r]}))
                for r in range(self.world_size)]


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              comm_timeout: float = 30.0, env: Mapping[str, str] | None = None,
              threads: int = 1, return_exceptions: bool = False,
              local_world_size: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` real gloo ranks and return their results.

    Args:
        fn: A picklable (module-level) function; runs after ``parlay.init()`` on each rank.
        world_size: Number of ranks to start.
        timeout: Seconds the whole world may take before hung ranks are killed.
        comm_timeout: The process group's collective timeout, seconds.
        env: Extra environment variables for every rank (e.g. ``{"PARLAY_NUM_PS": "1"}``).
        threads: ``torch.set_num_threads`` on each rank (1 keeps 2-core machines responsive).
        return_exceptions: Return each failed rank's exception in its slot instead of raising.
        local_world_size: Pretend the ranks sit on ``world_size // local_world_size`` nodes of
            this many ranks each (``LOCAL_RANK``, ``GROUP_RANK``... as torchrun sets them), so
            topology-aware code sees several hosts. Default: one node holding every rank.

    Returns:
        The list of per-rank return values, indexed by rank.

    Raises:
        WorldError: A rank raised, died or hung; the message names each rank and its traceback.
    """
    local = world_size if local_world_size is None else int(local_world_size)
    if local < 1 or world_size % local:
        raise ValueError(f"local_world_size must divide world_size={world_size}, got {local}")
    ctx = _context()
    q = ctx.Queue()
    release = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, name=f"parlay-rank{r}",
                         args=(fn, r, world_size, port, q, release, args, kwargs, dict(env or {}),
                               comm_timeout, threads, local), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports = _Reports(world_size)
    deadline = time.monotonic() + timeout
    try:
        reports.collect(q, procs, deadline, timeout)
    finally:
        release.set()
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
        q.join_thread()
    return reports.outcome(return_exceptions)
