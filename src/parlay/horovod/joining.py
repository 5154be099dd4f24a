"""``hvd.join()`` for ``DistributedOptimizer``: a joined rank takes part in the other ranks'
gradient reductions with zeros, as in Horovod, so uneven numbers of steps per rank just work.

The optimizer's bucketed reductions go straight to c10d, matched by call order, not through the
name-matching engine. So while a rank is joined, a helper thread *mirrors* the optimizer the
loop steps (where this rank's history tells which, see :func:`_stepping`): it posts the same
bucket reductions as a real step, from zero gradients, and drops the result (the joined rank's
weights stay as they were, as in Horovod). The other ranks pay nothing for this: a step carries
no extra flag. The calling thread meanwhile answers the engine's rounds
(``allreduce`` of a metric, ``barrier``). Once the engine sees every rank joined, the ranks
agree on the most reductions any rank posted (one max-allreduce), every mirror completes up to
that count, and ``join`` returns. The mirror starts after a short grace period, so ranks that
join together exchange nothing extra.
"""
from __future__ import annotations

import copy
import gc
import itertools
import threading
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from parlay.horovod.basics import HorovodInternalError
from parlay.reduce_ops import ReduceOp

__all__ = ["register", "note_round", "mirrored_join"]

_GRACE_S = 0.05
_clock = itertools.count(1)
_live: list[weakref.ref[Any]] = []


def register(opt: Any) -> None:
    """Have ``hvd.join()`` consider ``opt`` (an optimizer on the global process set)."""
    _live[:] = [r for r in _live if r() is not None]
    _live.append(weakref.ref(opt))


def note_round(opt: Any) -> None:
    """``opt`` reduced its gradients: remember its first and last round and how many."""
    now = next(_clock)
    first, _, n = _rounds(opt)
    opt._join_rounds = (first or now, now, n + 1)


def _rounds(opt: Any) -> tuple[int, int, int]:
    """(first round, last round, rounds) of ``opt`` on this rank's clock; zeros if none."""
    return getattr(opt, "_join_rounds", (0, 0, 0))


def _stepping(opts: list[Any]) -> Any | None:
    """The optimizer the loop steps, or ``None`` where this rank's history cannot tell.

    The only one; else the only one ever stepped; else the one stepped last, if it stepped at
    least twice and every other one's rounds all came before its first (phases of training).
    Optimizers stepped in turn (a GAN), or several of which none (or one, once) stepped here,
    are not guessed: mirroring the wrong one would collide with the other ranks' reductions.
    """
    if len(opts) <= 1:
        return opts[0] if opts else None
    stepped = [o for o in opts if _rounds(o)[2]]
    if len(stepped) == 1:
        return stepped[0]
    if not stepped:
        return None
    cur = max(stepped, key=lambda o: _rounds(o)[1])
    first, _, n = _rounds(cur)
    if n >= 2 and all(_rounds(o)[1] < first for o in stepped if o is not cur):
        return cur
    return None


_UNSURE = ("hvd.join() cannot tell which of this rank's {n} DistributedOptimizers the other "
           "ranks step ({why}), so it does not stand in for their reductions: if another rank "
           "still steps, both wait until the collective timeout. Hint: give every rank the "
           "same number of steps (parlay.data's sampler with drop_last), or step one "
           "optimizer per loop.")


class _Mirror:
    """The helper thread: mirror rounds of ``opt`` (none if ``None``) until told how many it
    must reach."""

    def __init__(self, opt: Any, steps: int) -> None:
        self.opt = opt
        self.real = self.posted = steps  # reductions posted on this rank so far
        # join leaves the gradients as they were; the compressor's state before each of the
        # last two rounds, to undo a round every rank only mirrored (see restore)
        self.grads = [None if p.grad is None else p.grad.detach().clone()
                      for _, p in opt._named] if opt is not None else []
        # backward passes of a step not reduced yet (backward_passes_per_step=k): none started
        # a reduction, so, as in Horovod, they stay as they are (their counts are put back)
        eng = opt._buckets if opt is not None else None
        self.delay = None
        if eng is not None and not eng.untouched:
            self.delay = list(eng._delay)
            eng.reset()
        self.states: dict[int, Any] = {}
        self.target: int | None = None   # set once every rank joined
        self.hold = False
        self.error: BaseException | None = None
        self.progress = time.monotonic()  # when the other ranks last stepped (or join began)
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name="parlay-hvd-join")
        self.thread.start()

    def _claim(self) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: not self.hold or self.target is not None)
            if self.opt is None or (self.target is not None and self.posted >= self.target):
                return False
            self.posted += 1
            return True

    def _run(self) -> None:
        try:
            with self.cond:  # ranks that join together agree before any round is needed
                self.cond.wait_for(lambda: self.hold, timeout=_GRACE_S)
            while self._claim():
                state = self.opt.compression.state_dict()
                if state:  # error-feedback residuals and the like
                    self.states[self.posted] = copy.deepcopy(state)
                    self.states.pop(self.posted - 2, None)
                self.opt._mirror_round()
                self.progress = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - re-raised by the joining thread
            self.error = e

    def check(self, timeout_s: float | None = None, since: float = 0.0) -> None:
        """Raise the helper thread's failure, if any, or (given ``timeout_s``) that the other
        ranks have neither stepped nor ended an engine round (``since``) for that long; the
        engine calls it while a round waits."""
        if self.error is not None:
            raise HorovodInternalError(f"hvd.join(): mirroring the optimizer's reductions "
                                       f"failed: {self.error}", op="join") from self.error
        if timeout_s is not None and time.monotonic() - max(self.progress, since) > timeout_s:
            raise HorovodInternalError(
                f"hvd.join(): the other ranks neither stepped the optimizer nor ran a hvd.* "
                f"operation within {timeout_s:.0f} s (PARLAY_TIMEOUT). Hint: a rank is stalled "
                "or died, or a step takes longer than the timeout.", op="join")

    def stop(self) -> None:
        with self.cond:
            self.hold, self.target = True, self.posted
            self.cond.notify_all()

    def restore(self, real: int) -> None:
        """After the last round: the gradients as before the join and, when rounds after
        ``real`` (the most real steps of any rank) ran, every rank having mirrored them and
        dropped their result, the compressor's state from before the first of them."""
        if self.opt is None:
            return
        for (_, p), g in zip(self.opt._named, self.grads):
            p.grad = g
        if self.delay is not None:
            self.opt._buckets._delay = self.delay
        if self.posted > real and real + 1 in self.states:
            self.opt.compression.load_state_dict(self.states[real + 1])

    def agree(self, group: Any, rank: int, size: int) -> list[int]:
        """Every rank joined: stop claiming rounds, agree on the count, finish up to it.
        Returns every rank's number of real steps (before it joined)."""
        with self.cond:
            self.hold = True
            mine = [self.posted] + [self.real if r == rank else 0 for r in range(size)]
        counts = torch.tensor(mine, dtype=torch.int64, device=group.control_device())
        group.all_reduce(counts, int(ReduceOp.Max))
        got = counts.tolist()
        with self.cond:
            self.target = got[0]
            self.cond.notify_all()
        return got[1:]


def mirrored_join(engine: Any, timeout_s: float) -> int:
    """Run the engine's join while mirroring the stepping optimizer; return the last joined
    rank.

    Raises:
        HorovodInternalError: The optimizer is sharded, a mirrored reduction failed, or the
            engine's join failed (with a hint where this rank could not tell what to mirror).
    """
    gc.collect()  # optimizers no longer reachable are gone on every rank alike
    opts = [o for o in (r() for r in _live) if o is not None]
    if not opts:
        return int(engine.drive(None))
    opt, unsure = _stepping(opts), None
    if opt is None:
        n = sum(1 for o in opts if _rounds(o)[2])
        unsure = _UNSURE.format(n=len(opts), why="none stepped here yet" if n == 0 else
                                "they were stepped in turn, or the last one only once")
        warnings.warn(unsure, stacklevel=3)
    elif opt.shard:
        raise HorovodInternalError(
            "hvd.join() cannot stand in for a sharded DistributedOptimizer (shard=...): every "
            "rank must step it, since each holds a part of the state. Hint: give every rank the "
            "same number of steps (parlay.data's sampler with drop_last), or drop shard=.",
            op="join")
    elif opt._buckets.in_flight:
        raise HorovodInternalError(
            "hvd.join() was called after loss.backward() but before optimizer.step(): the "
            "backward pass started its gradient reductions. Hint: step() first.", op="join")
    mirror = _Mirror(opt, opt._steps if opt is not None else max(o._steps for o in opts))
    # The rounds wait while the others step (each step within the timeout), not in total;
    # a failed mirror ends the wait at once.
    engine.watch = lambda since: mirror.check(timeout_s, since)
    try:
        last = int(engine.drive(None))
    except BaseException as e:
        mirror.stop()  # no further rounds: a later join() starts a mirror of its own
        if unsure is not None:
            raise HorovodInternalError(f"{e} ({unsure})", op="join") from e
        raise
    finally:
        engine.watch = None
    # Ranks that only stepped never ran an engine round before joining, so the engine may not
    # know who joined last: the rank with the most real steps did (the engine's pick on ties).
    # Every rank with a DistributedOptimizer takes part, mirroring or not.
    ranks = engine.global_ranks
    real = mirror.agree(engine.group, ranks.index(dist.get_rank()), engine.size)
    if real[ranks.index(last)] < max(real):
        last = ranks[max(r for r, n in enumerate(real) if n == max(real))]
    mirror.thread.join(timeout_s)
    mirror.check()
    if mirror.thread.is_alive():
        raise HorovodInternalError(f"hvd.join(): the optimizer's last reductions did not finish "
                                   f"within {timeout_s:.0f} s", op="join")
    mirror.restore(max(real))
    return last
