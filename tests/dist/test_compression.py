"""Compressed reductions on real gloo ranks: the wire result equals decompress-then-sum by hand.

Inputs are multiples of 1/64 below 1 in magnitude, so every cast and every sum in these tests
is exact (fp16 keeps 11 significant bits, bf16 8): any difference is a real bug, and the
tolerance is zero except for PowerSGD, where QR and matrix products round (float64, 1e-12).
"""
from __future__ import annotations

import pytest
import torch

import parlay
from parlay import comm
from parlay.compress import CommStats, get_compressor, reduce_async
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

STEPS, N = 3, 500
LAYOUT = [(24, 20), (20,)]  # a matrix (PowerSGD compresses it) and a bias (sent dense)
NAMES = ["none", "fp16", "bf16", "topk:0.05", "randomk:0.05", "topk:0.05,momentum=0.5",
         "topk:0.02,warmup=2,warmup_start=0.5", "powersgd:2"]


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-63, 64, (N,), generator=g).double() / 64


def _by_hand_powersgd(world: int, q0: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Vogels et al. (2019), Algorithm 1 + error feedback, written out for every rank."""
    res = [torch.zeros(N, dtype=torch.float64) for _ in range(world)]
    q, outs = q0, []
    for s in range(steps):
        ms = [_grad(r, s) + res[r] for r in range(world)]
        mats = [m[:480].view(24, 20) for m in ms]
        phat = torch.linalg.qr(sum(m @ q for m in mats)).Q
        qs = [m.t() @ phat for m in mats]
        q = sum(qs)
        outs.append(torch.cat([(phat @ q.t()).reshape(-1), sum(m[480:] for m in ms)]))
        res = [torch.cat([(mat - phat @ qw.t()).reshape(-1), torch.zeros(20, dtype=torch.float64)])
               for mat, qw in zip(mats, qs)]
    return outs


def _reduce_every_compressor(names: list[str]) -> dict:
    world, rank = parlay.size(), parlay.rank()
    report = {}
    for name in names:
        wire, hand = get_compressor(name), get_compressor(name)  # twins with equal state
        wire.set_layout("bucket0", LAYOUT)
        hand.set_layout("bucket0", LAYOUT)
        stats = CommStats()
        outs, hands, extra = [], [], {}
        q0 = None
        if not hand.point_to_point:
            q0 = hand._start_q("bucket0", 0, hand.plan("bucket0", N).mats[0],
                               torch.zeros(1, dtype=torch.float64), 0)
        for s in range(STEPS):
            flat = _grad(rank, s)
            outs.append(reduce_async(flat.clone(), wire, "bucket0", stats=stats).wait())
            if hand.point_to_point:
                payload, ctx = hand.compress(flat.clone(), "bucket0")
                everyone = comm.allgather_object(([p.clone() for p in payload], ctx))
                hands.append(sum(hand.decompress(p, c) for p, c in everyone))
                if hand.summable:  # let the twin see the reduced payload too (fp16's scale)
                    summed = [sum(p[i] for p, _ in everyone) for i in range(len(payload))]
                    assert hand.next_round(summed, ctx) is None
                extra.setdefault("seeds", []).append(getattr(ctx, "seed", None))
                extra.setdefault("k", []).append(getattr(ctx, "k", None))
        if q0 is not None:
            hands = _by_hand_powersgd(world, q0, STEPS)
        avg = reduce_async(_grad(rank, 9), get_compressor(name), "bucket0", average=True).wait()
        total = reduce_async(_grad(rank, 9), get_compressor(name), "bucket0").wait()
        report[name] = dict(outs=outs, hands=hands, avg=avg, total=total, wire=stats.wire_bytes,
                            dense=stats.dense_bytes, state=wire.state_dict(), **extra)
    return report


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def reports(request):
    return request.param, run_world(_reduce_every_compressor, request.param, NAMES, timeout=90)


@pytest.mark.parametrize("name", NAMES)
def test_wire_result_equals_decompress_then_sum_on_every_rank(reports, name):
    world, per_rank = reports
    tol = dict(rtol=1e-12, atol=1e-12) if name.startswith("powersgd") else dict(rtol=0, atol=0)
    for rank, rep in enumerate(per_rank):
        r = rep[name]
        for s, (out, hand) in enumerate(zip(r["outs"], r["hands"])):
            assert out.dtype == torch.float64
            where = f"{name}, rank {rank}, step {s}"
            torch.testing.assert_close(out, hand, **tol, msg=lambda m, w=where: f"{w}: {m}")
            # every rank holds the same reduced bucket
            torch.testing.assert_close(out, per_rank[0][name]["outs"][s], rtol=0, atol=0)
            if name in ("none", "fp16", "bf16"):  # lossless on these inputs: the true sum
                exact = sum(_grad(r, s) for r in range(world))
                torch.testing.assert_close(out, exact, rtol=0, atol=0)
        torch.testing.assert_close(r["avg"] * world, r["total"], rtol=1e-15, atol=0)


def test_randomk_ranks_draw_the_same_coordinates(reports):
    _, per_rank = reports
    seeds = [rep["randomk:0.05"]["seeds"] for rep in per_rank]
    assert all(s == seeds[0] for s in seeds) and len(set(seeds[0])) == STEPS


def test_wire_bytes_are_the_payload_bytes(reports):
    _, per_rank = reports
    rep = per_rank[0]
    dense = STEPS * N * 8
    assert rep["none"]["wire"] == rep["none"]["dense"] == dense
    assert rep["fp16"]["wire"] == rep["bf16"]["wire"] == dense // 4  # float64 -> 16 bits
    k = int(0.05 * N)
    assert rep["topk:0.05"]["wire"] == STEPS * k * (8 + 4)  # float64 values + int32 indices
    assert rep["randomk:0.05"]["wire"] == STEPS * k * 8  # values only: indices from the seed
    ks = rep["topk:0.02,warmup=2,warmup_start=0.5"]["k"]
    assert ks == [250, 50, 10]  # density 0.5 -> 0.1 -> 0.02 (geometric warm-up)
    # PowerSGD: P (24x2) + the dense bias (20) in round 1, Q (20x2) in round 2.
    assert rep["powersgd:2"]["wire"] == STEPS * (48 + 20 + 40) * 8


def test_residuals_are_per_rank_state(reports):
    _, per_rank = reports
    r0 = per_rank[0]["topk:0.05"]["state"]["residual"]["bucket0"]
    r1 = per_rank[1]["topk:0.05"]["state"]["residual"]["bucket0"]
    assert r0.shape == (N,) and not torch.equal(r0, r1)
