"""BucketPlan: which gradients travel together (pure, no process group).

Gradients are fused into flat buckets of at most ``cap_bytes`` so one collective carries many
small tensors. Parameters are taken in *reverse* registration order, which approximates the
order in which backward produces their gradients (the last layer first), so the first bucket
fills early and its allreduce overlaps the rest of backward (the same heuristic as PyTorch DDP).
Buckets never mix dtypes or devices; a bucket closes as soon as it reaches the cap.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from parlay.errors import ConfigError

__all__ = ["ParamInfo", "Bucket", "BucketPlan"]


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know about one parameter."""

    name: str
    numel: int
    dtype: torch.dtype
    device: str = "cpu"


@dataclass(frozen=True)
class Bucket:
    """One fused buffer: parameter indices (into the plan's input) and their flat offsets."""

    index: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: str

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketPlan:
    """Assignment of parameters to buckets; ``buckets`` are in launch order."""

    buckets: tuple[Bucket, ...]
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # param -> (bucket, slot)

    @staticmethod
    def build(params: Sequence[ParamInfo], cap_bytes: int,
              first_cap_bytes: int | None = None) -> BucketPlan:
        """Plan buckets for ``params`` (in registration order).

        Args:
            params: Parameters in model registration order.
            cap_bytes: A bucket closes once it holds at least this many bytes.
            first_cap_bytes: Smaller cap for the first bucket so communication starts early
                (default: same as ``cap_bytes``).

        Returns:
            The plan.

        Raises:
            ConfigError: ``cap_bytes`` is not positive.
        """
        if not isinstance(cap_bytes, int) or cap_bytes <= 0:
            raise ConfigError(f"bucket cap must be a positive number of bytes, got {cap_bytes!r}. "
                              "Hint: bucket_cap_mb=25 is a good default.")
        first_cap = cap_bytes if first_cap_bytes is None else max(1, int(first_cap_bytes))
        open_: dict[tuple[torch.dtype, str], list[int]] = {}
        open_bytes: dict[tuple[torch.dtype, str], int] = {}
        finished: list[tuple[torch.dtype, str, list[int]]] = []

        def close(key: tuple[torch.dtype, str]) -> None:
            members = open_.pop(key, [])
            open_bytes.pop(key, None)
            if members:
                finished.append((key[0], key[1], members))

        for i in reversed(range(len(params))):
            p = params[i]
            key = (p.dtype, p.device)
            size = p.numel * torch.empty((), dtype=p.dtype).element_size()
            # Add first, then close once the cap is reached (as DDP does): a big tensor joins
            # the small ones before it instead of leaving them in a bucket of their own.
            open_.setdefault(key, []).append(i)
            open_bytes[key] = open_bytes.get(key, 0) + size
            if open_bytes[key] >= (first_cap if not finished else cap_bytes):
                close(key)
        for key in list(open_):
            close(key)
        buckets = []
        where: dict[int, tuple[int, int]] = {}
        for b, (dtype, device, members) in enumerate(finished):
            offsets, off = [], 0
            for slot, i in enumerate(members):
                offsets.append(off)
                off += params[i].numel
                where[i] = (b, slot)
            buckets.append(Bucket(b, tuple(members), tuple(offsets), off, dtype, device))
        return BucketPlan(tuple(buckets), where)
