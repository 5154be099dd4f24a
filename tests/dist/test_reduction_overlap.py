"""Reductions that overlap backward and each other, on real gloo ranks.

* Hierarchical: a bucket crosses hosts as soon as its sum inside the host is done, with no
  further call from the training thread (backward may still be running there).
* Further rounds (PowerSGD's Q): ``advance()`` starts every bucket's second round before any
  is waited for, and the result is the one the plain ``wait()`` gives, bit for bit.
* A rank lost in the middle of a hierarchical reduction is a ``CommError`` on every survivor.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import parlay
from parlay.testing import WorldError, run_world

pytestmark = pytest.mark.timeout(120)


def _reducer():
    from parlay.dp.hierarchical import HierarchicalReducer, discover

    return HierarchicalReducer(None, discover())


def _crosses_without_the_caller():
    from parlay.compress import get_compressor

    red = _reducer()
    flat = torch.arange(1001, dtype=torch.float64) + parlay.rank()   # odd: padded shards
    h = red.reduce_async(flat, get_compressor("none"), key="bucket0")
    # This thread makes no further call until the bucket has crossed (bounded wait).
    deadline = time.monotonic() + 60
    while red.cross_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    crossed = red.cross_bytes
    return crossed, h.wait().clone()


def test_hierarchical_bucket_crosses_hosts_while_the_caller_does_other_work():
    out = run_world(_crosses_without_the_caller, 4, local_world_size=2)
    expect = 4 * torch.arange(1001, dtype=torch.float64) + (0 + 1 + 2 + 3)
    for crossed, total in out:
        assert crossed == 501 * 8, "half of the padded bucket, once, before wait()"
        torch.testing.assert_close(total, expect, rtol=0, atol=0)   # exact: x + 0 == x


def _rounds_start_before_any_wait():
    from parlay.compress import CommStats, get_compressor, reduce_async

    comp, twin = get_compressor("powersgd:2"), get_compressor("powersgd:2")
    shapes = {"bucket0": [(24, 20), (20,)], "bucket1": [(30, 16)]}
    for c in (comp, twin):
        for key, layout in shapes.items():
            c.set_layout(key, layout)
    g = torch.Generator().manual_seed(parlay.rank())
    xs = {"bucket0": torch.randn(500, generator=g, dtype=torch.float64),
          "bucket1": torch.randn(480, generator=g, dtype=torch.float64)}
    stats = CommStats()
    handles = [reduce_async(x.clone(), comp, key, stats=stats) for key, x in xs.items()]
    first = stats.wire_bytes
    for h in handles:
        h.advance()
    started = stats.wire_bytes - first  # second rounds on the wire, none waited for yet
    outs = [h.wait() for h in handles]
    ref = [reduce_async(x.clone(), twin, key).wait() for key, x in xs.items()]
    return started, outs, ref


def test_powersgd_second_rounds_all_start_before_the_first_wait():
    out = run_world(_rounds_start_before_any_wait, 2)
    for started, outs, ref in out:
        assert started == (20 * 2 + 16 * 2) * 8   # Q of both buckets (float64)
        for o, r, o0 in zip(outs, ref, out[0][1]):
            torch.testing.assert_close(o, r, rtol=0, atol=0)    # same maths as plain wait()
            torch.testing.assert_close(o, o0, rtol=0, atol=0)   # and the same on every rank


def _lose_rank_three():
    from parlay.compress import get_compressor

    red = _reducer()
    parlay.comm.barrier()
    if parlay.rank() == 3:
        os._exit(3)
    t0 = time.monotonic()
    try:
        red.reduce_async(torch.ones(64), get_compressor("none"), key="bucket0").wait()
    except parlay.CommError as e:
        return "CommError", time.monotonic() - t0, str(e), e.peer
    return "no error", 0.0, "", None


def test_rank_lost_during_hierarchical_reduction_is_a_comm_error_everywhere():
    out = run_world(_lose_rank_three, 4, comm_timeout=5.0, timeout=90, local_world_size=2,
                    return_exceptions=True)
    for rank in (0, 1, 2):
        kind, elapsed, msg, peer = out[rank]
        assert kind == "CommError", (rank, msg)
        assert elapsed < 5.0 + 15.0, (rank, elapsed)
        # a live rank is never taken for the lost one: in the two-rank local groups the
        # peer that failed first in the cross-host group answers no more than a lost one
        assert peer in (None, 3) and "only peer) was lost" not in msg, (rank, msg)
    assert isinstance(out[3], WorldError)
