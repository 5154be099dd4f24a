"""PowerSGD maths (Vogels et al. 2019) without a process group; see ``simulate``."""
from __future__ import annotations

import pytest
import torch

from parlay.compress import PowerSGD
from parlay.errors import ConfigError
from tests.unit.test_compression import simulate

pytestmark = pytest.mark.timeout(60)


def _low_rank(rows, cols, rank, seed, basis=None):
    g = torch.Generator().manual_seed(seed)
    a = basis if basis is not None else torch.randn(rows, rank, generator=g, dtype=torch.float64)
    return a @ torch.randn(cols, rank, generator=g, dtype=torch.float64).t()


def test_exactly_low_rank_matrix_is_lossless():
    m = _low_rank(40, 30, 3, 0)
    c = PowerSGD(rank=4)
    c.set_layout("b", [(40, 30)])
    out = simulate([c], [m.reshape(-1)], "b")[0]
    torch.testing.assert_close(out, m.reshape(-1), rtol=1e-10, atol=1e-10)
    assert c.memory.residual["b"].abs().max() < 1e-10


def test_lossless_across_ranks_sharing_a_column_space():
    basis = torch.randn(40, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ms = [_low_rank(40, 30, 2, s, basis).reshape(-1) for s in (1, 2, 3)]
    comps = [PowerSGD(rank=2) for _ in ms]
    for c in comps:
        c.set_layout("b", [(40, 30)])
    for out in simulate(comps, ms, "b"):  # every rank decodes the same exact sum
        torch.testing.assert_close(out, sum(ms), rtol=1e-10, atol=1e-10)


def test_matches_hand_computed_power_iteration_and_conserves():
    g = torch.Generator().manual_seed(3)
    ms = [torch.randn(600, generator=g, dtype=torch.float64) for _ in range(2)]
    comps = [PowerSGD(rank=2) for _ in ms]
    for c in comps:
        c.set_layout("b", [(20, 25), (100,)])  # a matrix and a 1-D tensor (sent dense)
    q0 = comps[0]._start_q("b", 0, comps[0].plan("b", 600).mats[0], ms[0], 0)
    out = simulate(comps, ms, "b")
    mats = [m[:500].view(20, 25) for m in ms]
    phat = torch.linalg.qr(sum(m @ q0 for m in mats)).Q
    expect = torch.cat([sum(phat @ phat.t() @ m for m in mats).reshape(-1),
                        ms[0][500:] + ms[1][500:]])
    for o in out:
        torch.testing.assert_close(o, expect, rtol=1e-12, atol=1e-12)
    for c, m, mat in zip(comps, ms, mats):  # sent_w + residual_w == produced_w
        sent = torch.cat([(phat @ phat.t() @ mat).reshape(-1), m[500:]])
        torch.testing.assert_close(sent + c.memory.residual["b"], m, rtol=0, atol=1e-13)
        assert torch.all(c.memory.residual["b"][500:] == 0)


def test_error_feedback_conserves_over_steps():
    c = PowerSGD(rank=1)
    produced, sent = torch.zeros(900, dtype=torch.float64), torch.zeros(900, dtype=torch.float64)
    for s in range(5):
        x = torch.randn(900, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        produced += x
        sent += simulate([c], [x], "b")[0]
    torch.testing.assert_close(sent + c.memory.residual["b"], produced, rtol=0, atol=1e-12)


def test_warm_start_converges_to_top_subspace():
    # Same matrix every step, no error feedback: warm-started power iteration converges to
    # the best rank-r approximation (Eckart-Young), which a cold start would not reach.
    g = torch.Generator().manual_seed(4)
    u, _ = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    s = torch.tensor([10.0, 5.0] + [0.5 ** k for k in range(38)], dtype=torch.float64)
    m = (u[:, :40] * s) @ v.t()
    best = (u[:, :2] * s[:2]) @ v[:, :2].t()
    c = PowerSGD(rank=2, error_feedback=False)
    c.set_layout("b", [(50, 40)])
    for _ in range(30):
        out = simulate([c], [m.reshape(-1)], "b")[0]
    torch.testing.assert_close(out, best.reshape(-1), rtol=1e-6, atol=1e-6)


def test_fallbacks_without_layout_and_for_small_buckets():
    c = PowerSGD(rank=4)
    plan = c.plan("b", 10000)  # no layout: one zero-padded near-square matrix
    assert [(m.rows, m.cols) for m in plan.mats] == [(100, 100)] and not plan.dense
    assert c.plan("tiny", 50).dense == ((0, 50),) and not c.plan("tiny", 50).mats
    c.set_layout("v", [(8,), (3, 5), (200, 100)])  # 1-D and too-small matrices go dense
    p = c.plan("v", 8 + 15 + 20000)
    assert p.dense == ((0, 23),) and [(m.rows, m.cols) for m in p.mats] == [(200, 100)]
    x = torch.randn(10001, dtype=torch.float64)  # padded path still conserves and decodes
    out = simulate([c], [x], "odd")[0]
    torch.testing.assert_close(out + c.memory.residual["odd"], x, rtol=0, atol=1e-12)
    small = torch.randn(50)
    torch.testing.assert_close(simulate([c], [small], "tiny")[0], small, rtol=0, atol=0)


def test_misuse_is_explained():
    c = PowerSGD(rank=2)
    c.set_layout("b", [(10, 10)])
    with pytest.raises(ConfigError, match="covers 100 elements but the bucket has 99"):
        c.compress(torch.randn(99), "b")
    payload, ctx = c.compress(torch.randn(100), "b")
    with pytest.raises(ConfigError, match="needs its two collective rounds"):
        c.decompress(payload, ctx)
    with pytest.raises(ConfigError, match="rank must be an integer >= 1"):
        PowerSGD(rank=0)
