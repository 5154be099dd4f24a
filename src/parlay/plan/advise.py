"""Predictions, rankings and a recommendation over every mode x compressor (pure).

``predict(workload, cluster, "allreduce", "topk:0.01")`` is one configuration;
``rank_configs`` predicts every supported one, fastest first; ``recommend`` picks the fastest
and says why (the term that dominates its step, and what the runner-up loses to).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from parlay.errors import ConfigError
from parlay.plan.model import ClusterSpec, Costs, Workload, compressor_of
from parlay.plan.modes import allreduce_terms, hierarchical_terms, hybrid_terms, ps_terms

__all__ = ["Prediction", "MODES", "COMPRESSORS", "predict", "rank_configs", "recommend",
           "explain"]

#: Modes the model covers (``ps`` takes ``consistency=``, ``hybrid`` takes ``stages=``).
MODES = ("allreduce", "hierarchical", "ps", "hybrid")
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
        mode: ``allreduce``, ``hierarchical``, ``ps`` or ``hybrid``.
        compressor: Compression string as given (``"none"`` when uncompressed).
        step_s: Predicted seconds per training step.
        samples_per_s: Global samples per second (``batch * world / step_s``).
        terms: Seconds per term; they add up to ``step_s``.
        dominant: The largest term.
        options: Mode options used (consistency, servers, stages, chunks...).
    """

    mode: str
    compressor: str
    step_s: float
    samples_per_s: float
    terms: dict[str, float]
    dominant: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """A short name, e.g. ``ps(sync, 4 servers) + topk:0.01``."""
        opts = ", ".join(f"{v}" if k == "consistency" else f"{v} {k}"
                         for k, v in self.options.items())
        mode = f"{self.mode}({opts})" if opts else self.mode
        return mode if self.compressor == "none" else f"{mode} + {self.compressor}"


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
            ``schedule`` (hybrid).

    Returns:
        The prediction; ``terms`` add up to ``step_s``.

    Raises:
        ConfigError: Unknown mode or compressor, an option the mode does not take, or a
            configuration the mode cannot run (e.g. more stages than layers).
    """
    costs = costs or Costs()
    comp = "none" if compressor is None else str(compressor).strip().lower()
    compressor_of(comp)  # an unknown name or bad options: refused before any formula
    try:
        if mode == "allreduce":
            terms = allreduce_terms(workload, cluster, comp, costs, **opts)
        elif mode == "hierarchical":
            terms = hierarchical_terms(workload, cluster, comp, costs, **opts)
        elif mode == "ps":
            terms = ps_terms(workload, cluster, comp, costs, **opts)
        elif mode == "hybrid":
            terms = hybrid_terms(workload, cluster, comp, costs, **opts)
        else:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    except TypeError as e:
        raise ConfigError(f"option not understood by mode {mode!r}: {e}") from None
    step = sum(terms.values())
    world = cluster.world
    shown = {k: v for k, v in opts.items() if k in ("consistency", "servers", "stages",
                                                    "chunks", "schedule")}
    if mode == "ps":
        shown = {"consistency": opts.get("consistency", "sync"),
                 "servers": opts.get("servers") or cluster.nodes}
    if mode == "hybrid":
        shown.setdefault("stages", opts.get("stages", 2))
    return Prediction(mode, comp, step, workload.batch * world / step if step > 0
                      else float("inf"), terms, max(terms, key=terms.__getitem__), shown)


def _variants(workload: Workload, cluster: ClusterSpec,
              modes: Sequence[str]) -> Iterable[tuple[str, dict[str, Any]]]:
    for mode in modes:
        if mode == "allreduce":
            yield mode, {}
        elif mode == "hierarchical":
            if cluster.nodes > 1 and cluster.ranks_per_node > 1:
                yield mode, {}
        elif mode == "ps":
            for cons in ("sync", "async"):
                yield mode, {"consistency": cons}
        elif mode == "hybrid":
            for p in (2, 4, 8):
                if cluster.world % p == 0 and p <= cluster.world and \
                        (workload.layers is None or p <= workload.layers):
                    yield mode, {"stages": p}
        else:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")


def rank_configs(workload: Workload, cluster: ClusterSpec, modes: Sequence[str] = MODES,
                 compressors: Sequence[str] = COMPRESSORS, costs: Costs | None = None,
                 include_async: bool = True) -> list[Prediction]:
    """Predict every mode x compressor this cluster can run, fastest first.

    Combinations a mode cannot run (PowerSGD on parameter servers, top-k hierarchically,
    hybrid stages that do not divide the ranks) are left out. ``include_async=False`` keeps
    only modes with synchronous (allreduce-equivalent) semantics.
    """
    out = []
    for mode, opts in _variants(workload, cluster, modes):
        if not include_async and opts.get("consistency", "sync") != "sync":
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
    return sorted(out, key=lambda p: p.step_s)


def recommend(workload: Workload, cluster: ClusterSpec, modes: Sequence[str] = MODES,
              compressors: Sequence[str] = COMPRESSORS, costs: Costs | None = None,
              include_async: bool = False) -> tuple[Prediction, str]:
    """The fastest configuration and a sentence saying why.

    Asynchronous parameter servers change the optimisation (stale gradients), so they are only
    recommended with ``include_async=True``.

    Raises:
        ConfigError: Nothing can run (every combination was refused).
    """
    ranked = rank_configs(workload, cluster, modes, compressors, costs, include_async)
    if not ranked:
        raise ConfigError("no mode x compressor combination can run on this cluster. "
                          "Hint: check --nodes, --gpus-per-node and --stages.")
    return ranked[0], explain(ranked)


def explain(ranked: Sequence[Prediction]) -> str:
    """Why the first of ``ranked`` wins: its dominant term and the runner-up's."""
    best = ranked[0]
    share = best.terms[best.dominant] / best.step_s if best.step_s else 0.0
    parts = sorted(best.terms.items(), key=lambda kv: -kv[1])
    split = ", ".join(f"{k} {v / best.step_s:.0%}" for k, v in parts[:3] if best.step_s)
    why = (f"{best.label}: {best.step_s * 1e3:.4g} ms/step, {best.samples_per_s:,.0f} "
           f"samples/s; {best.dominant} is {share:.0%} of its step ({split}): ")
    if share >= 0.5:
        why += f"{_TERM_HINT.get(best.dominant, best.dominant)}."
    else:
        why += "no single term dominates; the largest: " \
               f"{_TERM_HINT.get(best.dominant, best.dominant)}."
    dense = next((p for p in ranked if p.mode == "allreduce" and p.compressor == "none"), None)
    if dense is not None and dense is not best:
        ds = dense.terms[dense.dominant] / dense.step_s
        why += (f" Dense allreduce would take {dense.step_s / best.step_s:.2f}x as long "
                f"({dense.dominant} {ds:.0%} of its step).")
    return why
