"""Top-k selection (:mod:`parlay.compress.topsel`): exact, ascending, ties to the lowest
indices, and the same indices on its NumPy path (contiguous CPU float tensors) and its torch
path (anything else)."""
from __future__ import annotations

import pytest
import torch

from parlay.compress.topsel import exact_topk, magnitude_topk

pytestmark = pytest.mark.timeout(60)

N = 300_000


def _reference(x: torch.Tensor, k: int, magnitude: bool = True) -> torch.Tensor:
    """The k largest (|x| or x), ties at the k-th value to the lowest indices, ascending."""
    a = x.abs() if magnitude else x
    order = sorted(range(x.numel()), key=lambda i: (-float(a[i]), i))[:k]
    return torch.tensor(sorted(order))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("k", [1, 3000, 9000])
def test_exact_top_k_ascending_on_both_paths(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(N, generator=g) * torch.rand(N, generator=g) ** 3).to(dtype)
    want = torch.topk(x.float().abs(), k).indices.sort().values if dtype != torch.float16 \
        else None
    fast = magnitude_topk(x, k)
    spaced = torch.zeros(2 * N, dtype=dtype)
    spaced[::2] = x
    slow = magnitude_topk(spaced[::2], k)  # not contiguous: the torch ops
    assert torch.equal(fast, slow)
    assert fast.numel() == k and bool((fast[1:] > fast[:-1]).all())
    if want is not None:
        assert torch.equal(fast, want)
    chosen = torch.zeros(N, dtype=torch.bool)
    chosen[fast] = True
    assert x.abs()[chosen].min() >= x.abs()[~chosen].max()


def test_ties_at_the_kth_value_go_to_the_lowest_indices():
    x = torch.zeros(N)
    g = torch.Generator().manual_seed(1)
    pos = torch.randperm(N, generator=g)
    x[pos[:500]] = 5.0  # clearly in
    x[pos[500:3000]] = -2.0  # 2500 tied magnitudes, of which the first 1500 by index are in
    k = 2000
    want = _reference_ties(x, k)
    assert torch.equal(magnitude_topk(x, k), want)
    spaced = torch.zeros(2 * N)
    spaced[::2] = x
    assert torch.equal(magnitude_topk(spaced[::2], k), want)


def _reference_ties(x: torch.Tensor, k: int) -> torch.Tensor:
    a = x.abs()
    big = (a > 2.0).nonzero().squeeze(1)
    tied = (a == 2.0).nonzero().squeeze(1)[: k - big.numel()]
    return torch.cat([big, tied]).sort().values


def test_signed_selection_and_small_buckets():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, generator=g)
    assert torch.equal(exact_topk(x, 2500), torch.topk(x, 2500).indices.sort().values)
    small = torch.randn(1000, generator=g)
    assert torch.equal(magnitude_topk(small, 10), _reference(small, 10))
    dense = torch.randn(100_000, generator=g)  # k > n / 32: a full topk, sorted
    got = magnitude_topk(dense, 5000)
    assert torch.equal(got, torch.topk(dense.abs(), 5000).indices.sort().values)


def test_nan_is_never_chosen_on_the_prefilter_path():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, generator=g)
    x[123] = float("nan")
    idx = magnitude_topk(x, 1000)
    assert 123 not in idx.tolist() and idx.numel() == 1000
