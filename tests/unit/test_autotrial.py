"""The trial of ``compression="auto"`` (:mod:`parlay.compress.autotrial`): which assignments
are measured, in what order, and which one is kept."""
from __future__ import annotations

import pytest

from parlay.compress import get_compressor
from parlay.compress.autotrial import Trial, contenders
from parlay.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

PRED = {"b0": {"none": 10.0, "fp16": 6.0, "topk": 3.0, "powersgd": 3.3},
        "b1": {"none": 1.0, "fp16": 1.2, "topk": 2.0, "powersgd": 1.9}}


def test_contenders_decided_first_then_close_uniform_ones_fastest_first():
    decided = {"b0": "topk", "b1": "none"}  # predicted 4.0 in all
    out = contenders(PRED, decided, within=0.35, most=3)
    # uniform totals: topk 5.0, powersgd 5.2, fp16 7.2, none 11.0; within 35% of 4.0: <= 5.4
    assert out == [decided, {"b0": "topk", "b1": "topk"},
                   {"b0": "powersgd", "b1": "powersgd"}]
    assert contenders(PRED, decided, within=0.35, most=2) == out[:2]
    assert contenders(PRED, decided, within=0.1, most=3) == [decided]
    # a uniform assignment equal to the decided one is not measured twice
    same = {"b0": "topk", "b1": "topk"}
    assert contenders(PRED, same, within=0.35, most=3) == [same, {"b0": "powersgd",
                                                                  "b1": "powersgd"}]
    assert contenders({}, {"b0": "none"}, within=1.0, most=3) == [{"b0": "none"}]


def test_trial_schedule_and_verdict():
    a, b, c = {"k": "none"}, {"k": "fp16"}, {"k": "topk"}
    t = Trial([a, b, c], steps=2, hysteresis=0.05)
    assert t.next(None) == a and not t.done
    assert t.next(1.0) is None  # a's first step
    assert t.next(1.2) == b and t.measured == [1.1]
    assert t.next(0.7) is None
    assert t.next(0.9) == c
    assert t.next(0.95) is None
    assert t.next(0.97) is None and t.done and t.measured == pytest.approx([1.1, 0.8, 0.96])
    assert t.winner([1.1, 0.8, 0.96])[0] == b
    assert "fp16 800.00ms" in t.winner([1.1, 0.8, 0.96])[1]
    # another contender must measure hysteresis faster than the decided one to replace it
    assert t.winner([1.0, 0.97, 0.99])[0] == a
    assert t.winner([1.0, 0.94, 0.99])[0] == b


def test_trial_option_is_checked():
    assert get_compressor("auto:trial=0").trial == 0
    assert get_compressor("auto").trial == 3
    with pytest.raises(ConfigError, match="trial must be an integer >= 0"):
        get_compressor("auto:trial=-1")
    with pytest.raises(ConfigError, match="trial='1.5' is not a valid int"):
        get_compressor("auto:trial=1.5")
