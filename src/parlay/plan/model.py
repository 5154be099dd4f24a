"""The alpha-beta cost model's building blocks: links, clusters, workloads, collectives and
what each compressor puts on the wire. Pure functions of their arguments (no process
group); ``parlay plan`` and the benchmarks' predictions share them.

A message of ``b`` bytes over a link costs ``alpha + b / bandwidth`` (Hockney's model). Ring
collectives over ``n`` ranks (what gloo and NCCL run for large buffers; Patarasuk and Yuan 2009):

* allreduce: ``2(n-1)`` steps, each rank sends ``2(n-1)/n`` of the buffer;
* allgather of ``b`` bytes per rank: ``n-1`` steps, each rank sends ``(n-1) b``.

Each compressor describes its own wire (``Compressor.wire_rounds``) and CPU cost
(``Compressor.codec_s``); the functions here ask it, so a new compressor is priced as it is
registered.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from parlay.compress import Compressor, Round, available, get_compressor
from parlay.dp.buckets import BucketPlan, ParamInfo
from parlay.errors import ConfigError

__all__ = ["Link", "ClusterSpec", "Workload", "Costs", "compressor_of",
           "Round", "wire_rounds", "wire_bytes", "link_bytes", "allreduce_s", "allgather_s",
           "rounds_s", "codec_s", "DEFAULT_BUCKET_BYTES", "TCP_EFFICIENCY"]

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20  #: DistributedOptimizer's default bucket cap (25 MiB).
TCP_EFFICIENCY = 1448 / 1514  #: Payload per byte of Ethernet carrying TCP (1448 of 1514).


@dataclass(frozen=True)
class Link:
    """A network link as the alpha-beta model sees it.

    Attributes:
        bandwidth_bps: Line rate in bits per second (``float("inf")``: free).
        latency_s: One-way latency per message, seconds (alpha's network part).
        efficiency: Fraction of the line rate left for payload (TCP/IP and Ethernet headers;
            1.0 for a rate measured as payload goodput, as calibration does).
        burst_bytes: A token-bucket shaper's burst (``tc tbf``, a cloud NIC's burst credit):
            bytes that pass at once once the link has rested long enough to refill them.
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    efficiency: float = TCP_EFFICIENCY
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth_bps, (int, float)) and self.bandwidth_bps > 0):
            raise ConfigError(f"link bandwidth must be > 0 bits/s, got {self.bandwidth_bps!r}. "
                              "Hint: Link(10e9, 50e-6) is 10 Gbit/s with 50 us latency.")
        if not (isinstance(self.latency_s, (int, float)) and self.latency_s >= 0
                and math.isfinite(self.latency_s)):
            raise ConfigError(f"link latency must be a finite number of seconds >= 0, got "
                              f"{self.latency_s!r}. Hint: 50e-6 for 50 us.")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"link efficiency must be in (0, 1], got {self.efficiency!r}.")
        if not (isinstance(self.burst_bytes, (int, float)) and 0 <= self.burst_bytes < math.inf):
            raise ConfigError(f"link burst must be a finite number of bytes >= 0, got "
                              f"{self.burst_bytes!r}. Hint: 0 for a link without a shaper.")

    @property
    def beta(self) -> float:
        """Seconds per payload byte."""
        return 8.0 / (self.bandwidth_bps * self.efficiency)

    def transfer_s(self, nbytes: float, messages: int = 1) -> float:
        """Time to send ``nbytes`` in ``messages`` messages over this link."""
        return messages * self.latency_s + nbytes * self.beta


@dataclass(frozen=True)
class ClusterSpec:
    """Hosts, ranks per host and the links between them.

    Attributes:
        nodes: Hosts (>= 1).
        ranks_per_node: Training ranks per host (GPUs, or CPU processes).
        inter: Each host's link to the network (every host has its own, as on a switch).
        intra: Between ranks of one host; ``None``: free next to ``inter``.
        overlap: Fraction of backward that gradient communication can hide behind: 1.0 where
            communication has its own engine or core (GPUs, a spare CPU core), 0.0 where the
            ranks' compute already uses every core (communication then waits its turn).
    """

    nodes: int
    ranks_per_node: int
    inter: Link
    intra: Link | None = None
    overlap: float = 1.0

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                flag = "--nodes" if name == "nodes" else "--gpus-per-node"
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}. Hint: {flag} 1 "
                                  "for a single machine.")
        if not 0.0 <= self.overlap <= 1.0:
            raise ConfigError(f"overlap must be in [0, 1], got {self.overlap!r}.")

    @property
    def world(self) -> int:
        """Training ranks in total."""
        return self.nodes * self.ranks_per_node

    @property
    def local(self) -> Link:
        """The intra-host link (free when not given)."""
        return self.intra if self.intra is not None else Link(math.inf, 0.0, 1.0)


@dataclass(frozen=True)
class Workload:
    """One training step of a model.

    Attributes:
        params: Trainable parameters (elements).
        batch: Samples per data-parallel rank per step (the global batch is
            ``batch * world``; hybrid mode splits the same global batch over fewer replicas).
        compute_s_per_sample: Forward plus backward time per sample on one rank, seconds.
        layers: Layers a pipeline can split between (``None``: unknown, no limit checked).
        activation_numel: Elements per sample crossing a stage boundary (``None``: estimated
            as ``sqrt(params / layers)``, a square layer's width).
        shapes: Parameter shapes, when known (PowerSGD's factors depend on them).
        bytes_per_element: Gradient element size (4 for fp32).
    """

    params: float
    batch: int
    compute_s_per_sample: float
    layers: int | None = None
    activation_numel: float | None = None
    shapes: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    bytes_per_element: int = 4

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise ConfigError(f"params must be > 0, got {self.params!r}. "
                              "Hint: --model-params 25e6.")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ConfigError(f"batch must be an integer >= 1 (samples per rank per step), "
                              f"got {self.batch!r}. Hint: --batch 64.")
        if not (self.compute_s_per_sample >= 0 and math.isfinite(self.compute_s_per_sample)):
            raise ConfigError(f"compute time per sample must be >= 0 seconds, got "
                              f"{self.compute_s_per_sample!r}. Hint: --compute-ms 120 (per step).")
        if self.layers is not None and (isinstance(self.layers, bool) or self.layers < 1):
            raise ConfigError(f"layers must be >= 1, got {self.layers!r}.")

    @property
    def grad_bytes(self) -> float:
        """Bytes of one full gradient."""
        return self.params * self.bytes_per_element

    @property
    def compute_s(self) -> float:
        """Forward plus backward of one rank's batch."""
        return self.compute_s_per_sample * self.batch

    @property
    def layout(self) -> tuple[tuple[int, ...], ...] | None:
        """Shapes shape-aware compressors (PowerSGD) are priced on: ``shapes``, else ``layers``
        square matrices of ``params / layers`` elements; ``None`` when neither is known."""
        if self.shapes is not None or self.layers is None:
            return self.shapes
        side = max(1, math.isqrt(int(self.params / self.layers)))
        return ((side, side),) * self.layers

    def stage_layout(self, stages: int) -> tuple[tuple[int, ...], ...] | None:
        """The largest of ``stages`` runs of :attr:`layout`, cut as parlay balances pipeline
        stages (by parameters)."""
        layout = self.layout
        if not layout:
            return None
        total, acc = sum(math.prod(s) for s in layout), 0
        runs: list[list[tuple[int, ...]]] = [[]]
        for s in layout:
            if runs[-1] and len(runs) < stages and acc >= total * len(runs) / stages:
                runs.append([])
            runs[-1].append(s)
            acc += math.prod(s)
        return tuple(max(runs, key=lambda r: sum(math.prod(s) for s in r)))

    @property
    def act_numel(self) -> float:
        """Elements per sample at a stage boundary (given or estimated)."""
        if self.activation_numel is not None:
            return float(self.activation_numel)
        return math.sqrt(self.params / (self.layers or 1))


@dataclass(frozen=True)
class Costs:
    """Machine constants the model needs beyond the links (seconds; calibrated or defaults).

    Attributes:
        alpha_s: Software cost per collective step (gloo/NCCL message overhead).
        sum_s_per_elem: Summing one fp32 element in a reduction (CPU).
        half_sum_s_per_elem: Summing one fp16/bf16 element (gloo converts in software).
        cast_s_per_elem: fp16/bf16 encode plus decode per element (scale, cast, max).
        topk_s_per_elem: Top-k selection, error feedback and decode per bucket element.
        scatter_s_per_elem: Adding one received sparse value (per value, per rank).
        randomk_s_per_elem: Random-k encode plus decode per bucket element.
        powersgd_s_per_elem: PowerSGD per element that does not depend on the rank.
        powersgd_s_per_elem_rank: PowerSGD per element and per unit of rank (the matmuls).
        apply_s_per_elem: A parameter server applying one element of an update (SGD).
        ps_request_s: A parameter server's fixed cost per worker request (message packing,
            hand-off between its receiving threads and its update loop).
        incast_efficiency: Fraction of a link's rate left when several senders converge on
            it (pushes into a server, pulls into a worker) each sending more than the port's
            queue holds: the queue overflows and TCP backs off (incast).
        queue_s: How long a link's queue is, in seconds of its rate (tc tbf's ``latency``;
            shallow datacenter switches hold far less).
        duplex_efficiency: Fraction of a network link's rate a ring collective gets with both
            directions busy (each one's acknowledgements queue behind the other's data).
        pipe_op_s: Fixed cost of one stage-to-stage send or receive of a pipeline schedule
            (``torch.distributed.pipelining``'s per-micro-batch bookkeeping).
        copy_s_per_byte: Copying one byte in memory (CPU): gradients into a bucket or a push
            buffer, the bucket's averaging pass, pulled parameters into the model.
    """

    alpha_s: float = 100e-6
    sum_s_per_elem: float = 0.5e-9
    half_sum_s_per_elem: float = 20e-9
    cast_s_per_elem: float = 6e-9
    topk_s_per_elem: float = 8e-9
    scatter_s_per_elem: float = 10e-9
    randomk_s_per_elem: float = 4e-9
    powersgd_s_per_elem: float = 4e-9
    powersgd_s_per_elem_rank: float = 1.5e-9
    apply_s_per_elem: float = 2e-9
    ps_request_s: float = 2e-3
    incast_efficiency: float = 0.8
    queue_s: float = 0.05
    duplex_efficiency: float = 0.93
    pipe_op_s: float = 1e-3
    copy_s_per_byte: float = 0.1e-9


def compressor_of(spec: str | Compressor | None) -> Compressor:
    """The compressor a compression string names (the registry's one grammar, e.g.
    ``"topk:0.01,compact=1"``): the cost model asks it for its rounds, bytes and codec time.

    Raises:
        ConfigError: Unknown name or bad options.
    """
    try:
        return get_compressor(spec)
    except ConfigError as e:
        raise ConfigError(f"the cost model prices the registered compressors "
                          f"({', '.join(available())}): {e}") from None


def wire_rounds(compressor: str | Compressor | None, numel: float, world: int,
                shapes: Sequence[Sequence[int]] | None = None,
                bytes_per_element: int = 4, bucket_bytes: float | None = None) -> list[Round]:
    """The collectives that reduce ``numel`` gradient elements with ``compressor``.

    Args:
        compressor: A compression string (``"topk:0.01"``) or compressor.
        numel: Gradient elements reduced.
        world: Ranks in the reduction (int8 sends full precision above 128).
        shapes: Parameter shapes, for PowerSGD's factor sizes (``None``: parlay's layout-free
            near-square view).
        bytes_per_element: Dense element size.
        bucket_bytes: Reduced in buckets of this cap (``DistributedOptimizer``'s
            :data:`DEFAULT_BUCKET_BYTES`), each priced on its own and the rounds added up;
            ``None``: one reduction of all ``numel``.
    """
    comp = compressor_of(compressor)
    kw = {"world": world} if "world" in inspect.signature(comp.wire_rounds).parameters else {}
    total: dict[tuple[int, str, bool], float] = {}
    for (n, shp), count in _buckets(int(numel), shapes, bytes_per_element, bucket_bytes).items():
        for i, r in enumerate(comp.wire_rounds(n, shp, bytes_per_element, **kw)):
            total[i, r.kind, r.half] = total.get((i, r.kind, r.half), 0.0) + count * r.nbytes
    return [Round(kind, nbytes, half) for (_, kind, half), nbytes in total.items()]


_Shapes = tuple[tuple[int, ...], ...]


def _buckets(numel: int, shapes: Sequence[Sequence[int]] | None, bytes_per_element: int,
             cap: float | None) -> dict[tuple[int, _Shapes | None], int]:
    """``{(elements, shapes): how many buckets}``: with ``shapes``, as ``DistributedOptimizer``
    fills them (:class:`~parlay.dp.buckets.BucketPlan`), else full buckets and the rest."""
    layout = tuple(tuple(int(d) for d in s) for s in shapes) if shapes else None
    if cap is None:
        return {(numel, layout): 1}
    out: dict[tuple[int, _Shapes | None], int] = {}
    if layout is None:
        per = max(1, int(cap // bytes_per_element))
        full, rest = divmod(numel, per)
        return {k: v for k, v in (((per, None), full), ((rest, None), 1)) if k[0] and v}
    dtype = {1: torch.uint8, 2: torch.float16, 8: torch.float64}.get(bytes_per_element,
                                                                      torch.float32)
    plan = BucketPlan.build([ParamInfo("", math.prod(s), dtype) for s in layout], int(cap))
    extra = numel - sum(math.prod(s) for s in layout)  # (an estimated layout's rest: the last)
    for b in plan.buckets:
        key = (b.numel + (extra if b is plan.buckets[-1] else 0),
               tuple(layout[i] for i in b.members))
        out[key] = out.get(key, 0) + 1
    return out


def wire_bytes(compressor: str | Compressor | None, numel: float, world: int = 2,
               shapes: Sequence[Sequence[int]] | None = None) -> float:
    """Payload bytes one rank contributes per reduction (what ``comm_stats()`` counts)."""
    return sum(r.nbytes for r in wire_rounds(compressor, numel, world, shapes))


def link_bytes(compressor: str | Compressor | None, numel: float, world: int,
               shapes: Sequence[Sequence[int]] | None = None) -> float:
    """Bytes one rank sends over its link per reduction (ring collectives)."""
    return _ring_bytes(wire_rounds(compressor, numel, world, shapes), world)


def _ring_bytes(rounds: Sequence[Round], world: int) -> float:
    if world <= 1:
        return 0.0
    return sum((world - 1) * r.nbytes if r.kind == "allgather" else
               2 * (world - 1) / world * r.nbytes for r in rounds)


def allreduce_s(nbytes: float, world: int, link: Link, alpha_s: float = 0.0,
                sum_s_per_byte: float = 0.0) -> float:
    """Ring allreduce of ``nbytes`` over ``world`` ranks: ``2(n-1)(alpha + latency) +
    2(n-1)/n * nbytes * beta`` plus the local sums (``(n-1)/n`` of the buffer)."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    n = world
    return (2 * (n - 1) * (alpha_s + link.latency_s) + 2 * (n - 1) / n * nbytes * link.beta
            + (n - 1) / n * nbytes * sum_s_per_byte)


def allgather_s(nbytes: float, world: int, link: Link, alpha_s: float = 0.0) -> float:
    """Ring allgather of ``nbytes`` per rank: ``(n-1)(alpha + latency) + (n-1) nbytes beta``."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    return (world - 1) * (alpha_s + link.latency_s + nbytes * link.beta)


def rounds_s(rounds: Sequence[Round], world: int, link: Link, costs: Costs,
             messages: int = 1, half: bool = False, rested_s: float = 0.0) -> float:
    """Time of a reduction's collectives over one ring, split into ``messages`` buckets; a
    link with a burst sends what ``rested_s`` (e.g. the compute between steps) refilled at once."""
    credit = min(link.burst_bytes, max(0.0, rested_s) * link.bandwidth_bps / 8)  # refilled
    if link.efficiency < 1.0:  # a network link, not the measured loopback
        link = Link(link.bandwidth_bps, link.latency_s,
                    link.efficiency * costs.duplex_efficiency)
    total = 0.0
    for r in rounds:
        if r.kind == "allgather":
            total += allgather_s(r.nbytes, world, link, costs.alpha_s * messages)
        else:
            per_byte = (costs.half_sum_s_per_elem / 2 if half or r.half
                        else costs.sum_s_per_elem / 4)
            total += allreduce_s(r.nbytes, world, link, costs.alpha_s * messages, per_byte)
        total += (messages - 1) * 2 * (world - 1) * link.latency_s if world > 1 else 0.0
    return total - min(_ring_bytes(rounds, world), credit) * link.beta


def codec_s(compressor: str | Compressor | None, numel: float, world: int,
            costs: Costs) -> float:
    """CPU time to encode this rank's gradient and decode the reduced result."""
    return compressor_of(compressor).codec_s(numel, world, costs)
