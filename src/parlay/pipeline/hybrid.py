"""Hybrid parallelism: pipeline stages x data-parallel replicas on a 2-D device mesh.

The world is a ``dp x pp`` grid built with ``init_device_mesh(device, (dp, pp),
mesh_dim_names=("dp", "pp"))``: global rank ``r`` is replica ``r // pp`` and stage ``r % pp``.
Ranks in one ``pp`` row form a pipeline (point-to-point activations and gradients); ranks in one
``dp`` column hold the same stage and average its gradients with parlay's
:class:`~parlay.dp.DistributedOptimizer` (``process_group=dp_group``): the same bucketed,
overlapped engine as data-parallel mode, so every compressor applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm
from parlay.errors import ConfigError

__all__ = ["HybridMesh", "build_mesh"]


@dataclass(frozen=True)
class HybridMesh:
    """This rank's place in the ``dp x pp`` grid and its two process groups.

    Attributes:
        dp: Number of data-parallel replicas (pipelines).
        pp: Ranks per pipeline.
        dp_rank: This rank's replica index.
        pp_rank: This rank's position in its pipeline.
        dp_group: Ranks holding the same stage in every replica (gradient averaging).
        pp_group: Ranks of this rank's pipeline (activations and gradients).
        device_mesh: The ``DeviceMesh`` (``None`` for a world of one).
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: Any
    pp_group: Any
    device_mesh: Any = None

    @property
    def world(self) -> int:
        """``dp * pp``."""
        return self.dp * self.pp


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}.")
    return value


def build_mesh(pp: int, dp: int | None = None, device_type: str | None = None) -> HybridMesh:
    """Build the ``dp x pp`` mesh over the whole world (a collective: every rank calls it).

    Args:
        pp: Ranks per pipeline (pipeline stages, counting each rank once).
        dp: Replicas; default ``world_size // pp``.
        device_type: ``"cpu"`` or ``"cuda"``; default the type of ``parlay.device()``.

    Returns:
        This rank's :class:`HybridMesh`.

    Raises:
        ConfigError: No process group, or ``dp * pp`` differs from the world size.
    """
    if not dist.is_initialized():
        raise ConfigError("the pipeline needs a process group. Hint: call parlay.init() first.")
    world = dist.get_world_size()
    _positive("pp (stages)", pp)
    if dp is None:
        if world % pp:
            raise ConfigError(
                f"the world of {world} rank(s) cannot be split into pipelines of {pp} stages: "
                f"expected world_size % stages == 0, got {world} % {pp} = {world % pp}. "
                f"Hint: launch a multiple of {pp} ranks (e.g. parlay run -n {pp * 2}), or "
                "change stages.")
        dp = world // pp
    _positive("dp", dp)
    if dp * pp != world:
        raise ConfigError(f"dp x pp must equal the world size: expected {dp} x {pp} = {dp * pp} "
                          f"ranks, got {world}. Hint: launch {dp * pp} ranks or change dp/pp.")
    if device_type is None:
        from parlay import runtime

        device_type = runtime.device().type if runtime.is_initialized() else "cpu"
    rank = dist.get_rank()
    if world == 1:
        world_group = dist.group.WORLD
        return HybridMesh(1, 1, 0, 0, world_group, world_group, None)
    from torch.distributed.device_mesh import init_device_mesh

    with comm.comm_errors("init_device_mesh"):
        mesh = init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return HybridMesh(dp=dp, pp=pp, dp_rank=rank // pp, pp_rank=rank % pp,
                      dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(),
                      device_mesh=mesh)


def mean_over(value: float | torch.Tensor, group: Any) -> float:
    """Average a scalar over ``group`` (a collective over its members)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    comm.allreduce(t, "avg", group=group)
    return float(t.item())
