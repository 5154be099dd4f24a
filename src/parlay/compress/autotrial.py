"""``compression="auto"``'s trial: the close contenders of its first decision, measured.

The cost model ranks the candidates from microbenchmarks taken in one step, and on a busy host
two candidates predicted within a few percent of each other can measure 10% apart in either
order. So after the first decision :class:`~parlay.compress.auto.AutoCompressor` runs every
contender predicted within ``within`` of the best (at most ``most`` of them, the decided choices
first) for ``steps`` steps each, and keeps the one whose median step, MAX over the ranks, is the
fastest (the decided choices unless another measured ``hysteresis`` faster). Every rank runs the
same schedule: the choices change at the same steps and the medians are reduced together.

A contender is an assignment ``bucket key -> candidate spec``: the choices the model made per
bucket, and for each other spec, every bucket on that spec.
"""
from __future__ import annotations

import statistics
from typing import Any

__all__ = ["Trial", "contenders"]


def _total(pred: dict[str, dict[str, float]], assign: dict[str, str]) -> float:
    return sum(pred[k][s] for k, s in assign.items())


def contenders(pred: dict[str, dict[str, float]], choices: dict[str, str],
               within: float, most: int) -> list[dict[str, str]]:
    """The assignments worth measuring: ``choices`` first, then every single-spec assignment
    predicted within ``within`` (a fraction) of the fastest of them all, fastest first, at most
    ``most`` in all; ``[choices]`` alone when nothing else is close (or only one bucket spec
    was ever predicted)."""
    keys = [k for k in choices if k in pred]
    if not keys or most < 2:
        return [dict(choices)]
    specs = [s for s in pred[keys[0]] if all(s in pred[k] for k in keys)]
    options = [dict(choices)] + [{k: s for k in keys} for s in specs]
    totals = [_total(pred, a) for a in options]
    best = min(totals)
    out: list[dict[str, str]] = [options[0]]
    for t, a in sorted(zip(totals[1:], options[1:]), key=lambda p: p[0]):
        if t <= (1 + within) * best and a not in out and len(out) < most:
            out.append(a)
    return out


class Trial:
    """The schedule of one trial: which assignment runs now, and the verdict at the end.

    Args:
        options: The contenders (:func:`contenders`), the decided choices first.
        steps: Steps each contender runs (the median of their times is its measure).
        hysteresis: How much faster (a fraction) another contender must measure to beat the
            first.
    """

    def __init__(self, options: list[dict[str, str]], steps: int, hysteresis: float) -> None:
        self.options, self.steps, self.hysteresis = options, int(steps), float(hysteresis)
        self.index = -1  # the contender running now (-1: none yet)
        self.measured: list[float] = []
        self._times: list[float] = []

    def next(self, interval: float | None) -> dict[str, str] | None:
        """Called at the start of every step with the last step's time (``None`` at the
        trial's first call). Returns the assignment to run from this step when it changes,
        else ``None``; :attr:`done` says when the verdict (:meth:`winner`) is in."""
        if self.index < 0:
            self.index = 0
            return self.options[0]
        if interval is not None:
            self._times.append(interval)
        if len(self._times) < self.steps:
            return None
        self.measured.append(statistics.median(self._times))
        self._times = []
        self.index += 1
        return self.options[self.index] if self.index < len(self.options) else None

    @property
    def done(self) -> bool:
        return self.index >= len(self.options)

    def winner(self, agreed: list[float]) -> tuple[dict[str, str], str]:
        """The assignment to keep, from every contender's median agreed over the ranks, and
        why."""
        first = agreed[0]
        best = min(range(len(agreed)), key=lambda i: (agreed[i], i))
        if best and agreed[best] >= (1 - self.hysteresis) * first:
            best = 0
        why = ", ".join(f"{_describe(a)} {t * 1e3:.2f}ms" for a, t in zip(self.options, agreed))
        return self.options[best], f"trial: {why}"


def _describe(assign: dict[str, Any]) -> str:
    specs = sorted(set(assign.values()))
    return specs[0] if len(specs) == 1 else "+".join(specs)
