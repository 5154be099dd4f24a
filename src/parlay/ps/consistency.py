"""Consistency policies of the parameter server, and the pure bookkeeping that enforces them.

A policy answers two questions (registry entries ``"sync"``, ``"async"``, ``"stale:s"``):

* ``aggregate``: are the gradients of one step of every worker averaged into one update
  (``sync``: the same maths as allreduce) or applied one push at a time on arrival?
* ``bound``: how far ahead of the slowest worker may a worker run? A worker whose clock (its
  number of applied pushes, i.e. the index of the step it is about to compute) exceeds the
  slowest live worker's clock by more than ``bound`` is held: its pull is answered only once
  the slowest catches up. ``async`` has no bound, ``stale:s`` has ``s`` (the SSP condition of
  Ho et al., NeurIPS 2013), ``sync`` has 0.

:class:`ServerCore` is the transport-free state machine a server runs: events in (hello, push,
done, lost, time passing), replies out. Keeping it pure lets the bound be reasoned about (and
tested) without a process group; :func:`max_lead` re-checks it from the recorded versions.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from parlay.errors import ConfigError
from parlay.registry import Registry, split_spec

__all__ = ["Consistency", "register_consistency", "get_consistency", "available_consistency",
           "Update", "Reply", "ServerCore", "max_lead", "RUN", "HELD", "SAVING", "DONE", "LOST"]

log = logging.getLogger("parlay.ps")


@dataclass(frozen=True)
class Consistency:
    """A consistency policy.

    Attributes:
        name: Registry spelling, e.g. ``"stale:2"``.
        aggregate: Average one step of every live worker into one update (sync).
        bound: Largest clock lead over the slowest live worker; ``None`` is unbounded.
    """

    name: str
    aggregate: bool
    bound: int | None

    def may_proceed(self, clock: int, slowest: int) -> bool:
        """Whether a worker at ``clock`` may compute its next step while the slowest live worker
        is at ``slowest``."""
        return self.bound is None or clock - slowest <= self.bound


_REGISTRY: Registry[Callable[..., Consistency]] = Registry(
    "consistency", example="stale takes a bound: 'stale:2'")


def register_consistency(name: str, factory: Callable[..., Consistency], *,
                         replace: bool = False) -> None:
    """Register ``factory``; ``"name:a"`` specs call ``factory("a")`` (a taken name is
    refused unless ``replace``)."""
    _REGISTRY.register(name, factory, replace=replace)


def available_consistency() -> list[str]:
    """Registered policy names."""
    return _REGISTRY.available()


def get_consistency(spec: str | Consistency) -> Consistency:
    """Build a policy from ``"sync"``, ``"async"`` or ``"stale:s"`` (or return the one given).

    Raises:
        ConfigError: Unknown name or bad option (the message lists the valid spellings).
    """
    if isinstance(spec, Consistency):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"consistency must be a string like 'sync', 'async' or 'stale:2', "
                          f"got {type(spec).__name__}.")
    name, args = split_spec(spec)
    factory = _REGISTRY.get(name, shown=spec)
    try:
        return factory(*args)
    except TypeError:
        takes = "no option" if name != "stale" else "one bound, e.g. stale:2"
        raise ConfigError(f"bad consistency {spec!r}: {name!r} takes {takes}.") from None


def _stale(bound: str | int | None = None) -> Consistency:
    if bound is None:
        raise ConfigError("consistency 'stale' needs a bound: 'stale:s' with s >= 0, e.g. "
                          "'stale:2'.")
    try:
        s = int(bound)
    except ValueError:
        s = -1
    if s < 0 or str(bound).strip() not in (str(s), f"+{s}"):
        raise ConfigError(f"the staleness bound must be an integer >= 0, got {bound!r}. "
                          "Hint: 'stale:2' lets a worker run 2 steps ahead of the slowest.")
    return Consistency(f"stale:{s}", aggregate=False, bound=s)


register_consistency("sync", lambda: Consistency("sync", aggregate=True, bound=0))
register_consistency("async", lambda: Consistency("async", aggregate=False, bound=None))
register_consistency("stale", _stale)


class Update(NamedTuple):
    """One applied gradient.

    Attributes:
        worker: Worker index that computed it.
        step: That worker's step index (its clock when it computed the gradient).
        base_version: Parameter version the gradient was computed on.
        version: Version it was applied to (the update produced ``version + 1``).
    """

    worker: int
    step: int
    base_version: int
    version: int

    @property
    def staleness(self) -> int:
        """Updates applied between the read and this apply."""
        return self.version - self.base_version


class Reply(NamedTuple):
    """What the server must send: ``kind`` in ``("params", "bye", "saved", "epoch", "wait",
    "error")``; ``"wait"``: keep waiting (a worker held or at a barrier longer than half the
    timeout hears it, so its receive does not time out while the others are slower)."""

    kind: str
    worker: int
    code: int = 0  # params: staleness of the worker's last push; error: Err kind; epoch: epoch
    peer: int = -1  # error: worker index the error is about
    counts: tuple[int, ...] = ()  # epoch: samples each worker trained of it (-1: lost, -2: done)


RUN, HELD, SAVING, DONE, LOST = "run", "held", "saving", "done", "lost"


class ServerCore:
    """Consistency bookkeeping of one server (pure; times are passed in).

    Args:
        policy: The consistency policy.
        num_workers: Number of workers.
        timeout: Seconds a released worker may stay silent before it is declared lost.
        apply: ``apply(grads, lr_factor)`` performs one update from a list of gradients (one
            per worker, in worker order, averaged by the caller) and returns nothing.
        snapshot: ``snapshot(tag)`` saves the server's state as checkpoint ``tag``; called once
            every live worker asked for ``tag`` (see :meth:`save`).
        now: Start time (deadlines of workers that have not said hello count from it).
        version: Starting parameter version (from a checkpoint).
        clocks: Starting worker clocks (from a checkpoint).
        log_limit: Keep at most this many :class:`Update` records (the histogram is kept
            for every update regardless).
    """

    def __init__(self, policy: Consistency, num_workers: int, timeout: float,
                 apply: Callable[[list[Any], float], None], now: float, version: int = 0,
                 clocks: Iterable[int] | None = None, log_limit: int = 1_000_000,
                 snapshot: Callable[[int], None] | None = None) -> None:
        self.policy = policy
        self._snapshot = snapshot or (lambda tag: None)
        # worker -> the barrier it waits at: ("save", step, 0) or ("epoch", epoch, samples)
        self.saving: dict[int, tuple[str, int, int]] = {}
        self.num_workers = num_workers
        self.timeout = timeout
        self._apply = apply
        self.version = version
        self.clocks = list(clocks) if clocks is not None else [0] * num_workers
        self.state = [RUN] * num_workers
        self.deadline: list[float | None] = [now + timeout] * num_workers
        self.last_staleness = [0] * num_workers
        self.pending: dict[int, tuple[Any, float, int, int]] = {}
        self.failure: tuple[int, int] | None = None  # (Err kind, worker) that broke sync
        self.histogram: collections.Counter[int] = collections.Counter()
        self.log: list[Update] = []
        self.log_limit = log_limit
        self.lost: list[int] = []
        self.lost_kind: dict[int, int] = {}  # worker -> Err kind (LOST: silent, FAILED: raised)
        self.warned_short = False  # sync: a round without a worker that finished was logged

    # -- queries ------------------------------------------------------------------------------
    def active(self) -> list[int]:
        """Workers that may still push (neither done nor lost)."""
        return [w for w in range(self.num_workers) if self.state[w] in (RUN, HELD, SAVING)]

    def finished(self) -> bool:
        """True when no worker can send anything more."""
        return not self.active()

    def next_deadline(self) -> float | None:
        """Earliest time a silent worker would be declared lost, or a waiting one told to wait
        on."""
        ds = [d for w, d in enumerate(self.deadline) if d is not None and self.state[w] in (
            RUN, HELD, SAVING)]
        return min(ds) if ds else None

    # -- events -------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Serving begins now: silence deadlines of released workers count from here."""
        for w in range(self.num_workers):
            if self.state[w] == RUN:
                self.deadline[w] = now + self.timeout

    def hello(self, w: int, now: float) -> list[Reply]:
        """Worker ``w`` asks for the parameters (its first pull)."""
        if self.state[w] == LOST:
            return [Reply("error", w, _EVICTED, w)]
        if self.failure is not None:
            return self._tell_failure(w)
        self.state[w], self.deadline[w] = HELD, now + self.timeout / 2
        return self._release(now)

    def push(self, w: int, step: int, base_version: int, grad: Any, lr_factor: float,
             now: float) -> list[Reply]:
        """Worker ``w`` pushes the gradient of its step ``step``, computed on ``base_version``."""
        if self.state[w] == LOST:
            return [Reply("error", w, _EVICTED, w)]
        if self.failure is not None:
            return self._tell_failure(w)
        self.state[w] = HELD
        self.deadline[w] = now + self.timeout / 2  # held: when it is told to wait on
        self.clocks[w] += 1
        if self.policy.aggregate:
            self.pending[w] = (grad, lr_factor, step, base_version)
            self._maybe_apply_round()
        else:
            self._record(w, step, base_version)
            self._apply([grad], lr_factor)
            self.version += 1
        return self._release(now) + self._maybe_save(now)

    def heard(self, w: int, now: float) -> None:
        """Part of a push of worker ``w`` arrived: its silence deadline starts again."""
        if self.state[w] == RUN:
            self.deadline[w] = now + self.timeout

    def done(self, w: int, now: float) -> list[Reply]:
        """Worker ``w`` finished training."""
        if self.state[w] == LOST:
            return [Reply("bye", w)]
        self.state[w] = DONE
        self.deadline[w] = None
        out = [Reply("bye", w)]
        if self.failure is None and self.policy.aggregate:
            self._maybe_apply_round()
        return out + self._release(now) + self._maybe_save(now)

    def lose(self, w: int, kind: int, now: float) -> list[Reply]:
        """Worker ``w`` is gone (silent past the timeout: ``Err.LOST``; raised: ``Err.FAILED``).

        In ``sync`` every other worker is told (the round cannot complete); otherwise the
        others go on and ``w`` no longer holds anyone back.
        """
        if self.state[w] in (DONE, LOST):
            return []
        self.state[w] = LOST
        self.deadline[w] = None
        self.lost.append(w)
        self.lost_kind[w] = kind
        self.pending.pop(w, None)
        self.saving.pop(w, None)
        if self.policy.aggregate and self.failure is None:
            self.failure = (kind, w)
            self.pending.clear()
            out: list[Reply] = []
            for v in range(self.num_workers):
                if self.state[v] in (HELD, SAVING):
                    out += self._tell_failure(v)
            return out
        return self._release(now) + self._maybe_save(now)

    def save(self, w: int, tag: int, now: float) -> list[Reply]:
        """Worker ``w`` asks for checkpoint ``tag`` (its step) and waits for it.

        The snapshot is taken once every live worker waits for the same ``tag``: no worker can
        push past its checkpoint step meanwhile, so the saved state holds exactly the first
        ``tag`` gradients of every live worker (``sync``: version ``tag``). Workers that
        disagree on ``tag`` are all told ``Err.SAVE_MISMATCH``.
        """
        return self._wait(w, ("save", tag, 0), now)

    def end_epoch(self, w: int, epoch: int, samples: int, now: float) -> list[Reply]:
        """Worker ``w`` ended ``epoch``, having trained ``samples`` of it, and waits.

        Once every live worker waits at the same epoch end, each is told how many samples
        every worker trained of it (-1 for workers lost, -2 done): the live workers of the next
        epoch, the same list for each of them (the survivors of a lost worker re-shard the
        data over it).
        """
        return self._wait(w, ("epoch", epoch, samples), now)

    def _wait(self, w: int, barrier: tuple[str, int, int], now: float) -> list[Reply]:
        if self.state[w] == LOST:
            return [Reply("error", w, _EVICTED, w)]
        if self.failure is not None:
            return self._tell_failure(w)
        self.state[w] = SAVING
        self.deadline[w] = now + self.timeout / 2
        self.saving[w] = barrier
        return self._maybe_save(now)

    def expire(self, now: float) -> list[Reply]:
        """Declare lost every released worker silent past its deadline while something waits
        on it: another worker held or at a barrier, or this server (it is the last worker). A
        worker nothing waits on (every other one computing: a long validation, say) gets a
        new deadline instead, so a waiter that comes later waits at most ``timeout``. A worker
        held or at a barrier for half the timeout is told to wait on."""
        out: list[Reply] = []
        for w in range(self.num_workers):
            d = self.deadline[w]
            if self.state[w] != RUN or d is None or d > now:
                continue
            others = [v for v in self.active() if v != w]
            if others and all(self.state[v] == RUN for v in others):
                self.deadline[w] = now + self.timeout
            else:
                out += self.lose(w, _LOST, now)
        for w in range(self.num_workers):  # (the waiting workers that were not told to stop)
            d = self.deadline[w]
            if self.state[w] in (HELD, SAVING) and d is not None and d <= now:
                self.deadline[w] = now + self.timeout / 2
                out.append(Reply("wait", w))
        return out

    # -- internals ----------------------------------------------------------------------------
    def _tell_failure(self, w: int) -> list[Reply]:
        assert self.failure is not None
        kind, peer = self.failure
        self.saving.pop(w, None)
        self.state[w] = DONE  # told; it will not send again
        self.deadline[w] = None
        return [Reply("error", w, kind, peer)]

    def _record(self, w: int, step: int, base_version: int) -> None:
        u = Update(w, step, base_version, self.version)
        self.histogram[u.staleness] += 1
        self.last_staleness[w] = u.staleness
        if len(self.log) < self.log_limit:
            self.log.append(u)

    def _maybe_apply_round(self) -> None:
        act = self.active()
        if not self.pending or any(v not in self.pending for v in act):
            return
        order = sorted(self.pending)
        for v in order:
            _, _, step, base = self.pending[v]
            self._record(v, step, base)
        done = [v for v in range(self.num_workers) if self.state[v] == DONE]
        if done and not self.warned_short:  # sync: the same maths as allreduce no more
            self.warned_short = True
            log.warning("sync: worker(s) %s finished while the others still push: from update "
                        "%d on, each update averages the gradients of %d of %d workers only. "
                        "Hint: every worker must run the same number of steps.", done,
                        self.version + 1, len(order), self.num_workers)
        grads = [self.pending[v][0] for v in order]
        lr = self.pending[order[0]][1]
        self.pending.clear()
        self._apply(grads, lr)
        self.version += 1

    def _maybe_save(self, now: float) -> list[Reply]:
        act = self.active()
        states = {self.state[v] for v in act}
        if self.failure is not None or SAVING not in states or RUN in states:
            return []
        # Every live worker waits. No consistent cut exists if they wait at different
        # checkpoints (or epoch ends), or if some wait for a step the others must push first
        # (sync, or past the staleness bound: only timeouts could follow): every one is told.
        tags = {self.saving[v][:2] for v in act if self.state[v] == SAVING}
        if HELD in states or len(tags) > 1:  # told; they fail (every one: the servers raise)
            for v in act:
                self.saving.pop(v, None)
                self.state[v], self.deadline[v] = LOST, None
                self.lost.append(v)
                self.lost_kind[v] = _FAILED
            return [Reply("error", v, _SAVE_MISMATCH, v) for v in act]
        (kind, tag), = tags
        counts = tuple(self.saving[v][2] if v in act else -2 if self.state[v] == DONE else -1
                       for v in range(self.num_workers))
        if kind == "save":
            self._snapshot(tag)
        out = []
        for v in act:
            self.saving.pop(v, None)
            self.state[v], self.deadline[v] = RUN, now + self.timeout
            out.append(Reply("saved", v) if kind == "save" else
                       Reply("epoch", v, tag, counts=counts))
        return out

    def _release(self, now: float) -> list[Reply]:
        act = self.active()
        if not act or self.failure is not None:
            return []
        slowest = min(self.clocks[v] for v in act)
        out = []
        for w in act:
            if self.state[w] == HELD and w not in self.pending and \
                    self.policy.may_proceed(self.clocks[w], slowest):
                self.state[w] = RUN
                self.deadline[w] = now + self.timeout
                out.append(Reply("params", w, self.last_staleness[w]))
        return out


# Err kinds, duplicated from wire.Err to keep this module free of transport imports.
_LOST, _FAILED, _EVICTED, _SAVE_MISMATCH = 1, 2, 3, 5


def max_lead(log: Iterable[Update], totals: dict[int, int] | None = None) -> int:
    """Largest step lead of a worker over the slowest other unfinished worker, re-derived from
    the recorded versions alone.

    For an applied gradient of worker ``w`` at step ``c`` computed on version ``b``, each other
    worker ``v`` had ``n_v(b)`` gradients among the updates below version ``b``; ``v`` counts as
    unfinished when ``n_v(b)`` is below its total. The lead is ``c - min_v n_v(b)``. Under
    ``stale:s`` it never exceeds ``s``; under ``sync`` it is 0.

    Args:
        log: Updates from a run that started at version 0 with all clocks 0.
        totals: Pushes applied per worker over the run (default: counted from ``log``).

    Returns:
        The largest lead (0 for an empty log or a single worker).
    """
    log = list(log)
    if totals is None:
        totals = dict(collections.Counter(u.worker for u in log))
    lead = 0
    for u in log:
        counts = collections.Counter(x.worker for x in log if x.version < u.base_version)
        others = [counts.get(v, 0) for v in totals if v != u.worker
                  and counts.get(v, 0) < totals[v]]
        if others:
            lead = max(lead, u.step - min(others))
    return lead
