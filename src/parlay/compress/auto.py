"""``compression="auto"``: per bucket, the compressor the measured link and CPU make fastest.

:class:`AutoCompressor` holds one instance of each candidate (default ``none``, ``fp16``,
``powersgd:4``, ``topk:0.01``, ``topk:0.01,compact=1``) and delegates each bucket's encode,
further rounds and decode to the candidate it chose for that bucket, so every caller of the
:class:`Compressor` protocol (data-parallel optimizer, flat or hierarchical, hybrid mode's
data-parallel groups, parameter-server pushes) uses it unchanged.

How it decides (:mod:`parlay.compress.autocost`):

1. At the first step it times allreduces over the group (alpha, beta for fp32 and fp16), and
   at each bucket's first compress every candidate's encode/decode on that bucket. Every number
   is MAX-reduced over the group: each rank predicts from the same inputs, so ranks agree.
2. It predicts each candidate's time (codec plus its collectives on the fitted link, with the
   alpha-beta formulas of :mod:`parlay.plan.model`) and keeps the current choice unless another
   is predicted ``margin`` faster (hysteresis; at first ``none``; on one host 0.5 at least).
   Then it measures: every contender predicted within 30% of the best runs ``trial`` steps
   (default 3) and the fastest measured stays (:mod:`parlay.compress.autotrial`).
3. Every ``every`` steps the median step time (MAX over ranks) is compared with the one after
   the last decision; a change beyond ``threshold`` triggers a new measurement and decision,
   unless measuring has already taken more than ``budget`` (0.5%) of the time since the first
   step. The window after such a switch is compared with the one before it: if the step got
   slower by more than ``threshold / 2``, the switch is undone (the model was wrong here).

Error feedback stays exact across switches: when a bucket leaves a candidate that keeps a
residual (top-k, PowerSGD), the residual moves out of that candidate and is added to the
bucket's next gradient, whatever compressor sends it (``sent + kept == produced``).

Its choices are in :attr:`AutoCompressor.choices` (bucket key -> spec), its reasons in
:attr:`AutoCompressor.history`; each change is logged on logger ``parlay.compress``.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from parlay import comm
from parlay.compress import autocost
from parlay.compress.autoopts import DEFAULT_CANDIDATES, check_options
from parlay.compress.autotrial import Trial, contenders
from parlay.compress.autowire import AutoCtx, rebuild_ctx, wire_values
from parlay.compress.base import Compressor, get_compressor, register
from parlay.compress.feedback import parse_options
from parlay.errors import ConfigError

__all__ = ["AutoCompressor", "AutoCtx", "DEFAULT_CANDIDATES"]

log = logging.getLogger("parlay.compress")

class AutoCompressor(Compressor):
    """Choose per bucket among ``candidates`` from measured bandwidth and codec cost.

    Args:
        candidates: Compressor specs to choose from (``"none"``, ``"fp16"``, ``"bf16"``,
            ``"powersgd:R"``, ``"topk:RATIO"``, ``"randomk:RATIO"``); the first is used until
            the first decision and is the fallback.
        every: Steps between two checks of the step time (one 8-byte allreduce each).
        threshold: Relative change of the step time that triggers a new decision.
        margin: A candidate must be predicted this fraction faster than the current one to
            replace it.
        budget: Largest share of the run's time spent measuring before a new decision.
        trial: Steps each close contender of the first decision runs before the fastest
            measured is kept (0: trust the prediction).

    Raises:
        ConfigError: Unknown or duplicate candidates, or options out of range.
    """

    name = "auto"
    #: Describes the payload of the latest :meth:`compress` call: reduce_async reads it right
    #: after compress, so a bucket that chose top-k goes over allgather, the others allreduce.
    summable = True
    point_to_point = True
    decodes_into = True
    #: Every candidate encodes a*x as a times x's encoding (a > 0): scale before the sum.
    homogeneous = True
    #: The trial's contenders: predicted within this fraction of the best, at most this many.
    trial_within, trial_most = 0.3, 3

    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES, every: int = 20,
                 threshold: float = 0.2, margin: float = 0.25, budget: float = 0.005,
                 trial: int = 3) -> None:
        self.specs = check_options(candidates, every, threshold, margin, trial, budget)
        self.budget, self.trial = float(budget), int(trial)
        self.cands = {s: get_compressor(s) for s in self.specs}
        self.every, self.threshold, self.margin = int(every), float(threshold), float(margin)
        #: The trial under way (True: due at the next step), else None.
        self.trialing: Trial | bool | None = None
        self._margin = self.margin  # what a switch needs (bind: at least 0.5 on one host)
        #: Bucket key -> the spec it uses now.
        self.choices: dict[str, str] = {}
        #: (step, key, old, new, reason) for every change, oldest first.
        self.history: list[tuple[int, str, str | None, str, str]] = []
        #: Steps at which the link was measured and every bucket decided again.
        self.calibrations: list[int] = []
        #: ``hook(kind, name, seconds) -> seconds`` applied to every local time before it is
        #: reduced ("link", "codec", "step"); lets tests give ranks different timings.
        self.timing_hook: Any = None
        self._eligible = list(self.specs)
        self._group: Any = None
        self._world = 0
        self._collective = True
        self._layouts: dict[str, list[tuple[int, ...]]] = {}
        self._carry: dict[str, torch.Tensor] = {}
        self._forced: dict[str, str] = {}
        self._lead: str | None = None
        self._step = 0
        self._t_last: float | None = None
        self._intervals: list[float] = []
        self._ref: float | None = None
        self._verify: tuple[dict[str, str], float] | None = None
        self._decide_keys: set[str] | None = None
        # (key, spec) -> factor by which a switch to it, undone, measured slower: scales it.
        self._penalty: dict[tuple[str, str], float] = {}
        self._fit: autocost.LinkFit | None = None
        # Seconds spent measuring and deciding, and when the first step started (budget).
        self._spent = 0.0
        self._t0: float | None = None
        self._measured = False
        self.last_prediction: dict[str, dict[str, float]] = {}

    # ------------------------------------------------------------------ binding
    def bind(self, group: Any = None, *, collective: bool = True,
             summable_only: bool = False) -> None:
        """Say where this compressor reduces (the optimizer or PS worker calls it once).

        Args:
            group: The process group of the reduction; decisions are agreed over it.
            collective: ``False`` for parameter-server pushes: only one-round candidates,
                decided once at the first push (a collective over ``group``, the workers).
            summable_only: Only candidates whose payloads sum on the wire (hierarchical).

        Raises:
            ConfigError: No candidate fits.
        """
        ok = [s for s in self.specs
              if (collective or self.cands[s].point_to_point)
              and (not summable_only or self.cands[s].summable)]
        if not ok:
            raise ConfigError(f"auto compression: none of {self.specs} fits this reduction "
                              f"(point-to-point: {not collective}, summable only: "
                              f"{summable_only}). Hint: add 'none' or 'fp16' to the candidates.")
        self._eligible, self._group, self._collective = ok, group, collective
        self._margin = autocost.switch_margin(self.margin)  # every rank alike: one world
        # Without a process group (a single process) there is nothing to choose: the first.
        self._world = comm.group_size(group) if dist.is_initialized() else 1

    def __deepcopy__(self, memo: dict[int, Any]) -> "AutoCompressor":
        """A frozen twin: same candidates and current choices, but it never communicates or
        decides (it encodes with the choices it was copied with, else the first eligible
        candidate). A parameter server's setup probes such a copy on every rank, so the probe
        must not start a collective."""
        twin = AutoCompressor(self.specs, self.every, self.threshold, self.margin, self.budget,
                              self.trial)
        twin.choices, twin._eligible, twin._world = dict(self.choices), list(self._eligible), 1
        for k, v in self._layouts.items():
            twin.set_layout(k, v)
        return twin

    def set_layout(self, key: str, shapes: list[tuple[int, ...]]) -> None:
        self._layouts[key] = [tuple(int(d) for d in s) for s in shapes]
        for c in self.cands.values():
            c.set_layout(key, shapes)

    def force(self, key: str, spec: str) -> None:
        """Use ``spec`` for bucket ``key`` from its next compress (every rank must call it
        alike). For tests and for users who know better than the model."""
        if spec not in self.cands:
            raise ConfigError(f"auto compression: {spec!r} is not a candidate ({self.specs}).")
        self._forced[key] = spec

    def describe(self) -> str:
        """The choices as one line, e.g. ``"bucket0=topk:0.01 bucket1=none"``."""
        return " ".join(f"{k}={v}" for k, v in self.choices.items()) or "undecided"

    # ------------------------------------------------------------------ deciding
    def _time(self, kind: str, name: str, seconds: float) -> float:
        return float(self.timing_hook(kind, name, seconds)) if self.timing_hook else seconds

    def _switch(self, key: str, new: str, reason: str) -> None:
        old = self.choices.get(key)
        if old == new:
            return
        mem = getattr(self.cands[old], "memory", None) if old is not None else None
        if mem is not None:
            owed = mem.residual.pop(key, None)
            mem._spare.pop(key, None)  # noqa: SLF001 - its recycled buffer goes with it
            mem.velocity.pop(key, None)
            if owed is not None:
                prev = self._carry.get(key)
                self._carry[key] = owed if prev is None else prev + owed
        self.choices[key] = new
        self.history.append((self._step, key, old, new, reason))
        if old is not None:
            log.info("auto compression: %s %s -> %s (%s)", key, old, new, reason)

    def _on_lead(self, flat: torch.Tensor) -> None:
        """Start of a step (the first bucket's compress): step timing and its checks."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        last = now - self._t_last if self._t_last is not None and not self._measured else None
        if last is not None:
            self._intervals.append(last)  # (a step that measured is no sample)
        self._measured = False
        self._t_last = now
        self._step += 1
        self._decide_keys = None
        if self._step == 1:
            self._calibrate(flat)
            self.trialing = self._collective and self.trial > 0
        elif self.trialing:
            self._run_trial(last)
        elif self._collective and self._step % self.every == 0 and self._intervals:
            # (parameter-server pushes decide once: workers run different step counts in the
            # async and stale policies, so a periodic collective among them could wait forever)
            self._check(statistics.median(self._intervals))
            self._intervals = []

    def _run_trial(self, last: float | None) -> None:
        """One step of the trial: start it, hand the next contender its steps, or end it."""
        if self.trialing is True:
            opts = contenders(self.last_prediction, self.choices, self.trial_within,
                              self.trial_most)
            self.trialing = Trial(opts, self.trial, self.threshold / 4) if opts[1:] else None
        trial, why = self.trialing, "trial"
        if not isinstance(trial, Trial):
            return
        new = trial.next(last)
        if trial.done:  # every rank ends it at the same step: the medians are reduced together
            new, why = trial.winner(autocost.agreed_max(
                [self._time("trial", str(i), t) for i, t in enumerate(trial.measured)],
                self._group))
            self.trialing, self._intervals, self._ref, self._measured = None, [], None, True
        for k, s in (new or {}).items():
            self._switch(k, s, why)

    def _check(self, local: float) -> None:
        step_s = autocost.agreed_max([self._time("step", "median", local)], self._group)[0]
        if self._verify is not None:
            before_choices, before = self._verify
            self._verify = None
            if step_s > before * (1 + self.threshold / 2):
                for k, s in before_choices.items():
                    tried = self.choices.get(k)
                    if tried is not None and tried != s:
                        self._penalty[(k, tried)] = self._penalty.get((k, tried), 1.0) \
                            * step_s / before
                    self._switch(k, s, f"undone: step {step_s:.4f}s vs {before:.4f}s before")
                self._ref = before
                return
        if self._ref is None:
            self._ref = step_s
        elif abs(step_s - self._ref) > self.threshold * self._ref:
            elapsed = time.perf_counter() - (self._t0 or 0.0)
            # The budget check uses the slowest rank's share, so every rank agrees on it.
            share = autocost.agreed_max([self._spent / max(elapsed, 1e-9)], self._group)[0]
            if share > self.budget:
                self._ref = step_s  # measured enough lately: take the new step as normal
            else:
                self._calibrate(before=step_s)

    def _probe(self, flat: torch.Tensor | None = None) -> None:
        sizes = [sum(int(torch.Size(s).numel()) for s in v) * 4 for v in self._layouts.values()]
        if flat is not None:
            sizes.append(flat.numel() * flat.element_size())
        self._fit = autocost.probe_link(self._group, self._world, sizes, self.timing_hook)

    def _calibrate(self, flat: torch.Tensor | None = None, before: float | None = None) -> None:
        """Measure the link now; every bucket decides again at its compress this step."""
        t0 = time.perf_counter()
        self._probe(flat)
        self._measured = True
        self._spent += time.perf_counter() - t0
        self.calibrations.append(self._step)
        self._decide_keys = set()
        self._ref = None
        self._verify = (dict(self.choices), before) if before is not None and self.choices \
            else None

    def _decide(self, key: str, flat: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if self._fit is None:  # a bucket first seen after the first step
            self._probe(flat)
        assert self._fit is not None  # probed above or at this step's start
        shapes = self._layouts.get(key)
        # A candidate whose codec alone costs more than dense could win by is timed once only.
        enough = (autocost.predict_s("none", flat.numel(), self._fit, 0.0, shapes,
                                     self._collective) / (1 - self.margin)
                  if "none" in self._eligible else float("inf"))
        codec = [0.0 if s == "none" else self._time("codec", s, autocost.codec_seconds(
            s, flat, key, self._world, shapes, enough=enough)) for s in self._eligible]
        codec = autocost.agreed_max(codec, self._group)
        pred = {s: autocost.predict_s(s, flat.numel(), self._fit, c, shapes, self._collective)
                * self._penalty.get((key, s), 1.0) for s, c in zip(self._eligible, codec)}
        self.last_prediction[key] = pred
        cur = self.choices.get(key, self._eligible[0])
        best = min(pred, key=lambda s: (pred[s], self._eligible.index(s)))
        if cur not in pred or pred[best] < (1 - self._margin) * pred[cur]:
            cur = best
        why = ", ".join(f"{s} {v * 1e3:.2f}ms" for s, v in pred.items())
        self._switch(key, cur, f"predicted {why}")
        if self._decide_keys is not None:
            self._decide_keys.add(key)
        self._spent += time.perf_counter() - t0

    # ------------------------------------------------------------------ the protocol
    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        if not self._world:
            self.bind(None)
        if self._lead is None:
            self._lead = key
        if self._world > 1:
            if key == self._lead:
                self._on_lead(flat)
            if key in self._forced:
                self._switch(key, self._forced.pop(key), "forced")
            elif (self._decide_keys is not None and key not in self._decide_keys) \
                    or key not in self.choices:
                self._decide(key, flat)
        spec = self.choices.setdefault(key, self._eligible[0])
        cand = self.cands[spec]
        owed = self._carry.pop(key, None)
        x = flat if owed is None else flat + owed.to(flat.dtype)
        payload, inner = cand.compress(x, key)
        self.summable = cand.summable  # type: ignore[misc]  # for reduce_async, see above
        return payload, AutoCtx(self.specs.index(spec), inner, wire_values(inner, flat))

    def _cand(self, ctx: Any) -> tuple[Compressor, Any]:
        cand = self.cands[self.specs[ctx.choice]]
        inner = ctx.inner if ctx.inner is not None or not ctx.wire else rebuild_ctx(cand, ctx.wire)
        return cand, inner

    def next_round(self, reduced: list[torch.Tensor], ctx: Any) -> list[torch.Tensor] | None:
        cand, inner = self._cand(ctx)
        return cand.next_round(reduced, inner)

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        cand, inner = self._cand(ctx)
        if out is not None and cand.decodes_into:
            return cand.decompress(payload, inner, out=out)  # type: ignore[call-arg]
        return cand.decompress(payload, inner)

    def aggregate(self, payloads: list[list[torch.Tensor]], ctx: Any,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        cand, inner = self._cand(ctx)
        if out is not None and cand.decodes_into:
            return cand.aggregate(payloads, inner, out=out)  # type: ignore[call-arg]
        return cand.aggregate(payloads, inner)

    # ------------------------------------------------------------------ state
    def residual(self, key: str) -> torch.Tensor | None:
        """What this rank still owes for bucket ``key`` (carried plus the current candidate's
        residual), or ``None`` when nothing is owed."""
        parts = [self._carry.get(key)]
        mem = getattr(self.cands.get(self.choices.get(key, ""), None), "memory", None)
        if mem is not None:
            parts.append(mem.residual.get(key))
        parts = [p for p in parts if p is not None]
        return sum(parts[1:], parts[0].clone()) if parts else None

    def state_dict(self) -> dict[str, Any]:
        return {"choices": dict(self.choices), "step": self._step,
                "carry": {k: v.clone() for k, v in self._carry.items()},
                "cands": {s: c.state_dict() for s, c in self.cands.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        choices = state.get("choices", {})
        if not isinstance(choices, dict) or any(v not in self.cands for v in choices.values()):
            raise ConfigError(f"auto compression state chose {choices!r}, but the candidates "
                              f"are {self.specs}. Hint: resume with the same candidates.")
        self.choices = {str(k): str(v) for k, v in choices.items()}
        self._step = int(state.get("step", 0))
        self._carry = {str(k): v.detach().clone() for k, v in state.get("carry", {}).items()}
        for s, sd in state.get("cands", {}).items():
            if s in self.cands:
                self.cands[s].load_state_dict(sd)
        self._t_last, self._intervals, self._ref, self._verify = None, [], None, None
        self.trialing = None

    def __repr__(self) -> str:
        return f"AutoCompressor(candidates={self.specs})"


def _make(*args: str) -> Compressor:
    o = parse_options(args, [], {"candidates": str, "every": int, "threshold": float,
                                 "margin": float, "budget": float, "trial": int}, "auto")
    cands = o.pop("candidates", None)
    if cands is not None:
        o["candidates"] = [c for c in cands.split("+") if c]
    return AutoCompressor(**o)


register("auto", _make)
