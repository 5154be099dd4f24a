"""Which mode, which compressor? An alpha-beta cost model of one training step.

``parlay.plan`` predicts the step time of every mode (flat and hierarchical ring allreduce,
sharded parameter servers, pipeline x data parallel) with every compressor from a handful of
numbers (parameters, batch, compute time per sample, hosts, ranks per host, link bandwidth and
latency), so ``parlay plan`` can rank them before anything runs::

    from parlay.plan import ClusterSpec, Link, Workload, rank_configs
    w = Workload(params=25e6, batch=64, compute_s_per_sample=120e-3 / 64)
    c = ClusterSpec(nodes=16, ranks_per_node=8, inter=Link(10e9, 50e-6))
    for p in rank_configs(w, c)[:5]:
        print(p.label, p.step_s, p.dominant)

The pure formulas live in :mod:`parlay.plan.model` and :mod:`parlay.plan.modes` (they ask each
compressor for its own wire and codec cost); :mod:`parlay.plan.calibrate` measures this
machine's constants and a user's model (import it explicitly: it starts processes).
"""
from parlay.plan.advise import (COMPRESSORS, MODES, Prediction, explain, predict, rank_configs,
                                recommend)
from parlay.plan.model import (ClusterSpec, Costs, Link, Workload, allgather_s, allreduce_s,
                               codec_s, compressor_of, link_bytes, wire_bytes, wire_rounds)

__all__ = ["Link", "ClusterSpec", "Workload", "Costs", "Prediction", "predict", "rank_configs",
           "recommend", "explain", "MODES", "COMPRESSORS", "allreduce_s", "allgather_s",
           "wire_bytes", "wire_rounds", "link_bytes", "codec_s", "compressor_of"]
