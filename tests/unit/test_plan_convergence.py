"""``parlay plan`` ranks by time to accuracy: step time x the compressor's convergence factor
(``Compressor.convergence``, measured by benchmarks/convergence.py). A compressor that never
reached the accuracy target, or was never measured, is never recommended, and the plan says why.
"""
from __future__ import annotations

import math

import pytest

from parlay.compress import BF16, get_compressor
from parlay.compress.base import Compressor
from parlay.plan import ClusterSpec, Link, Workload, predict, rank_configs, recommend
from parlay.plan.advise import COMPRESSORS, convergence_table, excluded
from parlay.registry import registries

pytestmark = pytest.mark.timeout(60)

W = Workload(params=25e6, batch=64, compute_s_per_sample=1e-3)
SLOW = ClusterSpec(4, 1, Link(10e6))  # every step is the link's: the fewest bytes win on step


class Factor(BF16):
    """bf16's wire and codec (half dense's bytes) with a convergence factor of our choosing:
    ``factor:3``, ``factor:never`` (did not reach the target), ``factor:unmeasured``."""

    name = "factor"

    def __init__(self, factor: str = "1") -> None:
        self.factor = None if factor == "unmeasured" else math.inf if factor == "never" \
            else float(factor)

    def convergence(self, factors):
        return self.factor

    def __repr__(self) -> str:
        return f"Factor({self.factor})"


@pytest.fixture(autouse=True)
def _factor_registered(monkeypatch):
    """``factor`` is registered for these tests only (other tests list the registry)."""
    monkeypatch.setitem(registries()["compression"]._entries, "factor", Factor)


def test_shipped_table_measures_every_default_compressor() -> None:
    table = convergence_table()
    assert table["factors"][repr(get_compressor("none"))] == 1.0  # dense is the yardstick
    for spec in COMPRESSORS:
        f = get_compressor(spec).convergence(table["factors"])
        assert f is not None and f >= 0.5, (spec, f)  # measured: a number, or inf
    assert get_compressor("randomk:0.01").convergence(table["factors"]) == math.inf
    # the lookup is by configuration, however it is spelled
    assert get_compressor("TopK:ratio=0.01").convergence(table["factors"]) == \
        get_compressor("topk:0.01").convergence(table["factors"])
    assert get_compressor("topk:0.5").convergence(table["factors"]) is None  # never measured
    assert Compressor.convergence(get_compressor("fp16"), {}) is None


def test_randomk_is_never_recommended() -> None:
    for cluster in (SLOW, ClusterSpec(16, 8, Link(1e9)), ClusterSpec(2, 1, Link(100e9))):
        ranked = rank_configs(W, cluster)
        best, why = recommend(W, cluster)
        assert best.compressor != "randomk:0.01" and "randomk" not in why
        cut = next(i for i, p in enumerate(ranked) if not math.isfinite(p.to_accuracy_s))
        assert {p.compressor for p in ranked[cut:]} == {"randomk:0.01"}  # all of them last
    # where it has the fastest step of all (the case: 16 hosts x 8 GPUs at 1 Gbit/s)
    fastest = min(rank_configs(W, ClusterSpec(16, 8, Link(1e9))), key=lambda p: p.step_s)
    assert fastest.compressor == "randomk:0.01"
    (why,) = excluded(rank_configs(W, SLOW))
    assert why.startswith("randomk:0.01: never reached the accuracy target")


def test_ranking_is_step_time_times_factor() -> None:
    dense = predict(W, SLOW, "allreduce", "none")
    half = predict(W, SLOW, "allreduce", "factor:1.5")
    assert half.step_s < 0.6 * dense.step_s  # half the bytes on a link-bound step
    assert half.to_accuracy_s == pytest.approx(1.5 * half.step_s)
    assert half.factor_text == "1.50" and dense.factor == 1.0
    # 1.5 x a step under 0.6 of dense's beats dense; 3 x does not, though its step is faster
    assert [p.compressor for p in rank_configs(W, SLOW, ["allreduce"], ["none", "factor:1.5"])
            ] == ["factor:1.5", "none"]
    ranked = rank_configs(W, SLOW, ["allreduce"], ["factor:3", "none"])
    assert [p.compressor for p in ranked] == ["none", "factor:3"]
    assert ranked[1].step_s < ranked[0].step_s
    assert recommend(W, SLOW, ["allreduce"], ["factor:3", "none"])[0].compressor == "none"


def test_unmeasured_or_never_reaching_compressors_are_excluded_with_the_reason(capsys) -> None:
    from parlay.cli import main

    ranked = rank_configs(W, SLOW, ["allreduce"], ["factor:never", "factor:unmeasured", "fp16"])
    assert [p.compressor for p in ranked][0] == "fp16"  # the slower step, but it converges
    assert [p.factor_text for p in ranked] == ["1.00", "never", "unmeasured"]
    why = excluded(ranked)
    assert why[0].startswith("factor:never: never reached the accuracy target (")
    assert why[1].startswith("factor:unmeasured: no measured convergence factor")
    argv = ["plan", "--model-params", "25e6", "--batch", "64", "--nodes", "4", "--bandwidth",
            "10mbit", "--compute-ms", "64", "--modes", "allreduce", "--no-calibrate"]
    assert main([*argv, "--compressors", "none,factor:never,randomk:0.01"]) == 0
    out = capsys.readouterr().out
    assert "recommended: allreduce: " in out  # dense: the only one that reaches the target
    assert "not recommended: factor:never: never reached" in out
    assert "not recommended: randomk:0.01: never reached" in out
    assert main([*argv, "--compressors", "factor:unmeasured,randomk:0.01"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing compared can be recommended" in err
    assert "factor:unmeasured: no measured convergence factor" in err and "Hint" in err
