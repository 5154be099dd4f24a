"""Replicas agree: data-parallel ranks compare a fingerprint of what they share.

Every replica of a data-parallel group should hold bit-identical parameters and optimizer state
(the reduced gradients are the same on every rank). A flipped bit in one rank's memory, a state
resumed from the wrong run, or a bug would split them silently; this check notices. After a
resume and every ``every`` steps, each member computes the CRC-32 of its parameters and
optimizer state (:func:`parlay.integrity.tensor_crc`) and the members exchange them (one
``int64`` allgather). With ``"auto"`` the interval is re-chosen at every check from the measured
cost of the check and of a step, so that checking costs at most :data:`BUDGET` of training.

On a disagreement with three or more replicas, the ranks outside the majority get the
majority's state over c10d (a broadcast of the tensors) and training goes on, with a warning
naming the step and the ranks; with two (or no majority) the run stops with a
:class:`~parlay.errors.ReplicaDivergence` naming them and the last step they agreed on.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any

import torch

from parlay import comm
from parlay.errors import ReplicaDivergence
from parlay.integrity import tensor_crc

__all__ = ["ReplicaCheck", "BUDGET", "FIRST_CHECK"]

log = logging.getLogger("parlay")

#: Largest share of training time the automatic interval lets the check take.
BUDGET = 0.005
#: Steps after the start (or a resume) of the first timed check with ``"auto"``.
FIRST_CHECK = 8
#: What a whole check costs the training loop, in multiples of its CRC's time.
COST_PER_CRC = 2.0


def replicated_tensors(strategy: Any) -> list[torch.Tensor]:
    """The parameters and optimizer state of ``strategy``'s optimizer, in a fixed order."""
    opt = strategy.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    out = [p.detach() for p in params]
    for p in params:
        st = opt.state.get(p, {})
        out += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


class ReplicaCheck:
    """The replica check of one data-parallel rank.

    Args:
        strategy: The run's strategy (its ``dp_group`` and ``optimizer``).
        every: Steps between checks, ``"auto"`` or 0 (off).
        step: The step training starts (or resumed) at.
    """

    def __init__(self, strategy: Any, every: int | str, step: int) -> None:
        self.strategy = strategy
        self.auto = every == "auto"
        on = bool(every) and strategy.has_replicas and strategy.dp_size > 1
        self.group = strategy.dp_group if on else None
        self.every = (FIRST_CHECK if self.auto else int(every)) if on else 0
        self.next = step + self.every
        # The last step the replicas agreed at: a fresh start's broadcast weights agree; a
        # resumed state is not known to until it is checked (-1).
        self.agreed_at = 0 if step == 0 else -1
        self._since = (time.perf_counter(), step)

    def check(self, step: int) -> None:
        """Compare the replicas now; heal a minority or raise.

        Every training rank takes part (one allgather over ``train_group``), so a divergence
        inside one pipeline stage's replicas stops every stage together.

        Raises:
            ReplicaDivergence: Some replicas differ and no majority of three or more agrees.
        """
        t0 = time.perf_counter()
        tensors = replicated_tensors(self.strategy)
        crc = tensor_crc(tensors)
        t_since, s_since = self._since
        step_s = (t0 - t_since) / max(1, step - s_since)
        want = self.every
        if self.auto:  # priced at twice the CRC's time: with the allgather, and the next step
            # running on caches the CRC evicted, a check costs more than the CRC alone
            # (benchmarks/recovery.py --replica-check-only measures the whole cost)
            cost = (time.perf_counter() - t0) * COST_PER_CRC
            want = max(1, math.ceil(cost / (BUDGET * max(step_s, 1e-9)) - 1e-9))
        head = comm.to_global_rank(self.group, 0)
        train = self.strategy.train_group
        rows = comm.gather_ints([head, crc, want], 3, train)
        self.every = max(r[2] for r in rows)
        self.next = step + self.every
        groups: dict[int, dict[int, int]] = collections.defaultdict(dict)
        for i, (h, c, _) in enumerate(rows):
            groups[h][comm.to_global_rank(train, i)] = c
        split = {h: g for h, g in groups.items() if len(set(g.values())) > 1}
        if split:
            self._disagree(step, split, head, tensors)
        self.agreed_at = step
        self._since = (time.perf_counter(), step)

    def _disagree(self, step: int, split: dict[int, dict[int, int]], head: int,
                  tensors: list[torch.Tensor]) -> None:
        """Heal every group with a majority of three or more; raise if any has none."""
        stuck = []
        for h, members in sorted(split.items()):
            value, votes = collections.Counter(members.values()).most_common(1)[0]
            if len(members) < 3 or 2 * votes <= len(members):
                stuck.append(members)
                continue
            odd = [r for r, c in members.items() if c != value]
            src = min(r for r, c in members.items() if c == value)
            log.warning("data-parallel replicas disagree at step %d: rank(s) %s differ from the "
                        "majority of %d of %d; they take rank %d's parameters and optimizer "
                        "state", step, odd, votes, len(members), src)
            if h == head:
                ranks = [comm.to_global_rank(self.group, i)
                         for i in range(comm.group_size(self.group))]
                with torch.no_grad():
                    for t in tensors:
                        comm.broadcast(t, ranks.index(src), self.group)
        if stuck:
            ranks = sorted(r for members in stuck for r in members)
            prints = ", ".join(f"rank {r}: {c:08x}" for m in stuck for r, c in sorted(m.items()))
            last = (f"they last agreed at step {self.agreed_at}" if self.agreed_at >= 0 else
                    "in the state this run resumed")
            raise ReplicaDivergence(
                f"data-parallel replicas disagree at step {step}: ranks {ranks} hold different "
                f"parameters or optimizer state (fingerprints {prints}; {last}). With no "
                "majority of three or more, the run cannot tell which is right, so it stops. "
                "Its checkpoints hold states the replicas agreed on (one is written only after "
                "they agree) and its snapshots after the last agreed step are deleted, so "
                "relaunching the job resumes an agreed state. Check the hardware of those "
                "ranks if this repeats.",
                step=step, ranks=ranks, agreed_at=self.agreed_at)
