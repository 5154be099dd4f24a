"""Top-k with DGC's sampled threshold (``topk:R,sample=F``) and the buffer-reusing fast paths.

Buckets here are >= 65536 elements: smaller ones always take the exact path.
"""
from __future__ import annotations

import pytest
import torch

from parlay.compress import PowerSGD, TopK, get_compressor
from parlay.compress.sparse import exact_topk, magnitude_topk
from parlay.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

N = 200_000


def _dyadic(n: int, seed: int, scale: int = 64) -> torch.Tensor:
    """float64 multiples of 1/1024 below ``scale``: every sum in these tests is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-scale * 1024, scale * 1024, (n,), generator=g).double() / 1024


@pytest.mark.parametrize("seed", range(4))
def test_sampled_selection_is_a_top_set_of_at_most_k_and_near_k(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, generator=g) * torch.rand(N, generator=g) ** 2
    k = 2000
    idx = magnitude_topk(x, k, sample=0.01)
    assert idx.numel() <= k and idx.unique().numel() == idx.numel()
    assert idx.numel() >= 0.7 * k  # the sample's estimate lands near k
    chosen = torch.zeros(N, dtype=torch.bool)
    chosen[idx] = True
    # whatever was chosen is exactly the top-|idx| set: nothing left out is larger
    assert x.abs()[chosen].min() >= x.abs()[~chosen].max()


def test_sampled_equals_exact_topk_when_the_top_k_stand_apart():
    g = torch.Generator().manual_seed(7)
    k = 1500
    x = torch.rand(N, generator=g) * torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    top = torch.randperm(N, generator=g)[:k]
    x[top] = (10 + torch.rand(k, generator=g)) * torch.sign(x[top])
    exact = exact_topk(x.abs(), k).sort().values
    assert torch.equal(exact, top.sort().values)
    for sample in (0.001, 0.01, 0.1):
        assert torch.equal(magnitude_topk(x, k, sample).sort().values, exact)
    c = TopK(k / N, sample=0.01)
    (values, idx), _ = c.compress(x, "b")
    assert torch.equal(idx.long().sort().values, exact)


def test_sampled_payload_is_padded_to_k_and_decodes_to_what_was_sent():
    c = TopK(0.01, sample=0.01)
    x = torch.randn(N, dtype=torch.float64)
    k = c.k_for(N, 0.01)
    values, idx = c._payload(x[:5], torch.arange(5), N, k)
    assert values.numel() == idx.numel() == k and idx.dtype == torch.int32
    out = c.aggregate([[values, idx]], c.compress(x, "b")[1])
    assert torch.equal(out[:5], x[:5]) and int((out != 0).sum()) == 5


def test_sampled_topk_conserves_exactly_in_float64_and_sends_k_slots():
    c = TopK(0.01, sample=0.01)
    produced = torch.zeros(N, dtype=torch.float64)
    sent = torch.zeros_like(produced)
    k = c.k_for(N, 0.01)
    for step in range(5):
        g = _dyadic(N, step)
        produced += g
        payload, ctx = c.compress(g, "k")
        assert [p.numel() for p in payload] == [k, k]
        sent += c.aggregate([payload], ctx)
        torch.testing.assert_close(sent + c.memory.residual["k"], produced, rtol=0, atol=0)
    assert torch.count_nonzero(sent) > 0


def test_aggregate_and_decompress_into_a_given_buffer():
    x = torch.randn(N, dtype=torch.float64)
    c = TopK(0.01, error_feedback=False)
    payload, ctx = c.compress(x, "b")
    into = torch.full((N,), 3.0, dtype=torch.float64)
    out = c.aggregate([payload, payload], ctx, out=into)
    assert out is into and torch.equal(out, c.aggregate([payload, payload], ctx))
    wrong = torch.zeros(N, dtype=torch.float32)  # wrong dtype: ignored, a fresh result
    assert c.aggregate([payload], ctx, out=wrong) is not wrong

    p = PowerSGD(2, error_feedback=False)
    p.set_layout("b", [(400, 500)])
    (pay,), ctx = p.compress(x, "b")
    nxt = p.next_round([pay], ctx)
    assert p.next_round(nxt, ctx) is None
    into = torch.full((N,), 3.0, dtype=torch.float64)
    ref = p.decompress(nxt, ctx)
    assert p.decompress(nxt, ctx, out=into) is into and torch.equal(into, ref)


def test_residual_buffers_are_recycled_without_changing_results():
    a, b = TopK(0.01), TopK(0.01)
    for step in range(4):
        g = _dyadic(N, 10 + step)
        pa, _ = a.compress(g, "k")
        pb, _ = b.compress(g, "k")
        b.memory._spare.clear()  # b never recycles
        assert all(torch.equal(u, v) for u, v in zip(pa, pb))
        assert torch.equal(a.memory.residual["k"], b.memory.residual["k"])


def test_registry_option_and_refusals():
    c = get_compressor("topk:0.01,sample=0.02")
    assert isinstance(c, TopK) and c.sample == 0.02 and "sample=0.02" in repr(c)
    assert get_compressor("topk:0.01").sample == 0.0
    for bad in ("topk:0.01,sample=2", "topk:0.01,sample=-0.1", "topk:0.01,sample=x"):
        with pytest.raises(ConfigError, match="sample"):
            get_compressor(bad)
