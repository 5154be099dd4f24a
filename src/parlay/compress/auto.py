"""``compression="auto"``: per bucket, the candidate the measured link and CPU make fastest.

:class:`AutoCompressor` holds one instance of each candidate (default ``none``, ``fp16``,
``powersgd:4``, ``topk:0.01``, ``topk:0.01,compact=1``) and delegates each bucket's encode,
further rounds and decode to the candidate it chose for that bucket, so every caller of the
:class:`Compressor` protocol (data-parallel optimizer, flat or hierarchical, hybrid mode's
data-parallel groups, parameter-server pushes) uses it unchanged.

One decision per bucket, at its first reduction: the link is timed once (allreduces of two fp32
sizes and one fp16 size, fitted to ``alpha + bytes * beta``), every eligible candidate's codec
is timed on the bucket, and every number is MAX-reduced over the group, so each rank prices the
candidates from the same inputs and all choose alike. A candidate's price is its codec time
plus its own collectives (:meth:`Compressor.wire_rounds`) on the fitted link (the measuring
is :mod:`parlay.compress.measure`). The first candidate is kept unless another is predicted
``margin`` faster (at least 0.5 when every rank shares one host: there the "link" is the same
CPU the codecs use, and both measure noisily).
One short trial then confirms it: when another single candidate for every bucket was predicted
within 30% of the decision, both run ``trial`` steps and the other replaces the decision only if
its median step (MAX over the ranks) is 5% faster.

Error feedback stays exact across switches: a bucket leaving a candidate that keeps a residual
(top-k, PowerSGD) carries it to its next gradient, whatever sends it (``sent + kept ==
produced``). Choices are in :attr:`AutoCompressor.choices`, reasons in :attr:`history`.
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm
from parlay.compress.base import Compressor, Round, get_compressor, register
from parlay.compress.feedback import parse_options
from parlay.compress.measure import (Hook, LinkFit, agreed_max, codec_seconds, predict_s,
                                     probe_link)
from parlay.errors import ConfigError

__all__ = ["AutoCompressor", "AutoCtx", "DEFAULT_CANDIDATES", "switch_margin"]

log = logging.getLogger("parlay.compress")

#: top-k on both wires: the compact one (4 bytes a coordinate) wins where bytes cost, the plain
#: one (8) where they don't.
DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:4", "topk:0.01", "topk:0.01,compact=1")
#: Least margin for a switch when every rank runs on one host (see the module docstring).
ONE_HOST_MARGIN = 0.5
#: The trial runs the best other uniform choice when predicted within this fraction, and it
#: replaces the decision only when measured this fraction faster (a busy host's noise).
TRIAL_WITHIN, TRIAL_GAIN = 0.3, 0.05
_WIRE = 4  # plain values an AutoCtx carries for its candidate's context (padded with None)


@dataclass
class AutoCtx:
    """Which candidate encoded a payload (index into the specs), its own context (local only)
    and the plain values that rebuild that context in another process (a parameter server)."""

    choice: int
    inner: Any = None
    wire: tuple[Any, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {"choice": self.choice, "wire": self.wire}

    def __copy__(self) -> AutoCtx:
        return AutoCtx(self.choice, None, self.wire)


def switch_margin(margin: float) -> float:
    """``margin``, at least :data:`ONE_HOST_MARGIN` when the parlay world runs on one host."""
    from parlay import runtime  # a lower layer; lazily, as comm does

    one_host = runtime.is_initialized() and runtime.cluster().one_host
    return max(margin, ONE_HOST_MARGIN) if one_host else margin


class _Trial:
    """Two assignments (bucket -> spec), the decision first, ``steps`` steps each."""

    def __init__(self, options: list[dict[str, str]], steps: int) -> None:
        self.options, self.steps = options, steps
        self.times: list[float] = []
        self.medians: list[float] = []


class AutoCompressor(Compressor):
    """Choose per bucket among ``candidates`` from measured bandwidth and codec cost.

    Args:
        candidates: Registered compressor specs to choose from; the first is kept unless
            another is predicted ``margin`` faster, and is the fallback.
        margin: How much faster (a fraction) another candidate must be predicted.
        trial: Steps each of the two close contenders runs in the confirming trial (0: none).

    Raises:
        ConfigError: Unknown or duplicate candidates, or options out of range.
    """

    name = "auto"
    summable = True  # per payload: see is_summable
    point_to_point = True
    decodes_into = True
    homogeneous = True  # every candidate encodes a*x as a times x's encoding (a > 0)

    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES, margin: float = 0.25,
                 trial: int = 3) -> None:
        if isinstance(candidates, str) or not candidates:
            raise ConfigError(f"auto compression needs a non-empty list of candidate specs, "
                              f"got {candidates!r}. Hint: ['none', 'fp16', 'topk:0.01'].")
        self.specs = [str(c).strip().lower() for c in candidates]
        if len(set(self.specs)) != len(self.specs):
            raise ConfigError(f"auto compression candidates repeat: {self.specs}.")
        self.cands = {s: get_compressor(s) for s in self.specs}
        self.shared_ctx = all(c.summable or c.shared_ctx  # type: ignore[misc]
                              for c in self.cands.values())
        if any(isinstance(c, AutoCompressor) for c in self.cands.values()):
            raise ConfigError("auto compression cannot choose 'auto' among its candidates.")
        if isinstance(trial, bool) or int(trial) != trial or trial < 0:
            raise ConfigError(f"auto trial must be an integer >= 0 (steps), got {trial!r}.")
        if not 0 <= float(margin) < 1:
            raise ConfigError(f"auto margin must be in [0, 1), got {margin!r}. Hint: 0.25.")
        self.margin, self.trial = float(margin), int(trial)
        #: Bucket key -> the spec it uses now.
        self.choices: dict[str, str] = {}
        #: (step, key, old, new, reason) for every change, oldest first.
        self.history: list[tuple[int, str, str | None, str, str]] = []
        #: Bucket key -> {spec: predicted seconds} of its decision.
        self.last_prediction: dict[str, dict[str, float]] = {}
        #: The trial under way (True: due at the next step), else None.
        self.trialing: _Trial | bool | None = None
        #: ``hook(kind, name, seconds) -> seconds`` on every local time before it is reduced
        #: ("link", "codec", "trial"): lets tests give ranks different timings.
        self.timing_hook: Hook | None = None
        self._eligible, self._margin = list(self.specs), self.margin
        self._group: Any = None
        self._world, self._collective = 0, True
        self._layouts: dict[str, list[tuple[int, ...]]] = {}
        self._carry: dict[str, torch.Tensor] = {}
        self._forced: dict[str, str] = {}
        self._lead: str | None = None
        self._step = 0
        self._t_last: float | None = None
        self._fit: LinkFit | None = None

    def bind(self, group: Any = None, *, collective: bool = True,
             summable_only: bool = False) -> None:
        """Say where this compressor reduces (the optimizer or PS worker calls it once).

        Args:
            group: The process group of the reduction; decisions are agreed over it.
            collective: ``False`` for parameter-server pushes: one-round candidates only.
            summable_only: Only candidates whose payloads sum on the wire (hierarchical).

        Raises:
            ConfigError: No candidate fits.
        """
        ok = [s for s in self.specs if (collective or self.cands[s].point_to_point)
              and (not summable_only or self.cands[s].summable)]
        if not ok:
            raise ConfigError(f"auto compression: none of {self.specs} fits this reduction "
                              f"(point-to-point: {not collective}, summable only: "
                              f"{summable_only}). Hint: add 'none' or 'fp16' to the candidates.")
        self._eligible, self._group, self._collective = ok, group, collective
        self._margin = switch_margin(self.margin)
        self._world = comm.group_size(group) if dist.is_initialized() else 1

    def __deepcopy__(self, memo: dict[int, Any]) -> AutoCompressor:
        """A frozen twin that never communicates or decides (a parameter server's setup
        probes such a copy on every rank): it encodes with the choices it was copied with."""
        twin = AutoCompressor(self.specs, self.margin, self.trial)
        twin.choices, twin._eligible, twin._world = dict(self.choices), list(self._eligible), 1
        for k, v in self._layouts.items():
            twin.set_layout(k, v)
        return twin

    def set_layout(self, key: str, shapes: list[tuple[int, ...]]) -> None:
        self._layouts[key] = [tuple(int(d) for d in s) for s in shapes]
        for c in self.cands.values():
            c.set_layout(key, shapes)

    def force(self, key: str, spec: str) -> None:
        """Use ``spec`` for bucket ``key`` from its next compress (every rank alike)."""
        if spec not in self.cands:
            raise ConfigError(f"auto compression: {spec!r} is not a candidate ({self.specs}).")
        self._forced[key] = spec

    def describe(self) -> str:
        """The choices as one line, e.g. ``"bucket0=topk:0.01 bucket1=none"``."""
        return " ".join(f"{k}={v}" for k, v in self.choices.items()) or "undecided"

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4) -> list[Round]:
        raise ConfigError("compression 'auto' chooses at run time from what it measures; the "
                          "cost model prices its candidates instead. Hint: --compressors "
                          "none,fp16,topk:0.01,powersgd:4.")

    # ------------------------------------------------------------------ deciding
    def _time(self, kind: str, name: str, seconds: float) -> float:
        return float(self.timing_hook(kind, name, seconds)) if self.timing_hook else seconds

    def _switch(self, key: str, new: str, reason: str) -> None:
        old = self.choices.get(key)
        if old == new:
            return
        mem = getattr(self.cands[old], "memory", None) if old is not None else None
        owed = mem.take(key) if mem is not None else None
        if owed is not None:
            prev = self._carry.get(key)
            self._carry[key] = owed if prev is None else prev + owed
        self.choices[key] = new
        self.history.append((self._step, key, old, new, reason))
        log.info("auto compression: %s %s %s (%s)", key, f"{old} ->" if old else "starts with",
                 new, reason)

    def _decide(self, key: str, flat: torch.Tensor) -> None:
        if flat.is_complex():  # not every candidate takes it (PowerSGD's factors are real)
            self._switch(key, self._eligible[0], "complex gradients")
            return
        if self._fit is None:  # once: every bucket's size known so far sizes the probe
            sizes = [sum(math.prod(s) for s in v) * 4 for v in self._layouts.values()]
            self._fit = probe_link(self._group, sizes + [flat.numel() * flat.element_size()],
                                   self.timing_hook)
        shapes, n = self._layouts.get(key), flat.numel()
        first = self.cands[self._eligible[0]]
        enough = predict_s(first, n, shapes, self._fit, self._world, 0.0, self._collective) \
            / (1 - self._margin)  # a codec alone slower than that cannot win: timed once
        codec = agreed_max([self._time("codec", s, codec_seconds(
            s, flat, key, self._world, shapes, enough)) for s in self._eligible], self._group)
        pred = {s: predict_s(self.cands[s], n, shapes, self._fit, self._world, c,
                             self._collective) for s, c in zip(self._eligible, codec)}
        self.last_prediction[key] = pred
        best = min(pred, key=lambda s: (pred[s], self._eligible.index(s)))
        keep = self._eligible[0]
        choice = best if pred[best] < (1 - self._margin) * pred[keep] else keep
        self._switch(key, choice, "predicted " + ", ".join(
            f"{s} {v * 1e3:.2f}ms" for s, v in pred.items()))
        if self._collective and self.trial and self.trialing is None and self._step <= 1:
            self.trialing = True

    def _trial_options(self) -> list[dict[str, str]]:
        """The decided choices and, if predicted within TRIAL_WITHIN of them, the best other
        single candidate for every bucket."""
        keys = [k for k in self.choices if k in self.last_prediction]
        if not keys:
            return []
        decided = {k: self.choices[k] for k in keys}
        total = sum(self.last_prediction[k][s] for k, s in decided.items())
        uniform = [({k: s for k in keys}, sum(self.last_prediction[k][s] for k in keys))
                   for s in self._eligible]
        others = sorted((t, i) for i, (a, t) in enumerate(uniform) if a != decided)
        if not others or others[0][0] > (1 + TRIAL_WITHIN) * min(total, others[0][0]):
            return []
        return [decided, uniform[others[0][1]][0]]

    def _on_lead(self) -> None:
        """The start of a step (its first bucket's compress): run the trial's schedule."""
        now = time.perf_counter()
        last = None if self._t_last is None else now - self._t_last
        self._t_last, self._step = now, self._step + 1
        if self.trialing is True:  # the step after the decision: start the trial
            options = self._trial_options()
            self.trialing = _Trial(options, self.trial) if options else None
            return
        trial = self.trialing
        if not isinstance(trial, _Trial) or last is None:
            return
        trial.times.append(last)
        if len(trial.times) < trial.steps:
            return
        trial.medians.append(statistics.median(trial.times))
        trial.times = []
        if len(trial.medians) < len(trial.options):
            for k, s in trial.options[len(trial.medians)].items():
                self._switch(k, s, "trial")
            return
        agreed = agreed_max([self._time("trial", str(i), t)
                             for i, t in enumerate(trial.medians)], self._group)
        won = 1 if agreed[1] < (1 - TRIAL_GAIN) * agreed[0] else 0  # noise keeps the decision
        names = ["+".join(sorted(set(a.values()))) for a in trial.options]
        why = "trial: " + ", ".join(f"{n} {t * 1e3:.2f}ms" for n, t in zip(names, agreed))
        for k, s in trial.options[won].items():
            self._switch(k, s, why)
        log.info("auto compression: the trial keeps %s (%s)", names[won], why)
        self.trialing = None

    # ------------------------------------------------------------------ the protocol
    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        if not self._world:
            self.bind(None)
        if self._lead is None:
            self._lead = key
        if self._world > 1:
            if key == self._lead and self._collective:
                self._on_lead()
            if key in self._forced:
                self._switch(key, self._forced.pop(key), "forced")
            elif key not in self.choices:
                self._decide(key, flat)
        spec = self.choices.setdefault(key, self._eligible[0])
        cand = self.cands[spec]
        owed = self._carry.pop(key, None)
        payload, inner = cand.compress(flat if owed is None else flat + owed.to(flat.dtype), key)
        wire = tuple(cand.ctx_to_wire(inner))
        if len(wire) > _WIRE:
            raise ConfigError(f"auto compression: candidate {spec!r} needs {len(wire)} context "
                              f"values on the wire, more than {_WIRE}.")
        return payload, AutoCtx(self.specs.index(spec), inner, wire + (None,) * (_WIRE - len(wire)))

    def _cand(self, ctx: Any) -> tuple[Compressor, Any]:
        cand = self.cands[self.specs[ctx.choice]]
        return cand, ctx.inner if ctx.inner is not None else cand.ctx_from_wire(ctx.wire)

    def is_summable(self, ctx: Any) -> bool:
        return self.cands[self.specs[ctx.choice]].summable

    def next_round(self, reduced: list[torch.Tensor], ctx: Any) -> list[torch.Tensor] | None:
        cand, inner = self._cand(ctx)
        return cand.next_round(reduced, inner)

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        cand, inner = self._cand(ctx)
        if out is not None and cand.decodes_into:
            return cand.decompress(payload, inner, out=out)
        return cand.decompress(payload, inner)

    def aggregate(self, payloads: list[list[torch.Tensor]], ctx: Any,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        cand, inner = self._cand(ctx)
        if out is not None and cand.decodes_into:
            return cand.aggregate(payloads, inner, out=out)
        return cand.aggregate(payloads, inner)

    # ------------------------------------------------------------------ state
    def residual(self, key: str) -> torch.Tensor | None:
        """What this rank still owes for bucket ``key`` (carried plus the current candidate's
        residual), or ``None`` when nothing is owed."""
        mem = getattr(self.cands.get(self.choices.get(key, ""), None), "memory", None)
        parts = [p for p in (self._carry.get(key), mem.residual.get(key) if mem else None)
                 if p is not None]
        return sum(parts[1:], parts[0].clone()) if parts else None

    def rescale_owed(self, factor: float) -> None:
        for c in self.cands.values():
            c.rescale_owed(factor)
        for t in self._carry.values():
            t.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        t = self.trialing  # a trial under way goes on after a resume, from what it measured
        trial = copy.deepcopy(vars(t)) if isinstance(t, _Trial) else t
        return {"choices": dict(self.choices), "step": self._step, "history": list(self.history),
                "carry": {k: v.clone() for k, v in self._carry.items()},
                "cands": {s: c.state_dict() for s, c in self.cands.items()},
                "trial": trial, "prediction": {k: dict(v) for k, v in self.last_prediction.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        choices = state.get("choices", {})
        if not isinstance(choices, dict) or any(v not in self.cands for v in choices.values()):
            raise ConfigError(f"auto compression state chose {choices!r}, but the candidates "
                              f"are {self.specs}. Hint: resume with the same candidates.")
        self.choices = {str(k): str(v) for k, v in choices.items()}
        self.history = [tuple(h) for h in state.get("history", [])]
        self._step = int(state.get("step", 0))
        self._carry = {str(k): v.detach().clone() for k, v in state.get("carry", {}).items()}
        for s, sd in state.get("cands", {}).items():
            if s in self.cands:
                self.cands[s].load_state_dict(sd)
        self.last_prediction = {str(k): dict(v) for k, v in state.get("prediction", {}).items()}
        trial = state.get("trial")
        self.trialing = trial is True or None
        if isinstance(trial, dict):
            t = self.trialing = _Trial(list(trial["options"]), int(trial["steps"]))
            t.times, t.medians = list(trial["times"]), list(trial["medians"])
        self._t_last = None  # the step spanning the restart is not timed
        self._redecide({k for k, v in self.choices.items() if v not in self._eligible})

    def _redecide(self, keys: set[str]) -> None:
        """Decide ``keys`` anew at their next compress: a resumed choice this reduction cannot
        carry (top-k saved by a flat run, resumed host-first). What it owes is carried."""
        if not keys:
            return
        warnings.warn(f"auto compression: the resumed choices {sorted(keys)} are not eligible "
                      f"here (eligible: {self._eligible}); they are decided anew.", stacklevel=3)
        for k in keys:
            mem = getattr(self.cands[self.choices.pop(k)], "memory", None)
            owed = mem.take(k) if mem is not None else None
            if owed is not None:
                self._carry[k] = owed if k not in self._carry else self._carry[k] + owed
        t = self.trialing
        if isinstance(t, _Trial) and any(s not in self._eligible
                                         for o in t.options for s in o.values()):
            self.trialing = None

    def __repr__(self) -> str:
        extra = "" if self.margin == 0.25 else f", margin={self.margin}"  # every option off
        extra += "" if self.trial == 3 else f", trial={self.trial}"  # its default (ranks compare)
        return f"AutoCompressor(candidates={self.specs}{extra})"


def _make(*args: str) -> Compressor:
    # A candidate's own options follow it after commas ("candidates=none+topk:0.01,compact=1"):
    # what is not one of auto's options belongs to the candidate before it.
    types = {"candidates": str, "margin": float, "trial": int}
    merged: list[str] = []
    for a in args:
        if merged and merged[-1].startswith("candidates=") and a.partition("=")[0] not in types:
            merged[-1] += "," + a
        else:
            merged.append(a)
    o = parse_options(merged, [], types, "auto")
    cands = o.pop("candidates", None)
    if cands is not None:
        o["candidates"] = [c for c in cands.split("+") if c]
    return AutoCompressor(**o)


register("auto", _make)
