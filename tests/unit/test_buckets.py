"""BucketPlan: pure planning of gradient buckets."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parlay.dp.buckets import BucketPlan, ParamInfo
from parlay.errors import ConfigError


def _p(name, n, dtype=torch.float32, device="cpu"):
    return ParamInfo(name, n, dtype, device)


def test_reverse_order_and_cap():
    params = [_p("a", 10), _p("b", 10), _p("c", 10), _p("d", 10)]
    plan = BucketPlan.build(params, cap_bytes=80)  # 20 floats per bucket
    assert [b.members for b in plan.buckets] == [(3, 2), (1, 0)]
    assert plan.buckets[0].offsets == (0, 10)
    assert plan.where[2] == (0, 1)


def test_big_tensor_joins_open_bucket_then_closes_it():
    params = [_p("w0", 1000), _p("b0", 1), _p("w1", 1000), _p("b1", 1)]
    plan = BucketPlan.build(params, cap_bytes=400)
    assert [b.members for b in plan.buckets] == [(3, 2), (1, 0)]


def test_dtypes_and_devices_never_mix():
    params = [_p("a", 4), _p("h", 4, torch.float16), _p("b", 4), _p("g", 4, device="meta")]
    plan = BucketPlan.build(params, cap_bytes=1 << 20)
    for b in plan.buckets:
        kinds = {(params[i].dtype, params[i].device) for i in b.members}
        assert len(kinds) == 1 and b.dtype == params[b.members[0]].dtype


def test_first_bucket_cap_is_smaller():
    params = [_p(str(i), 10) for i in range(6)]
    plan = BucketPlan.build(params, cap_bytes=1000, first_cap_bytes=40)
    assert plan.buckets[0].members == (5,)
    assert plan.buckets[1].members == (4, 3, 2, 1, 0)


def test_bad_cap_is_config_error():
    with pytest.raises(ConfigError, match="positive"):
        BucketPlan.build([_p("a", 1)], cap_bytes=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 500), st.sampled_from([torch.float32, torch.float16,
                                                                   torch.float64])),
                min_size=0, max_size=30),
       st.integers(1, 4000))
def test_every_parameter_exactly_once_and_offsets_contiguous(specs, cap):
    params = [_p(f"p{i}", n, dt) for i, (n, dt) in enumerate(specs)]
    plan = BucketPlan.build(params, cap_bytes=cap)
    seen = sorted(i for b in plan.buckets for i in b.members)
    assert seen == list(range(len(params)))
    for b in plan.buckets:
        off = 0
        for slot, i in enumerate(b.members):
            assert b.offsets[slot] == off and plan.where[i] == (b.index, slot)
            off += params[i].numel
        assert off == b.numel
        # A bucket only exceeds the cap because of its last (closing) tensor.
        last = params[b.members[-1]].numel * b.nbytes // max(1, b.numel)
        assert b.nbytes - last < cap
