"""Loader edge cases: overridden __getitem__, worker seeding and shutdown, bad arrays, shapes."""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from parlay.data import ShardedSampler, build_loader, from_arrays
from parlay.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


class _Scaled(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x * 100.0, y


class _Jitter(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.rand(1), i


class _Ragged(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(i + 1), i


def _first(ds, **kw):
    loader = build_loader(ds, ShardedSampler(len(ds), 1, 0, shuffle=False), 4, **kw)
    try:
        return next(iter(loader))
    finally:
        loader.close()


def test_tensor_dataset_subclass_is_read_through_its_getitem():
    x, _ = _first(_Scaled(torch.ones(8, 2), torch.arange(8)))
    assert torch.equal(x, torch.full((4, 2), 100.0))


def test_worker_rng_follows_seed_and_rank():
    def draws(seed, rank):
        return _first(_Jitter(), num_workers=1, seed=seed, rank=rank)[0]

    a = draws(1, 0)
    assert torch.equal(a, draws(1, 0))  # reproducible per run
    assert not torch.equal(a, draws(2, 0))  # follows the seed
    assert not torch.equal(a, draws(1, 1))  # distinct per rank


def test_close_stops_the_worker_processes():
    before = set(multiprocessing.active_children())
    loader = build_loader(_Jitter(), ShardedSampler(4, 1, 0), 2, num_workers=2)
    next(iter(loader))
    assert len(set(multiprocessing.active_children()) - before) == 2
    loader.close()
    assert set(multiprocessing.active_children()) - before == set()
    assert len(list(loader)) == 2  # a later pass starts them again
    loader.close()


@pytest.mark.parametrize("inputs, targets, name", [
    (np.zeros((3, 2)), np.array(["cat", "dog", "cat"]), "targets"),
    ([[1.0, 2.0], [3.0]], [0, 1], "inputs"),
])
def test_from_arrays_names_the_bad_argument(inputs, targets, name):
    with pytest.raises(ConfigError, match=f"{name} must be numbers of one shape"):
        from_arrays(inputs, targets)


@pytest.mark.parametrize("workers", [0, 1])
def test_samples_of_different_shapes_get_a_hint(workers):
    with pytest.raises(ConfigError, match="differ in shape.*Hint: pad"):
        _first(_Ragged(), num_workers=workers)
