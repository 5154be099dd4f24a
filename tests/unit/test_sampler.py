"""ShardedSampler and the loader: coverage, determinism, resumption, real prefetching."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, TensorDataset

from parlay.data import Prefetcher, ShardedSampler, build_loader
from parlay.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)


def _shards(n, world, epoch=0, **kw):
    out = []
    for r in range(world):
        s = ShardedSampler(n, world, r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_exactly_once_when_divisible(world, shuffle):
    n = 12 * world
    for epoch in range(3):
        shards = _shards(n, world, epoch, shuffle=shuffle, seed=7)
        assert sorted(i for s in shards for i in s) == list(range(n))
        assert all(len(s) == n // world for s in shards)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 6), drop_last=st.booleans(),
       epoch=st.integers(0, 5))
def test_uneven_datasets_give_every_rank_the_same_count(n, world, drop_last, epoch):
    if drop_last and n < world:
        with pytest.raises(ConfigError, match="too few"):
            ShardedSampler(n, world, 0, drop_last=True)
        return
    shards = _shards(n, world, epoch, drop_last=drop_last)
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1
    seen = [i for s in shards for i in s]
    if drop_last:
        assert len(seen) == len(set(seen)) == n - n % world
    else:
        assert set(seen) == set(range(n))
        assert len(seen) == -(-n // world) * world


@pytest.mark.parametrize("n, world, drop_last", [(40, 2, False), (41, 3, False), (41, 3, True)])
def test_same_order_as_torch_distributed_sampler(n, world, drop_last):
    from torch.utils.data import DistributedSampler

    for r in range(world):
        ours = ShardedSampler(n, world, r, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(range(n), world, r, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


def test_even_false_partitions_without_padding():
    shards = _shards(11, 3, even=False, shuffle=False)
    assert [len(s) for s in shards] == [4, 4, 3]
    assert sorted(i for s in shards for i in s) == list(range(11))


def test_kth_batches_of_all_replicas_form_one_contiguous_global_batch():
    n, world, b = 48, 4, 3
    full = ShardedSampler(n, 1, 0, seed=3)
    order = list(full)
    shards = _shards(n, world, seed=3)
    for k in range(n // (world * b)):
        union = sorted(i for s in shards for i in s[k * b:(k + 1) * b])
        assert union == sorted(order[k * world * b:(k + 1) * world * b])


def test_shuffle_is_deterministic_per_epoch_and_differs_between_epochs():
    a, b = ShardedSampler(100, 2, 1, seed=5), ShardedSampler(100, 2, 1, seed=5)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    assert list(ShardedSampler(100, 2, 1, seed=6)) != list(b)


def test_resume_mid_epoch_from_state_dict():
    s = ShardedSampler(50, 2, 0, seed=1)
    s.set_epoch(2)
    whole = list(s)
    s.advance(7)
    t = ShardedSampler(50, 2, 0, seed=1)
    t.load_state_dict(s.state_dict())
    assert t.epoch == 2 and list(t) == whole[7:]
    assert len(t) == 25, "len() is the epoch's shard size, whatever the position"


def test_resume_rejects_a_different_world_or_dataset():
    sd = ShardedSampler(50, 2, 0).state_dict()
    with pytest.raises(CheckpointError, match="num_replicas=2"):
        ShardedSampler(50, 4, 0).load_state_dict(sd)
    with pytest.raises(CheckpointError, match="n=50"):
        ShardedSampler(51, 2, 0).load_state_dict(sd)


@pytest.mark.parametrize("kw, msg", [
    (dict(data=10, num_replicas=0), "num_replicas"),
    (dict(data=10, num_replicas=2, rank=2), "rank must be < num_replicas"),
    (dict(data=0, num_replicas=1), "too few"),
    (dict(data=object(), num_replicas=1), "__len__"),
])
def test_bad_arguments(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ShardedSampler(**kw)


class _ListDataset(Dataset):
    """A non-tensor dataset (goes through the DataLoader's per-sample path and collate)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


@pytest.mark.parametrize("workers, prefetch", [(0, 0), (0, 3), (1, 2)])
@pytest.mark.parametrize("tensor", [True, False])
def test_loader_yields_the_sampler_batches(workers, prefetch, tensor):
    n = 23
    ds = (TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))
          if tensor else _ListDataset(n))
    s = ShardedSampler(n, 2, 1, seed=4)
    loader = build_loader(ds, s, 5, num_workers=workers, prefetch=prefetch)
    if workers:
        assert loader.loader.num_workers == workers and loader.loader.prefetch_factor == prefetch
    want = list(s)
    got = [int(v) for _, y in loader for v in y]
    assert got == want
    s.advance(10)                      # resume after two consumed batches
    assert [int(v) for _, y in loader for v in y] == want[10:]
    loader.close()


def test_automatic_prefetch_never_runs_getitem_on_a_thread():
    # A thread's __getitem__ drawing from torch's global RNG (augmentation) races with the
    # step's dropout: runs were not reproducible, resumes not bit-exact. Workers have their own.
    tensor_ds = TensorDataset(torch.zeros(8, 1), torch.zeros(8))
    s = ShardedSampler(8)
    assert not build_loader(tensor_ds, s, 2).threaded
    assert not build_loader(_ListDataset(8), s, 2).threaded
    assert build_loader(_ListDataset(8), s, 2, prefetch=2).threaded  # an explicit value wins


def test_prefetch_thread_runs_ahead_of_the_consumer():
    produced = []
    ahead = threading.Event()

    def source():
        for i in range(10):
            produced.append(i)
            if i == 3:
                ahead.set()            # item 3 produced while the consumer holds only item 0
            yield i

    p = Prefetcher(source(), depth=3)
    assert next(p) == 0
    assert ahead.wait(timeout=10), "the loading thread did not run ahead"
    assert list(p) == list(range(1, 10))
    p.close()


def test_prefetch_thread_reraises_loading_errors():
    def source():
        yield 1
        raise ValueError("bad sample 7")

    p = Prefetcher(source(), depth=2)
    assert next(p) == 1
    with pytest.raises(ValueError, match="bad sample 7"):
        next(p)
    with pytest.raises(ValueError, match="bad sample 7"):
        next(p)  # again, not a wait on a thread that ended
    p.close()
    done = Prefetcher([1, 2], depth=2)
    assert list(done) == [1, 2] and next(done, "ended") == "ended" == next(done, "ended")
    assert list(Prefetcher([1, None, 2, None], depth=2)) == [1, None, 2, None]  # None: an item
    closed = Prefetcher(iter(range(100)), depth=1)
    closed.close()
    assert len(list(closed)) <= 2  # what was queued, then the end: no wait forever
