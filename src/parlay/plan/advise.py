"""Predictions, rankings and a recommendation over every mode x compressor (pure).

``predict(workload, cluster, "allreduce", "topk:0.01")`` is one configuration;
``rank_configs`` predicts every supported one, fastest to accuracy first (step time x the
compressor's measured convergence factor, :meth:`Compressor.convergence`); ``recommend`` picks
the first and says why (the term that dominates its step, and what dense loses to it). A
compressor without a finite measured factor is never recommended (:func:`excluded` says why).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parlay.errors import ConfigError
from parlay.plan.model import ClusterSpec, Costs, Workload, compressor_of
from parlay.plan.modes import (DILOCO_TARGET, allreduce_terms, default_chunks, diloco_h,
                               diloco_link_bytes, diloco_terms, hierarchical_terms, hybrid_terms,
                               ps_terms)
from parlay.plan.units import format_bytes, format_count

__all__ = ["Prediction", "MODES", "ALL_MODES", "COMPRESSORS", "predict", "rank_configs",
           "recommend", "explain", "excluded", "by_accuracy", "convergence_table", "diloco_advice",
           "mode_takes", "mode_variants"]

#: Compressors ``rank_configs`` tries by default.
COMPRESSORS = ("none", "fp16", "bf16", "topk:0.01", "randomk:0.01", "powersgd:4")

_TERM_HINT = {
    "compute": "computing the batch itself: a faster device or more ranks help, "
               "compression cannot",
    "codec": "compression's own CPU work dominates: a cheaper compressor (fp16) or none",
    "comm": "gradient communication dominates: compress harder or get a faster link",
    "comm-inter": "the host links dominate: compress harder or get a faster network",
    "comm-intra": "traffic inside hosts dominates: a faster intra-host bus (NVLink) helps",
    "push": "workers' pushes to the servers dominate: more servers or compressed pushes",
    "pull": "pulling parameters dominates: more servers (each carries workers/servers models)",
    "apply": "the servers' updates dominate: more servers",
    "server-links": "the servers' links are saturated: add servers",
    "bubble": "the pipeline bubble dominates: more micro-batches (chunks) or fewer stages",
    "activations": "activations between stages dominate: keep stages on one host, or bf16 "
                   "activations",
}


@dataclass(frozen=True)
class Prediction:
    """The model's estimate of one configuration.

    Attributes:
        mode: One of :data:`MODES`.
        compressor: Compression string as given (``"none"`` when uncompressed).
        step_s: Predicted seconds per training step.
        samples_per_s: Global samples per second (``batch * world / step_s``).
        terms: Seconds per term; they add up to ``step_s``.
        dominant: The largest term.
        options: Mode options used (consistency, servers, stages, chunks...).
        factor: The compressor's convergence factor (steps to the accuracy target relative to
            dense; ``math.inf``: never reached it; ``None``: unmeasured).
        exact: Whether the mode keeps data parallel's optimisation (not async parameter
            servers, not diloco's local steps): only those are ranked for a recommendation.
    """

    mode: str
    compressor: str
    step_s: float
    samples_per_s: float
    terms: dict[str, float]
    dominant: str
    options: dict[str, Any] = field(default_factory=dict)
    factor: float | None = None
    exact: bool = True

    @property
    def utilisation(self) -> float:
        """Compute's share of the step (1: communication entirely hidden or absent)."""
        return self.terms.get("compute", 0.0) / self.step_s if self.step_s > 0 else 1.0

    @property
    def to_accuracy_s(self) -> float:
        """Step time x convergence factor, what configurations are ranked by: seconds per step
        of dense training's progress (``inf`` without a finite factor: never recommended)."""
        f = self.factor
        return self.step_s * f if f is not None and math.isfinite(f) else math.inf

    @property
    def factor_text(self) -> str:
        """The convergence factor as shown: ``1.05``, ``never`` or ``unmeasured``."""
        if self.factor is None:
            return "unmeasured"
        return "never" if math.isinf(self.factor) else f"{self.factor:.2f}"

    @property
    def label(self) -> str:
        """A short name, e.g. ``ps(sync, 4 servers) + topk:0.01``."""
        opts = ", ".join(f"{v}" if k == "consistency" else f"{v} {k}"
                         for k, v in self.options.items())
        mode = f"{self.mode}({opts})" if opts else self.mode
        return mode if self.compressor == "none" else f"{mode} + {self.compressor}"


@dataclass(frozen=True)
class _Mode:
    """How ``predict`` prices one mode: its terms, the options it shows, the variants
    ``rank_configs`` tries, the options the command passes it, and whether it keeps data
    parallel's semantics (``exact``)."""

    terms: Callable[..., dict[str, float]]
    shown: Callable[[dict[str, Any], ClusterSpec], dict[str, Any]] = lambda o, c: {}
    variants: Callable[[Workload, ClusterSpec], list[dict[str, Any]]] = lambda w, c: [{}]
    takes: tuple[str, ...] = ()
    exact: Callable[[dict[str, Any]], bool] = lambda o: True
    resolve: Callable[..., dict[str, Any]] = lambda w, c, comp, costs, o: o


def _hybrid_variants(w: Workload, c: ClusterSpec) -> list[dict[str, Any]]:
    return [{"stages": p} for p in (2, 4, 8) if c.world % p == 0 and p <= c.world
            and (w.layers is None or p <= w.layers)]


def _hybrid_resolve(w: Workload, c: ClusterSpec, comp: str, costs: Costs,
                    opts: dict[str, Any]) -> dict[str, Any]:
    """hybrid's options with the micro-batches it is priced at (shown in its label)."""
    if opts.get("chunks") is None:
        opts = {**opts, "chunks": default_chunks(w, opts.get("stages", 2))}
    return opts


def _diloco_resolve(w: Workload, c: ClusterSpec, comp: str, costs: Costs,
                    opts: dict[str, Any]) -> dict[str, Any]:
    """diloco's options with ``sync_every`` picked (:func:`diloco_h`) when not given."""
    if opts.get("sync_every") is None:
        opts = {**opts, "sync_every": diloco_h(w, c, comp, costs, opts.get("fragments", 1),
                                               opts.get("overlap", 0))}
    return opts


_MODES: dict[str, _Mode] = {
    "allreduce": _Mode(allreduce_terms),
    "hierarchical": _Mode(hierarchical_terms, variants=lambda w, c: [{}] if c.nodes > 1
                          and c.ranks_per_node > 1 else []),
    "ps": _Mode(ps_terms, lambda o, c: {"consistency": o.get("consistency", "sync"),
                                        "servers": o.get("servers") or c.nodes},
                lambda w, c: [{"consistency": "sync"}, {"consistency": "async"}], ("servers",),
                lambda o: o.get("consistency", "sync") == "sync"),
    "hybrid": _Mode(hybrid_terms, lambda o, c: {"stages": o.get("stages", 2)}
                    | {k: o[k] for k in ("chunks", "schedule") if k in o},
                    _hybrid_variants, ("stages", "chunks"),
                    resolve=_hybrid_resolve),
    "diloco": _Mode(diloco_terms, lambda o, c: {"sync_every": o["sync_every"]}
                    | {k: o[k] for k in ("fragments", "overlap") if o.get(k)
                       and (k, o[k]) != ("fragments", 1)},
                    takes=("sync_every", "fragments", "overlap"), exact=lambda o: False,
                    resolve=_diloco_resolve),
}
#: Modes the model covers (``ps`` takes ``consistency=``, ``hybrid`` takes ``stages=``,
#: ``diloco`` takes ``sync_every=``, ``fragments=``, ``overlap=``).
ALL_MODES = tuple(_MODES)
#: What ``rank_configs`` compares by default: the modes whose step is data parallel's step.
MODES = tuple(m for m in ALL_MODES if m != "diloco")


def _mode(mode: str) -> _Mode:
    if mode not in _MODES:
        raise ConfigError(f"mode must be one of {', '.join(ALL_MODES)}, got {mode!r}.")
    return _MODES[mode]


def predict(workload: Workload, cluster: ClusterSpec, mode: str = "allreduce",
            compressor: str | None = "none", costs: Costs | None = None,
            **opts: Any) -> Prediction:
    """Predict one training step.

    Args:
        workload: Model size, batch, compute time per sample.
        cluster: Hosts, ranks per host, links.
        mode: One of :data:`MODES`.
        compressor: ``"none"``, ``"fp16"``, ``"bf16"``, ``"topk:R"``, ``"randomk:R"``,
            ``"powersgd:RANK"``.
        costs: Machine constants (default: :class:`Costs` defaults; see
            :func:`parlay.plan.calibrate.load_costs` for this machine's).
        **opts: ``bucket_bytes`` (allreduce, hierarchical, hybrid); ``consistency`` ("sync",
            "async", "stale:s"), ``servers``, ``server_link`` (ps); ``stages``, ``chunks``,
            ``schedule`` (hybrid); ``sync_every`` (default: :func:`diloco_h`'s pick),
            ``fragments``, ``overlap`` (diloco: one inner step; its convergence factor is
            its compressor's, i.e. equal progress per sample to data parallel is assumed).

    Returns:
        The prediction; ``terms`` add up to ``step_s``.

    Raises:
        ConfigError: Unknown mode or compressor, an option the mode does not take, or a
            configuration the mode cannot run (e.g. more stages than layers).
    """
    costs = costs or Costs()
    comp = "none" if compressor is None else str(compressor).strip().lower()
    # an unknown name or bad options: refused before any formula
    factor = compressor_of(comp).convergence(convergence_table()["factors"])
    m = _mode(mode)
    try:
        opts = m.resolve(workload, cluster, comp, costs, opts)
        terms = m.terms(workload, cluster, comp, costs, **opts)
    except TypeError as e:
        raise ConfigError(f"option not understood by mode {mode!r}: {e}") from None
    step = sum(terms.values())
    return Prediction(mode, comp, step, workload.batch * cluster.world / step if step > 0
                      else float("inf"), terms, max(terms, key=terms.__getitem__),
                      m.shown(opts, cluster), factor, m.exact(opts))


@functools.lru_cache(maxsize=1)
def convergence_table() -> dict[str, Any]:
    """The measured convergence factors (``python benchmarks/convergence.py --write``; see
    docs/benchmarks.md): ``factors`` and ``best`` accuracy keyed by compressor ``repr``
    (a factor of ``math.inf``: never reached the accuracy ``target``)."""
    doc = json.loads(Path(__file__).with_name("convergence.json").read_text())
    key = {s: repr(compressor_of(s)) for s in doc["factors"]}
    return {"target": doc["target"], "best": {key[s]: doc["best_accuracy"][s] for s in key},
            "factors": {key[s]: math.inf if f is None else float(f)
                        for s, f in doc["factors"].items()}}


def excluded(predictions: Iterable[Prediction]) -> list[str]:
    """Why each compressor among ``predictions`` that is never recommended is left out."""
    table, out = convergence_table(), {}
    for p in predictions:
        if p.factor is None:
            out[p.compressor] = f"{p.compressor}: no measured convergence factor " \
                                "(python benchmarks/convergence.py measures it)"
        elif math.isinf(p.factor):
            best = table["best"].get(repr(compressor_of(p.compressor)), "?")
            out[p.compressor] = f"{p.compressor}: never reached the accuracy target " \
                                f"({table['target']}; its best {best}%)"
    return list(out.values())


def by_accuracy(predictions: Iterable[Prediction]) -> list[Prediction]:
    """Fastest to the accuracy target first; those without a finite factor last, by step."""
    return sorted(predictions, key=lambda p: (p.to_accuracy_s, p.step_s))


def _variants(workload: Workload, cluster: ClusterSpec,
              modes: Sequence[str]) -> Iterable[tuple[str, dict[str, Any]]]:
    for mode in modes:
        for opts in _mode(mode).variants(workload, cluster):
            yield mode, opts


def rank_configs(workload: Workload, cluster: ClusterSpec, modes: Sequence[str] = MODES,
                 compressors: Sequence[str] = COMPRESSORS, costs: Costs | None = None,
                 include_async: bool = True) -> list[Prediction]:
    """Predict every mode x compressor this cluster can run, fastest to accuracy first
    (:func:`by_accuracy`).

    Combinations a mode cannot run (PowerSGD on parameter servers, top-k hierarchically,
    hybrid stages that do not divide the ranks) are left out. ``include_async=False`` keeps
    only modes with synchronous (allreduce-equivalent) semantics (no async parameter servers,
    no diloco: :func:`diloco_advice` says when that pays).
    """
    out = []
    for mode, opts in _variants(workload, cluster, modes):
        if not include_async and not _mode(mode).exact(opts):
            continue
        single_pipeline = mode == "hybrid" and cluster.world == opts.get("stages")
        for comp in compressors:
            if single_pipeline and comp != compressors[0]:
                continue  # one replica: no gradient is reduced, compressors change nothing
            if single_pipeline:
                comp = "none"
            try:
                out.append(predict(workload, cluster, mode, comp, costs, **opts))
            except ConfigError:
                continue
    return by_accuracy(out)


def recommend(workload: Workload, cluster: ClusterSpec, modes: Sequence[str] = MODES,
              compressors: Sequence[str] = COMPRESSORS, costs: Costs | None = None,
              include_async: bool = False) -> tuple[Prediction, str]:
    """The fastest configuration to accuracy and a sentence saying why.

    Asynchronous parameter servers change the optimisation (stale gradients), so they are only
    recommended with ``include_async=True``.

    Raises:
        ConfigError: Nothing can run, or nothing that can has a finite convergence factor.
    """
    ranked = rank_configs(workload, cluster, modes, compressors, costs, include_async)
    if not ranked:
        raise ConfigError("no mode x compressor combination can run on this cluster. "
                          "Hint: check --nodes, --gpus-per-node and --stages.")
    return ranked[0], explain(ranked)


def explain(ranked: Sequence[Prediction]) -> str:
    """Why the first of ``ranked`` wins: its dominant term and what dense allreduce takes.

    Raises:
        ConfigError: No configuration of ``ranked`` has a finite convergence factor.
    """
    ok = [p for p in ranked if math.isfinite(p.to_accuracy_s)]
    if not ok:
        raise ConfigError("nothing compared can be recommended: " + "; ".join(excluded(ranked))
                          + ". Hint: --compressors none,fp16,topk:0.01")
    best = ok[0]
    share = best.terms[best.dominant] / best.step_s if best.step_s else 0.0
    parts = sorted(best.terms.items(), key=lambda kv: -kv[1])
    split = ", ".join(f"{k} {v / best.step_s:.0%}" for k, v in parts[:3] if best.step_s)
    why = (f"{best.label}: {best.step_s * 1e3:.4g} ms/step x convergence factor "
           f"{best.factor_text}, {format_count(best.samples_per_s)} samples/s; {best.dominant} is "
           f"{share:.0%} of its step ({split}): ")
    if share >= 0.5:
        why += f"{_TERM_HINT.get(best.dominant, best.dominant)}."
    else:
        why += "no single term dominates; the largest: " \
               f"{_TERM_HINT.get(best.dominant, best.dominant)}."
    dense = next((p for p in ok if p.mode == "allreduce" and p.compressor == "none"), None)
    if dense is not None and dense is not best and best.to_accuracy_s:
        ds = dense.terms[dense.dominant] / dense.step_s if dense.step_s else 0.0
        why += (f" Dense allreduce would take {dense.to_accuracy_s / best.to_accuracy_s:.3g}x as "
                f"long to accuracy ({dense.dominant} {ds:.0%} of its step).")
    return why


def mode_takes(mode: str) -> tuple[str, ...]:
    """The options given by the user (``parlay plan --stages``...) that ``mode`` takes."""
    return _mode(mode).takes


def mode_variants(mode: str, workload: Workload, cluster: ClusterSpec,
                  given: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The option sets of ``mode`` that ``rank_configs`` tries, less the ``given`` options
    (the user's own: e.g. hybrid's stages), without repeats."""
    out: list[dict[str, Any]] = []
    for v in _mode(mode).variants(workload, cluster):
        v = {k: x for k, x in v.items() if k not in set(given)}
        if v not in out:
            out.append(v)
    return out if out or not given else [{}]


#: Diloco changes the optimisation: it is advised only for this much more compute used.
DILOCO_GAIN = 1.25


def diloco_advice(ranked: Sequence[Prediction], workload: Workload, cluster: ClusterSpec,
                  target: float = DILOCO_TARGET) -> dict[str, Any] | None:
    """Whether to prefer ``mode="diloco"`` over data parallel, and at which ``H``.

    Diloco changes the optimisation (local steps, an outer optimizer), so it is advised only
    when per-step communication bounds every exact mode: the best of them (by time to
    accuracy) uses less than ``target`` of the compute, and a diloco configuration uses
    :data:`DILOCO_GAIN` times as much.
    Of those reaching ``target`` the one with the smallest ``H`` (the closest to data
    parallel) wins, then the fastest; else the one using the most compute.

    Returns:
        ``advised``, ``why`` and the chosen configuration's figures (``sync_every``,
        ``fragments``, ``overlap``, ``compressor``, ``utilisation``, ``bytes_per_step`` per rank
        and dense data parallel's ``ddp_bytes_per_step``); ``None`` without diloco rows.
    """
    dl = [p for p in ranked if p.mode == "diloco" and math.isfinite(p.to_accuracy_s)]
    exact = [p for p in ranked if p.exact and math.isfinite(p.to_accuracy_s)]
    if not dl:
        return None
    reach = [p for p in dl if p.utilisation >= target]
    d = min(reach, key=lambda p: (p.options["sync_every"], p.to_accuracy_s)) if reach else \
        max(dl, key=lambda p: p.utilisation)
    h = d.options["sync_every"]
    mine = diloco_link_bytes(workload, cluster, d.compressor, h, d.options.get("fragments", 1))
    ddp = diloco_link_bytes(workload, cluster, "none", 1)
    best = exact[0] if exact else None
    advised = best is None or (best.utilisation < target
                               and d.utilisation > DILOCO_GAIN * best.utilisation)
    opts = ", ".join(f"'{k}': {v}" for k, v in d.options.items())
    comp = "" if d.compressor == "none" else f", compression='{d.compressor}'"
    fewer = f"{ddp / mine:.3g}x fewer than dense data parallel" if mine else "none"
    if advised:
        why = (f"prefer diloco: {d.label} is predicted to use {d.utilisation:.0%} of the "
               f"compute, sending {format_bytes(mine)} per step per rank ({fewer})"
               + (f", where the best data parallel configuration, {best.label}, uses "
                  f"{best.utilisation:.0%}: per-step communication is its bottleneck"
                  if best else "") + f". Trainer(mode='diloco', strategy_options={{{opts}}}"
               f"{comp}); check its accuracy (local steps change the optimisation).")
    else:
        why = (f"keep data parallel: {best.label} uses {best.utilisation:.0%} of the compute"
               if best else "no data parallel configuration to compare")
        why += (f"; diloco ({d.label}) would use {d.utilisation:.0%} at the cost of local "
                "steps and an outer optimizer.")
    return {"advised": advised, "why": why, "sync_every": h,
            "fragments": d.options.get("fragments", 1), "overlap": d.options.get("overlap", 0),
            "compressor": d.compressor, "utilisation": d.utilisation, "step_s": d.step_s,
            "bytes_per_step": mine, "ddp_bytes_per_step": ddp,
            "data_parallel": best.label if best else None,
            "data_parallel_utilisation": best.utilisation if best else None}
