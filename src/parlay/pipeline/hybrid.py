"""Hybrid parallelism: pipeline stages x data-parallel replicas on a 2-D device mesh.

The world is a ``dp x pp`` grid built with ``init_device_mesh(device, (dp, pp),
mesh_dim_names=("dp", "pp"))``: global rank ``r`` is replica ``r // pp`` and stage ``r % pp``.
Ranks in one ``pp`` row form a pipeline (point-to-point activations and gradients); ranks in one
``dp`` column hold the same stage and average its gradients with parlay's
:class:`~parlay.dp.DistributedOptimizer` (``process_group=dp_group``): the same bucketed,
overlapped engine as data-parallel mode, so every compressor applies.

Placement across hosts: the slow links are between hosts, so the mesh keeps one kind of traffic
inside hosts. By default a replica's pipeline stages share a host (activations and their
gradients stay local; each stage's gradient allreduce crosses hosts); with ``placement=
"dp-local"`` (or ``"auto"`` given byte estimates that favour it) the replicas of a stage share
a host instead and the grid is ``(pp, dp)``: global rank ``r`` is stage ``r // dp`` and replica
``r % dp``. Rank 0 logs the choice and why (logger ``parlay``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm
from parlay.errors import ConfigError

__all__ = ["HybridMesh", "build_mesh", "choose_placement", "positive"]

log = logging.getLogger("parlay")
_PLACEMENTS = ("auto", "pp-local", "dp-local")


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
        placement: ``"pp-local"`` (rank ``r`` is replica ``r // pp``, stage ``r % pp``: a
            replica's stages are neighbours) or ``"dp-local"`` (stage ``r // dp``, replica
            ``r % dp``: a stage's replicas are neighbours).
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: Any
    pp_group: Any
    device_mesh: Any = None
    placement: str = "pp-local"

    @property
    def world(self) -> int:
        """``dp * pp``."""
        return self.dp * self.pp


def positive(name: str, value: Any) -> int:
    """``value`` when it is an int >= 1; a ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}.")
    return value


def choose_placement(pp: int, dp: int, local: int, placement: str = "auto",
                     dp_bytes: float | None = None, pp_bytes: float | None = None
                     ) -> tuple[str, str]:
    """Which traffic stays inside hosts: ``("pp-local" | "dp-local", why)``. Pure.

    Args:
        pp: Stages per pipeline.
        dp: Replicas.
        local: Ranks per host (ranks are numbered host by host, as torchrun does).
        placement: ``"auto"``, or a placement to use as given.
        dp_bytes: Gradient bytes of the whole model (one replica's parameters), per step.
        pp_bytes: Activation plus activation-gradient bytes crossing one stage boundary of
            one pipeline per step.

    Raises:
        ConfigError: Unknown placement.
    """
    if placement not in _PLACEMENTS:
        raise ConfigError(f"placement must be one of {_PLACEMENTS}, got {placement!r}.")
    world = pp * dp
    hosts = max(1, world // max(1, local))
    if placement != "auto":
        return placement, "as requested"
    if hosts == 1:
        return "pp-local", "one host: every link is local"
    pp_fits, dp_fits = local % pp == 0, local % dp == 0
    if dp_bytes is not None and pp_bytes is not None and pp_fits and dp_fits:
        # Bytes over host links per step. pp-local: each stage's ring allreduce crosses between
        # the hosts holding its replicas, 2(dp-1)/dp of the model per crossing, one crossing per
        # host in the ring. dp-local: every pipeline crosses (hosts it spans - 1) boundaries.
        dp_hosts = max(1, dp * pp // local)
        cross_pp_local = dp_hosts * 2 * (dp - 1) / dp * dp_bytes
        cross_dp_local = dp * (max(1, world // local) - 1) * pp_bytes
        if cross_dp_local < cross_pp_local:
            return "dp-local", (f"{cross_dp_local / 1e6:.3g} MB/step of activations cross hosts "
                                f"vs {cross_pp_local / 1e6:.3g} MB/step of gradients otherwise")
        return "pp-local", (f"{cross_pp_local / 1e6:.3g} MB/step of gradients cross hosts vs "
                            f"{cross_dp_local / 1e6:.3g} MB/step of activations otherwise")
    if pp_fits:
        return "pp-local", "a pipeline fits in a host; activations stay local"
    if dp_fits:
        return "dp-local", f"a pipeline of {pp} does not fit in a host of {local} ranks"
    return "pp-local", f"neither {pp} stages nor {dp} replicas fit in a host of {local} ranks"


def _log_choice(dp: int, pp: int, local: int, where: str, why: str) -> None:
    log.info("hybrid mesh: %d replicas x %d stages on %d host(s) of %d ranks: %s (%s)",
             dp, pp, max(1, dp * pp // local), local,
             "pipeline stages of a replica share a host, data-parallel peers across hosts"
             if where == "pp-local" else
             "replicas of a stage share a host, pipeline neighbours across hosts", why)


def build_mesh(pp: int, dp: int | None = None, device_type: str | None = None, *,
               placement: str = "auto", dp_bytes: float | None = None,
               pp_bytes: float | None = None) -> HybridMesh:
    """Build the ``dp x pp`` mesh over the whole world (a collective: every rank calls it).

    Args:
        pp: Ranks per pipeline (pipeline stages, counting each rank once).
        dp: Replicas; default ``world_size // pp``.
        device_type: ``"cpu"`` or ``"cuda"``; default the type of ``parlay.device()``.
        placement: ``"auto"`` (see :func:`choose_placement`), ``"pp-local"`` or
            ``"dp-local"``.
        dp_bytes: Model gradient bytes per step, for ``"auto"`` across hosts.
        pp_bytes: Bytes crossing one stage boundary per step, for ``"auto"`` across hosts.

    Returns:
        This rank's :class:`HybridMesh`.

    Raises:
        ConfigError: No process group, or ``dp * pp`` differs from the world size.
    """
    if not dist.is_initialized():
        raise ConfigError("the pipeline needs a process group. Hint: call parlay.init() first.")
    world = dist.get_world_size()
    positive("pp (stages)", pp)
    if dp is None:
        if world % pp:
            raise ConfigError(
                f"the world of {world} rank(s) cannot be split into pipelines of {pp} stages: "
                f"expected world_size % stages == 0, got {world} % {pp} = {world % pp}. "
                f"Hint: launch a multiple of {pp} ranks (e.g. parlay run -n {pp * 2}), or "
                "change stages.")
        dp = world // pp
    positive("dp", dp)
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
    from torch.distributed.device_mesh import DeviceMesh

    from parlay import runtime

    local = runtime.local_size() if runtime.is_initialized() else world
    where, why = choose_placement(pp, dp, local, placement, dp_bytes, pp_bytes)
    if rank == 0:
        _log_choice(dp, pp, local, where, why)
    shape, names = ((dp, pp), ("dp", "pp")) if where == "pp-local" else ((pp, dp), ("pp", "dp"))
    # Each dimension's groups are built here, not by init_device_mesh: torch gives those its
    # 30-minute default timeout, and a stalled stage must surface within the configured one.
    grid, mine = torch.arange(world).reshape(shape), []
    with comm.comm_errors("new_group"):
        for d in range(2):
            for ranks in grid.movedim(d, -1).reshape(-1, shape[d]).tolist():
                g = runtime.new_group(ranks)
                mine += [g] if rank in ranks else []
        mesh = DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=names)
    dp_rank, pp_rank = (rank // pp, rank % pp) if where == "pp-local" else (rank % dp, rank // dp)
    return HybridMesh(dp=dp, pp=pp, dp_rank=dp_rank, pp_rank=pp_rank,
                      dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(),
                      device_mesh=mesh, placement=where)


def mean_over(value: float | torch.Tensor, group: Any) -> float:
    """Average a scalar over ``group`` (a collective over its members)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=comm.group_device(group))
    comm.allreduce(t, "avg", group=group)
    return float(t.item())
