"""The cost model (parlay.plan): formulas' limits and monotonicity, wire formats against the
real compressors, impossible configurations and units. The ``parlay plan`` command, calibration
and profiling are in test_plan_command.py; fits to measured runs in test_plan_measured.py."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from parlay.errors import ConfigError
from parlay.plan import (ClusterSpec, Costs, Link, Workload, allgather_s, allreduce_s,
                         link_bytes, predict, rank_configs, recommend, wire_bytes)
from parlay.plan.units import parse_bandwidth, parse_count, parse_latency

pytestmark = pytest.mark.timeout(60)

BIG = [(4096, 784), (4096,), (4096, 4096), (4096,), (4096, 4096), (4096,), (10, 4096), (10,)]
BIG_PARAMS = sum(math.prod(s) for s in BIG)
# No software costs, no queueing effects: only links and compute.
FREE = Costs(**{f.name: 0.0 for f in dataclasses.fields(Costs)})
FREE = dataclasses.replace(FREE, incast_efficiency=1.0, duplex_efficiency=1.0)


def _w(params: float = 25e6, batch: int = 32, per_sample: float = 1e-3, **kw) -> Workload:
    return Workload(params, batch, per_sample, **kw)


# ------------------------------------------------------------------ collectives
def test_allreduce_limits_and_monotonicity() -> None:
    link = Link(1e9, 50e-6, efficiency=1.0)
    assert allreduce_s(1e6, 1, link) == 0.0
    assert allreduce_s(0, 8, link) == 0.0
    # 2 ranks: each sends half the buffer twice; latency: 2(n-1) steps
    assert allreduce_s(1e6, 2, link) == pytest.approx(2 * 50e-6 + 1e6 * 8 / 1e9)
    times = [allreduce_s(1e8, n, link) for n in (2, 4, 16, 1024)]
    assert times == sorted(times)
    assert times[-1] < 2 * 1e8 * 8 / 1e9 + 2 * 1023 * 50e-6 + 1e-9  # bandwidth term -> 2x
    assert allreduce_s(2e8, 4, link) > allreduce_s(1e8, 4, link)
    assert allreduce_s(1e8, 4, Link(10e9)) < allreduce_s(1e8, 4, Link(1e9))
    assert allgather_s(1e6, 4, link) == pytest.approx(3 * (50e-6 + 1e6 * 8 / 1e9))


def test_link_efficiency_is_tcp_over_ethernet() -> None:
    assert Link(100e6).beta == pytest.approx(8 / (100e6 * 1448 / 1514))
    assert Link(100e6, efficiency=1.0).transfer_s(12.5e6) == pytest.approx(1.0)


# ------------------------------------------------------------------ wire formats
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:0.01", "randomk:0.05",
                                  "powersgd:4", "powersgd:2"])
def test_wire_bytes_match_the_real_compressors(spec: str) -> None:
    from parlay.compress import get_compressor

    shapes = [(64, 100), (64,), (32, 64), (32,)]
    numel = sum(math.prod(s) for s in shapes)
    comp = get_compressor(spec)
    comp.set_layout("b", shapes)
    payload, ctx = comp.compress(torch.randn(numel), "b")
    sent = sum(p.numel() * p.element_size() for p in payload)
    if comp.summable:
        more = comp.next_round(payload, ctx)
        sent += sum(p.numel() * p.element_size() for p in more or [])
    assert wire_bytes(spec, numel, 2, shapes) == sent


def test_powersgd_bytes_of_the_cluster_benchmark_mlp() -> None:
    # benchmarks/cluster.py measured 0.4551 MB per step from comm_stats for this model
    assert wire_bytes("powersgd:4", BIG_PARAMS, 2, BIG) / 1e6 == pytest.approx(0.4551, abs=1e-4)
    assert link_bytes("none", BIG_PARAMS, 2) == BIG_PARAMS * 4
    assert link_bytes("topk:0.01", 1e6, 4) == pytest.approx(3 * 10000 * 8)


# ------------------------------------------------------------------ modes
def test_terms_add_up_and_compute_bound_limit() -> None:
    w = _w()
    fast = ClusterSpec(4, 2, Link(1e15))
    for mode, opts in (("allreduce", {}), ("hierarchical", {}), ("ps", {}),
                       ("hybrid", {"stages": 2})):
        p = predict(w, fast, mode, "none", FREE, **opts)
        assert sum(p.terms.values()) == pytest.approx(p.step_s)
        assert p.dominant == max(p.terms, key=p.terms.get)
        assert p.samples_per_s == pytest.approx(w.batch * 8 / p.step_s)
        if mode != "hybrid":  # infinite link: only compute is left
            assert p.step_s == pytest.approx(w.compute_s, rel=1e-3)


@pytest.mark.parametrize("mode", ["allreduce", "hierarchical", "ps"])
def test_step_time_falls_with_bandwidth_and_grows_with_params(mode: str) -> None:
    c = [ClusterSpec(2, 2, Link(bw, 1e-4)) for bw in (1e8, 1e9, 1e10)]
    steps = [predict(_w(), cl, mode).step_s for cl in c]
    assert steps == sorted(steps, reverse=True)
    sizes = [predict(_w(params=n), c[0], mode).step_s for n in (1e6, 1e7, 1e8)]
    assert sizes == sorted(sizes)


def test_overlap_hides_communication_behind_backward() -> None:
    w = _w(params=50e6, batch=64, per_sample=5e-3)  # 0.32 s of compute
    hidden = predict(w, ClusterSpec(2, 1, Link(10e9), overlap=1.0), "allreduce", costs=FREE)
    serial = predict(w, ClusterSpec(2, 1, Link(10e9), overlap=0.0), "allreduce", costs=FREE)
    assert hidden.terms["comm"] < serial.terms["comm"]
    assert serial.step_s == pytest.approx(w.compute_s + 200e6 * 8 / (10e9 * 1448 / 1514))


def test_hierarchical_moves_one_model_over_the_host_link_instead_of_one_and_a_half() -> None:
    w = _w(params=BIG_PARAMS, batch=1, per_sample=1e-6)
    c = ClusterSpec(2, 2, Link(100e6), overlap=0.0)
    flat = predict(w, c, "allreduce", costs=FREE)
    hier = predict(w, c, "hierarchical", costs=FREE)
    assert flat.terms["comm"] / hier.terms["comm-inter"] == pytest.approx(1.5, rel=0.01)
    # inside each host two allreduces of the whole model (sum, then share the shards)
    bus = Link(1e9, 0.0, efficiency=1.0)
    c = ClusterSpec(2, 4, Link(100e6), overlap=0.0, intra=bus)
    hier = predict(w, c, "hierarchical", costs=FREE)
    assert hier.terms["comm-intra"] == pytest.approx(2 * allreduce_s(BIG_PARAMS * 4, 4, bus))


@pytest.mark.parametrize("mode,opts", [("allreduce", {}), ("hybrid", {"stages": 2})])
def test_powersgd_is_priced_on_the_layers_shapes_not_one_square(mode, opts) -> None:
    # Its factors are (rows + cols) x rank per matrix: one square of all parameters gave
    # sqrt(layers) times fewer bytes than the model's layers (hybrid: always one square).
    c = ClusterSpec(4, 1, Link(100e6), overlap=0.0)
    sq = (1024, 1024)
    by_layers = predict(_w(params=8 * 1024 * 1024, layers=8), c, mode, "powersgd:4",
                        costs=FREE, **opts)
    by_shapes = predict(_w(params=8 * 1024 * 1024, shapes=(sq,) * 8), c, mode, "powersgd:4",
                        costs=FREE, **opts)
    unknown = predict(_w(params=8 * 1024 * 1024), c, mode, "powersgd:4", costs=FREE, **opts)
    assert by_layers.terms["comm"] == pytest.approx(by_shapes.terms["comm"])
    assert by_layers.terms["comm"] > 1.9 * unknown.terms["comm"]


def test_hybrid_shows_the_micro_batches_it_is_priced_at() -> None:
    c = ClusterSpec(1, 2, Link(1e9))
    assert predict(_w(batch=32), c, "hybrid", costs=FREE).label == "hybrid(2 stages, 8 chunks)"
    assert predict(_w(batch=1), c, "hybrid", costs=FREE).label == "hybrid(2 stages, 2 chunks)"
    assert predict(_w(batch=32), c, "hybrid", costs=FREE, chunks=3).label == \
        "hybrid(2 stages, 3 chunks)"


def test_ps_sync_pushes_then_pulls_and_async_overlaps_workers() -> None:
    w = _w(params=5.8e6, batch=8, per_sample=1e-3)
    c = ClusterSpec(4, 1, Link(100e6), overlap=0.0)
    ring = predict(w, c, "allreduce", costs=FREE)
    sync = predict(w, c, "ps", costs=FREE, servers=4)
    model_s = 5.8e6 * 4 * Link(100e6).beta
    assert sync.terms["push"] == pytest.approx(model_s)
    assert sync.terms["pull"] == pytest.approx(model_s)
    assert ring.terms["comm"] == pytest.approx(1.5 * model_s)
    fewer = predict(w, c, "ps", costs=FREE, servers=1)  # one server link carries 4 models
    assert fewer.terms["push"] == pytest.approx(4 * model_s)
    asyn = predict(w, c, "ps", costs=FREE, servers=1, consistency="async")
    assert asyn.step_s == pytest.approx(4 * model_s)  # the server's link is the bound
    comp = predict(w, c, "ps", "topk:0.01", costs=FREE, servers=4)
    assert comp.terms["push"] == pytest.approx(sync.terms["push"] / 50)  # 1% x (value + index)
    assert comp.terms["pull"] == pytest.approx(sync.terms["pull"])  # parameters come back dense


def test_hybrid_bubble_is_the_gpipe_fraction() -> None:
    w = _w(params=1e6, batch=16, per_sample=1e-3, layers=8)
    c = ClusterSpec(1, 4, Link(1e9))
    for p, m in ((2, 8), (4, 4), (4, 16)):
        t = predict(w, c, "hybrid", costs=FREE, stages=p, chunks=m).terms
        pipe = t["compute"] + t["bubble"]
        assert t["bubble"] / pipe == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("call, words", [
    (lambda: predict(_w(layers=2), ClusterSpec(1, 4, Link(1e9)), "hybrid", stages=4),
     ["4 pipeline stages", "2 layers", "Hint"]),
    (lambda: predict(_w(), ClusterSpec(1, 6, Link(1e9)), "hybrid", stages=4),
     ["multiple of 4", "6 ranks"]),
    (lambda: predict(_w(batch=1), ClusterSpec(1, 2, Link(1e9)), "hybrid", stages=2, chunks=8),
     ["8 micro-batches", "Hint"]),
    (lambda: predict(_w(), ClusterSpec(2, 1, Link(1e9)), "ps", "powersgd:4"), ["PowerSGD"]),
    (lambda: predict(_w(), ClusterSpec(2, 2, Link(1e9)), "hierarchical", "topk:0.01"),
     ["summable"]),
    (lambda: predict(_w(), ClusterSpec(2, 2, Link(1e9)), "gossip"), ["mode must be"]),
    (lambda: predict(_w(), ClusterSpec(2, 2, Link(1e9)), "allreduce", "zip"), ["compressors"]),
    (lambda: Link(0), ["bandwidth must be > 0"]),
    (lambda: Link(-1e9), ["bandwidth must be > 0"]),
    (lambda: ClusterSpec(0, 1, Link(1e9)), ["nodes must be", ">= 1"]),
    (lambda: Workload(1e6, 0, 1e-3), ["batch must be"]),
    (lambda: Workload(0, 8, 1e-3), ["params must be > 0"]),
])
def test_impossible_configurations_are_refused(call, words) -> None:
    with pytest.raises(ConfigError) as e:
        call()
    for word in words:
        assert word in str(e.value)


def test_rank_configs_sorted_and_recommend_explains() -> None:
    w = _w(params=BIG_PARAMS, batch=64, per_sample=1.5 / 64, layers=4)
    slow = ClusterSpec(2, 1, Link(100e6), overlap=0.0)
    ranked = rank_configs(w, slow)
    assert [p.to_accuracy_s for p in ranked] == sorted(p.to_accuracy_s for p in ranked)
    assert not any(p.mode == "ps" and p.compressor.startswith("powersgd") for p in ranked)
    best, why = recommend(w, slow, ("allreduce", "ps"))  # ranked by step x convergence factor
    assert best.compressor not in ("none", "randomk:0.01") and best.dominant in why
    assert "Dense allreduce would take" in why
    fast, _ = recommend(w, ClusterSpec(2, 1, Link(1e12), overlap=0.0))
    assert fast.mode == "allreduce" and fast.compressor == "none"  # nothing to save


# ------------------------------------------------------------------ units
@pytest.mark.parametrize("text, bps", [("10gbit", 1e10), ("100Mbit/s", 1e8), ("25Gbps", 25e9),
                                       ("1.25GB/s", 1e10), ("1e9", 1e9), ("1 Gibit", 2 ** 30)])
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["0", "0gbit", "-5mbit", "fast", "10 parsecs", "10gbitz"])
def test_parse_bandwidth_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match="bandwidth"):
        parse_bandwidth(text)


def test_parse_latency_and_count() -> None:
    assert parse_latency("50us") == pytest.approx(50e-6)
    assert parse_latency("0.2ms") == pytest.approx(2e-4)
    assert parse_count("25e6") == 25e6 and parse_count("1.3B") == 1.3e9
    with pytest.raises(ConfigError, match="latency"):
        parse_latency("5 lightyears")
