"""ShardedSampler: a deterministic, per-epoch shuffled, resumable shard of a dataset per rank.

Every replica draws the same permutation of ``range(n)`` for an epoch (``torch.randperm`` seeded
with ``seed + epoch``) and takes every ``num_replicas``-th index starting at its rank, so the
union of the replicas' ``k``-th batches is one contiguous slice of the permutation: exactly the
batch that single-process training over ``num_replicas`` times the batch size would see. The
order is the same as ``torch.utils.data.DistributedSampler``'s for the same seed, so a run is
directly comparable with a plain DDP script.

Uneven datasets never leave a rank waiting for a batch the others do not have:

* ``drop_last=False`` (default): the permutation is padded by wrapping around to a multiple of
  ``num_replicas``, so every sample is seen at least once and ``n % num_replicas`` samples of
  each epoch twice (``torch.utils.data.DistributedSampler`` does the same).
* ``drop_last=True``: the tail is dropped, so no sample repeats and up to ``num_replicas - 1``
  samples are skipped per epoch (a different few each epoch when shuffling).
* ``even=False`` (evaluation): no padding and no dropping; shards differ in length by at most
  one. Only for loops where ranks do not synchronise per batch (validation).

In the first two cases every rank holds the same number of samples, hence the same number of
batches. The position inside an epoch is *reported by the consumer* (:meth:`advance`), not
counted by ``__iter__``, because a prefetching ``DataLoader`` pulls indices ahead of what the
training loop has consumed; :meth:`state_dict` then resumes exactly at the first unconsumed
sample. :meth:`reshard` spreads later epochs over fewer replicas (the survivors of a lost
asynchronous parameter-server worker take over its share); the state records the sharding.
"""
from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from parlay._validate import check_int
from parlay.errors import CheckpointError, ConfigError

__all__ = ["ShardedSampler"]


def _check_int(name: str, value: object, minimum: int) -> int:
    return check_int(f"ShardedSampler: {name}", value, minimum)


class ShardedSampler(Sampler[int]):
    """Yield this replica's sample indices for the current epoch, from the current position.

    Args:
        data: A sized dataset or its length.
        num_replicas: Number of data-parallel replicas (``strategy.dp_size``).
        rank: This replica's index in ``[0, num_replicas)`` (``strategy.dp_rank``).
        shuffle: Draw a new permutation each epoch (deterministic in ``seed`` and the epoch).
        seed: Shuffle seed; must be the same on every rank.
        drop_last: Drop the tail instead of padding by wrap-around (see the module docstring).
        even: Give every replica the same number of samples (pad or drop); ``False`` only for
            evaluation, where shards may differ by one sample and nothing repeats.

    Raises:
        ConfigError: Bad arguments, or a dataset too small for one sample per replica.
    """

    def __init__(self, data: Sized | int, num_replicas: int = 1, rank: int = 0, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 even: bool = True) -> None:
        n = data if isinstance(data, int) and not isinstance(data, bool) else None
        if n is None:
            try:
                n = len(data)  # type: ignore[arg-type]
            except TypeError:
                raise ConfigError(f"ShardedSampler needs a dataset with __len__ (a map-style "
                                  f"Dataset) or its length, got {type(data).__name__}.") from None
        self.n = _check_int("dataset length", n, 0)
        self.num_replicas = _check_int("num_replicas", num_replicas, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ConfigError(f"ShardedSampler: rank must be < num_replicas={num_replicas}, "
                              f"got {rank}.")
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.even = bool(even)
        if self.even and self.n < (1 if not self.drop_last else self.num_replicas):
            raise ConfigError(
                f"ShardedSampler: the dataset has {self.n} samples, too few for "
                f"{self.num_replicas} replicas{' with drop_last=True' if self.drop_last else ''}."
                " Hint: use a larger dataset or fewer processes.")
        self.world = self.num_replicas  # the replicas the run was built for
        self.epoch = 0
        self.position = 0

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        """Samples in this replica's shard for a whole epoch (independent of the position)."""
        if not self.even:
            return len(range(self.rank, self.n, self.num_replicas))
        if self.drop_last:
            return self.n // self.num_replicas
        return -(-self.n // self.num_replicas)

    @property
    def total_size(self) -> int:
        """Samples handed out per epoch over all replicas (after padding or dropping)."""
        return self.n if not self.even else len(self) * self.num_replicas

    # ------------------------------------------------------------------ order
    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """This replica's full shard for ``epoch`` (default: the current one), in order."""
        e = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator().manual_seed((self.seed + e) % 2**64)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.total_size
        if total > len(order):  # pad by wrapping around (possibly more than once for tiny n)
            reps = -(-total // len(order))
            order = (order * reps)[:total]
        else:
            order = order[:total]
        return order[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self.position:])

    # ------------------------------------------------------------------ progress
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample (call before iterating each epoch)."""
        self.epoch = _check_int("epoch", epoch, 0)
        self.position = 0

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Shard the epochs from the next :meth:`set_epoch` on over ``num_replicas`` replicas
        (at most the replicas the sampler was built for), this one at ``rank``.

        Raises:
            ConfigError: A sharding that does not fit.
        """
        if _check_int("num_replicas", num_replicas, 1) > self.world or \
                _check_int("rank", rank, 0) >= num_replicas:
            raise ConfigError(f"ShardedSampler.reshard: need 1 <= num_replicas <= {self.world} "
                              f"and 0 <= rank < num_replicas, got {num_replicas} and {rank}.")
        self.num_replicas, self.rank = num_replicas, rank

    def advance(self, num_samples: int) -> None:
        """Record that the consumer finished ``num_samples`` more samples of this epoch."""
        self.position = min(len(self), self.position + _check_int("num_samples", num_samples, 0))

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position, this epoch's sharding and the settings that must match on resume."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n": self.n, "num_replicas": self.num_replicas, "rank": self.rank,
                "world": self.world,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "even": self.even}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and position, with the saved sharding (a takeover's).

        Raises:
            CheckpointError: The saved sampler sharded a different dataset or world.
        """
        world = state.get("world", state.get("num_replicas", self.world))
        if world != self.world:
            raise CheckpointError(
                f"cannot resume the data order: the checkpoint's sampler was built for "
                f"num_replicas={world!r}, this run has {self.world}. Hint: resume with the same "
                "number of processes, or start a fresh checkpoint_dir.")
        for key in ("n", "seed", "shuffle", "drop_last", "even"):
            if key in state and state[key] != getattr(self, key):
                raise CheckpointError(
                    f"cannot resume the data order: the checkpoint's sampler has {key}="
                    f"{state[key]!r}, this run has {getattr(self, key)!r}. Hint: resume with the "
                    "same dataset, number of processes, seed and drop_last, or start a fresh "
                    "checkpoint_dir.")
        if state.get("num_replicas", world) != world:  # a takeover's sharding (reshard)
            self.reshard(int(state["num_replicas"]), int(state["rank"]))
        self.epoch = int(state["epoch"])
        self.position = min(len(self), int(state["position"]))

    def __repr__(self) -> str:
        return (f"ShardedSampler(n={self.n}, replica {self.rank}/{self.num_replicas}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last}, epoch={self.epoch}, "
                f"position={self.position})")
