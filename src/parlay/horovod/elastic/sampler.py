"""Horovod's ``ElasticSampler``: a data partition that a restored state resumes mid-epoch."""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from parlay import runtime
from parlay.errors import ConfigError

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler):
    """Horovod's ``ElasticSampler``: a shuffled partition of ``dataset`` over the ranks that
    remembers how many samples of the epoch were processed, so a restored state skips them.

    Track it in the state (``TorchState(..., sampler=sampler)``), call :meth:`record_batch`
    after each batch and :meth:`set_epoch` at the end of each epoch.

    Args:
        dataset: The dataset (its length must not change).
        shuffle: Shuffle each epoch (the same order on every rank).
        seed: Base seed of the shuffle; the epoch is added to it.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` with nothing processed (call at the end of the previous one)."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a processed batch of ``batch_size`` samples on each rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch, self.processed_num = int(state_dict["epoch"]), int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-partition the samples not processed yet this epoch over the current ranks.

        Raises:
            ConfigError: Horovod (parlay) is not initialized, as in Horovod.
        """
        if not runtime.is_initialized():
            raise ConfigError("ElasticSampler needs the ranks: Horovod has not been initialized. "
                              "Fix: call hvd.init() before building the sampler.")
        self.num_replicas, self.rank = runtime.size(), runtime.rank()
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                self.seed + self.epoch)).tolist()
        else:
            order = list(range(n))
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        idx = self.remaining_indices[:]
        while idx and len(idx) < self.total_size:  # pad so every rank gets as many
            idx += idx[: self.total_size - len(idx)]
        return iter(idx[self.rank: self.total_size: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
