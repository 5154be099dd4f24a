"""What ``parlay run`` adds to torchrun's elastic agent: a loopback rendezvous for one node
(:mod:`parlay.rendezvous`), droppable workers, and launcher errors a user can act on.

Everything here composes ``torch.distributed.elastic``'s own pieces; nothing replaces them.

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

Failure reports
    A rank of ``parlay run`` records an uncaught exception in torchrun's error file instead of
    printing it (:func:`parlay.lifeline.record_uncaught`). When ranks fail, the launcher prints
    the traceback of the rank(s) whose failure caused the others' once (a ``CommError`` is the
    consequence of another rank's loss), then one line: which ranks failed, how (exit code and
    exception, or signal), and ``restart attempt k of N starting`` or, when no restart is left,
    ``the job failed``. An attempt whose failures are all ``ConfigError`` (bad input, a second
    live job with the run id) is not restarted: a restart meets the same refusal. A rank that
    is stopped (SIGSTOP) acts on no signal but SIGKILL until it is continued, so the launcher
    sends SIGCONT after torch's SIGTERM: the job ends when the others' timeout does, not 30 s
    later when torch would fall back to SIGKILL.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parlay.rendezvous import LOOPBACK_BACKEND, register_loopback_rendezvous

if TYPE_CHECKING:  # torch's elastic agent loads only when `parlay run` launches
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

__all__ = ["LOOPBACK_BACKEND", "mark_droppable", "droppable_marker", "run_torchrun",
           "register_loopback_rendezvous", "DropPolicy"]

log = logging.getLogger("parlay.launch")



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


def mark_dropped(rank: int) -> None:
    """A parameter server gave up on droppable worker ``rank`` (silent past the timeout):
    ``parlay run`` stops it if it runs on the launcher's host (else it ends at its next
    exchange with the servers, which answer it no more)."""
    path = droppable_marker(rank)
    if path is not None and path.exists():
        _dropped(path).touch()


def _dropped(marker: Path) -> Path:
    """The file that says the servers dropped the worker of droppable ``marker``."""
    return marker.with_name(f"{marker.name}.dropped")


# ------------------------------------------------------- droppable workers, failure reports
class DropPolicy:
    """The launcher's account of an attempt: which failed local workers may be dropped and
    which were, which ranks it stopped itself, and the reports of what failed."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.lost: list[int] = []
        self.stopped: set[int] = set()  # ranks this attempt's launcher stopped, not failed
        self.host = ""  # this node's name when the job spans nodes
        self.max_restarts = 0
        self.refusal = False  # the attempt failed on ConfigErrors only: not restarted
        self.started = False  # workers were started (a launcher error is not a launch error)
        self.unfinished = ""  # why the exit barrier failed: another node's ranks did not finish

    def reset(self) -> None:
        """Forget the previous attempt's markers and losses (called at every worker start)."""
        self.lost = []
        self.stopped = set()
        d = Path(self.run_dir, "droppable")
        if d.is_dir():
            for f in d.iterdir():
                f.unlink(missing_ok=True)

    def drop(self, global_rank: int, failure: Any) -> bool:
        """Whether ``global_rank``'s failure is dropped (it has a marker); logs and counts it."""
        marker = droppable_marker(global_rank, self.run_dir)
        if marker is None or not marker.exists() or (global_rank in self.stopped
                                                     and not _dropped(marker).exists()):
            return False  # (stopped by the launcher as the job failed, not by the servers)
        self.lost.append(global_rank)
        _say(_traceback(global_rank, failure) + [
            f"parlay run: rank {global_rank} (droppable parameter-server worker) was lost; "
            "the other ranks go on"])
        return True

    def report(self, failures: dict[int, Any], outcome: str) -> None:
        """Print the causing ranks' tracebacks once, then one line naming them and ``outcome``.

        The causes are the failures the launcher did not bring about (or that recorded an
        exception before it stopped them) and that are no ``CommError``: a rank that lost a
        peer fails as a consequence. When every such failure is a ``CommError`` (a silent
        peer: its error names it), those are the causes. One traceback is printed per
        distinct stack.
        """
        own = {r: f for r, f in sorted(failures.items())
               if r not in self.stopped or _recorded(f)[0]} or dict(sorted(failures.items()))
        causes = {r: f for r, f in own.items()
                  if not _recorded(f)[0].startswith("CommError")} or own
        stacks: dict[tuple[str, ...], list[str]] = {}
        for r, f in causes.items():
            frames = tuple(ln for ln in _recorded(f)[1].splitlines() if ln.startswith("  File"))
            stacks.setdefault(frames, _traceback(r, f))
        # Causes that lost a peer (CommErrors, the causes only when no other failure is one):
        # a peer the launcher stopped while it was exiting without a record (sys.exit("..."),
        # a stall) failed first; name it before the ranks that lost it.
        said = [_recorded(f)[0] for f in causes.values()]
        lost = sorted({int(m) for t in said if t.startswith("CommError") for m in _LOST.findall(t)}
                      & (set(failures) - set(causes)))
        parts = [f"rank {r}{self._where(failures[r])} failed ({_how(failures[r], False)}, "
                 "and was lost by the others first)" for r in lost]
        same: dict[str, list[int]] = {}  # ranks that failed alike are named in one part
        for r, f in causes.items():
            same.setdefault(f"{self._where(f)} failed ({_how(f, r in self.stopped)})", []).append(r)
        parts += [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}{how}"
                  for how, rs in same.items()]
        if len(parts) > 3:
            parts[3:] = [f"{len(parts) - 3} more rank(s) failed"]
        _say([ln for lines in stacks.values() for ln in lines]
             + [f"parlay run: {'; '.join(parts)}; {outcome}"])

    def refused(self, failures: dict[int, Any]) -> bool:
        """Whether the failures that caused the others' (see :meth:`report`) are all
        ``ConfigError`` (bad input, a second live job with this run id): a restart meets
        the same refusal."""
        said = [m for r, f in failures.items()
                if (m := _recorded(f)[0]) or r not in self.stopped]
        causes = [m for m in said if not m.startswith("CommError")]
        self.refusal = bool(causes) and all(m.startswith("ConfigError") for m in causes)
        return self.refusal

    def _where(self, failure: Any) -> str:
        return f" (local rank {failure.local_rank} on {self.host})" if self.host else ""


#: How a CommError names the peer it lost (:func:`parlay.comm.lost_message`).
_LOST = re.compile(r"\brank (\d+)(?: \([^)]*\))? was lost")


def _say(lines: list[str]) -> None:
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def _recorded(failure: Any) -> tuple[str, str]:
    """The exception line and traceback a rank wrote to its error file ("" for none)."""
    data = failure.error_file_data.get("message") if isinstance(
        failure.error_file_data, dict) else None
    if not isinstance(data, dict):  # torch's ErrorHandler format, which parlay's ranks write
        return "", ""
    info = data.get("extraInfo")
    stack = info.get("py_callstack", "") if isinstance(info, dict) else ""
    return str(data.get("message", "")), str(stack)


def _how(failure: Any, stopped: bool) -> str:
    """Exit code or signal, and the exception; a rank the launcher's signal ended while it was
    exiting after an exception gets the exception alone (the signal was the launcher's, the
    exit code, had it ended first, its own)."""
    how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"exit code {failure.exitcode}")
    message = _recorded(failure)[0].strip().splitlines()[:1]
    return ": ".join(([] if stopped and message and failure.exitcode < 0 else [how]) + message)


def _traceback(rank: int, failure: Any) -> list[str]:
    return [f"[rank{rank}]: {ln}".rstrip() for ln in _recorded(failure)[1].rstrip().splitlines()]


def _capture_with_drops(pc: Any, policy: DropPolicy, ranks: dict[int, int],
                        done_local_ranks: set[int]) -> None:
    """SubprocessContext's failure capture, except that droppable failures count as done."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for local_rank in pc._running_local_ranks:  # noqa: SLF001 - torch's own bookkeeping
        handler = pc.subprocess_handlers[local_rank]
        exitcode = handler.proc.poll()
        marker = droppable_marker(ranks[local_rank], policy.run_dir)
        if exitcode is None and marker and _dropped(marker).exists():
            handler.close()  # the servers gave up on it: a hung worker must not hold the job
        if exitcode is None:
            continue
        done_local_ranks.add(local_rank)
        if exitcode == 0:
            continue
        failure = ProcessFailure(local_rank=local_rank, pid=handler.proc.pid, exitcode=exitcode,
                                 error_file=pc.error_files[local_rank])
        if not policy.drop(ranks[local_rank], failure):
            pc._failures[local_rank] = failure  # noqa: SLF001


def _stop(handler: Any, policy: DropPolicy, global_rank: int,
          death_sig: signal.Signals | None = None) -> None:
    """``SubprocessHandler.close``, then SIGCONT: a stopped process acts on the signal only
    once continued (torch would wait 30 s for it, then SIGKILL it)."""
    policy.stopped.add(global_rank)
    type(handler).close(handler, death_sig)
    with contextlib.suppress(ProcessLookupError, PermissionError, AttributeError):
        os.killpg(handler.proc.pid, signal.SIGCONT)


def _agent_class(policy: DropPolicy) -> type[LocalElasticAgent]:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    class ParlayAgent(LocalElasticAgent):
        """torchrun's local agent with the droppable-worker policy and the failure reports of
        this module."""

        _last: Any = None  # the latest monitoring result

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # a late node is no failure (a final save, an evaluation on one node): wait at
            # least torch's 300 s; a node whose ranks failed says so at once (_invoke_run)
            kwargs["exit_barrier_timeout"] = max(300, launcher_wait_s())
            super().__init__(*args, **kwargs)

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            policy.reset()
            policy.started = True
            policy.max_restarts = worker_group.spec.max_restarts
            policy.host = socket.gethostname() if worker_group.group_world_size > 1 else ""
            pids: dict[int, Any] = super()._start_workers(worker_group)
            pc = self._pcontext
            if isinstance(pc, SubprocessContext):
                ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
                pc._capture_process_failures = functools.partial(  # type: ignore[method-assign]
                    _capture_with_drops, pc, policy, ranks)
                for local_rank, handler in pc.subprocess_handlers.items():
                    handler.close = functools.partial(  # type: ignore[method-assign]
                        _stop, handler, policy, ranks[local_rank])
            return pids

        def _monitor_workers(self, worker_group: Any) -> Any:
            self._last = super()._monitor_workers(worker_group)
            if self._last.is_failed() and policy.refused(self._last.failures):
                self._remaining_restarts = 0  # the same input is refused again: no retry
            return self._last

        def _restart_workers(self, worker_group: Any) -> None:
            if self._last is not None and self._last.is_failed():  # not a membership change
                n = worker_group.spec.max_restarts
                policy.report(self._last.failures,
                              f"restart attempt {n - self._remaining_restarts} of {n} starting")
            super()._restart_workers(worker_group)

        def _invoke_run(self, role: str = "default") -> Any:
            result = super()._invoke_run(role)
            if result.is_failed():  # no attempt left: the nodes in the exit barrier learn it
                store: Any = self._store  # (torch types it None)
                with contextlib.suppress(Exception):
                    store.set(_EXIT_FAILED, socket.gethostname())
                    # this node may host the store: stay until a waiting node has read it
                    store.wait([_EXIT_SEEN], timedelta(seconds=5))
            return result

        def _exit_barrier(self) -> None:
            """torch's wait for the other nodes' agents, except that a node whose ranks failed
            for good (it says so in the store) or a timeout (torch logs it and returns as if
            every node had finished) is recorded: the job failed elsewhere. A store whose node
            ended is, as for torch, no failure: the last node to finish may host it."""
            from torch.distributed import DistStoreError
            from torch.distributed.elastic.multiprocessing.api import SignalException

            store: Any = self._store  # (torch types it None)
            timeout = self._exit_barrier_timeout
            deadline = time.monotonic() + timeout
            self._in_exit_barrier = True
            try:
                if store.add(_EXIT_ARRIVED, 1) >= self._worker_group.group_world_size:
                    store.set(_EXIT_ALL, "1")  # the last to finish: nothing more to ask
                    return
                while True:
                    try:
                        store.wait([_EXIT_ALL], timedelta(seconds=1))
                        return  # every node's ranks finished
                    except DistStoreError:  # a second passed: failed elsewhere, or too long?
                        pass
                    if store.check([_EXIT_FAILED]):
                        policy.unfinished = f"{store.get(_EXIT_FAILED).decode()}'s ranks failed"
                        store.set(_EXIT_SEEN, "1")
                        return
                    if time.monotonic() > deadline:
                        policy.unfinished = f"not all had finished after {timeout} s"
                        return
            except SignalException:
                raise
            except Exception as e:  # noqa: BLE001 - the store's node ended (it had finished)
                log.warning("parlay run: the exit barrier's store is gone (%s); the node "
                            "hosting it ended", type(e).__name__)
            finally:
                self._in_exit_barrier = False

    return ParlayAgent


@contextlib.contextmanager
def _parlay_agent(policy: DropPolicy) -> Iterator[None]:
    """torchrun's launcher builds ``LocalElasticAgent`` by name: use ours for this launch (and
    drop torch's per-failure log lines, which :meth:`DropPolicy.report` replaces)."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _agent_class(policy)  # type: ignore[misc]
    torch_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torch_log.addFilter(_said_by_parlay)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]
        torch_log.removeFilter(_said_by_parlay)


def _said_by_parlay(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


# ---------------------------------------------------------------- running torchrun
#: The exit barrier's keys in the rendezvous store (a fresh prefix per attempt).
_EXIT_ARRIVED, _EXIT_ALL, _EXIT_FAILED, _EXIT_SEEN = (
    "parlay/exit/arrived", "parlay/exit/all", "parlay/exit/failed", "parlay/exit/seen")


def launcher_wait_s() -> int:
    """How long launchers wait for each other (nodes to join, to finish): PARLAY_TIMEOUT."""
    from parlay.runtime import DEFAULT_TIMEOUT_S  # (cli checked PARLAY_TIMEOUT before launch)

    return max(1, round(float(os.environ.get("PARLAY_TIMEOUT") or DEFAULT_TIMEOUT_S)))


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
        args = torchrun.parse_args(argv)
        if not (args.module or args.no_python or os.path.isfile(args.training_script)):
            print(f"parlay run: no script {args.training_script!r} here ({os.getcwd()}). Hint: "
                  "the path to a Python file, or -m module.", file=sys.stderr, flush=True)
            return 2
        with _parlay_agent(policy):
            torchrun.run(args)  # not main(): its @record logs again
    except ChildFailedError as e:
        n = policy.max_restarts
        policy.report(e.failures, "the job failed; a ConfigError is not retried: fix the input "
                      "and relaunch" if policy.refusal and n else
                      f"the job failed, no restart attempt left (--max-restarts {n})")
        return 1
    except SignalException as e:
        return _interrupted(int(e.sigval))
    except KeyboardInterrupt:
        return _interrupted(int(signal.SIGINT))
    except SystemExit as e:  # argparse inside torchrun
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except Exception as e:  # noqa: BLE001 - the launcher itself failed: say what and why
        print(_launcher_error_text(e, argv, policy.started), file=sys.stderr, flush=True)
        return 1
    if policy.unfinished:
        print(f"parlay run: this node's ranks finished, but not every other node's: "
              f"{policy.unfinished}; the job failed there, see that node's output",
              file=sys.stderr, flush=True)
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


def _launcher_error_text(e: BaseException, argv: list[str], started: bool = False) -> str:
    chain: list[str] = []
    cur: BaseException | None = e  # the root cause is usually the innermost exception
    while cur is not None and len(chain) < 5:
        chain.append(f"{type(cur).__name__}: {str(cur).strip() or '(no message)'}")
        cur = cur.__cause__ or cur.__context__
    text = "\n  caused by ".join(chain)
    lowered = text.lower()
    joined = re.search(r"(\d+)/(\d+) clients joined", text)  # static rendezvous, on node 0
    if "address already in use" in lowered or "errno 98" in lowered:
        hint = ("Hint: the rendezvous port is in use (another job, or a previous one still "
                "exiting); pass a free one with --master-port, or omit it to pick a free port.")
    elif "role_info" in lowered:  # node 0 waited for ranks no node registered
        hint = ("Hint: the nodes' ranks did not add up: two nodes were given the same "
                "--node-rank, or the nodes different --nnodes; give every node the same "
                "--nnodes and its own --node-rank in 0..nnodes-1.")
    elif joined or "rendezvoustimeouterror" in lowered:
        hint = (f"Hint: {f'{joined[1]} of {joined[2]}' if joined else 'not all'} nodes joined "
                "the rendezvous within PARLAY_TIMEOUT; the others are missing: start parlay run "
                "on every node with the same --nnodes and --rdzv-endpoint, and check firewalls.")
    elif started:
        hint = ("Hint: the ranks had started, then the launcher lost the rendezvous at "
                "--rdzv-endpoint: the node hosting it is gone (its parlay run ended, or its host "
                "is down or unreachable); its output says why.")
    elif "connect" in lowered or "timed out" in lowered:
        hint = ("Hint: the rendezvous endpoint did not answer; check --rdzv-endpoint / "
                "--master-addr, that the first node is up, and firewalls between the nodes.")
    else:
        hint = "Hint: the launcher failed before any rank ran; the error above says why."
    return f"parlay run: the launcher failed: {text}\n{hint}"
