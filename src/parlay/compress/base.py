"""Compressor protocol and registry: what a compressor is, how one is named and built.

A compressor turns a flat bucket into a *payload* (a list of tensors) and back. When its
payloads can be summed element-wise on the wire (``summable``: none, fp16, bf16, random-k with a
shared seed) the reduction is one allreduce; otherwise (top-k) every rank's payload is
allgathered and decoded locally. That reduction, the one code path the data-parallel optimizer,
parameter-server pushes and hybrid mode's data-parallel groups share, is
:func:`parlay.compress.reduce.reduce_async`.

The contract every caller may rely on (stable API):

* ``compress(flat, key) -> (payload, ctx)``: ``flat`` is a 1-D bucket; compress never
  modifies it (reduce_async with the identity compressor reduces it in place). ``key`` names
  the bucket (stable across steps, e.g. ``"bucket0"``; use distinct keys per group/stage) so
  stateful compressors keep per-bucket memory (error-feedback residuals, random-k step
  counters, PowerSGD's Q). For a collective, call it exactly once per bucket per step on every
  rank of the group, in the same order (random-k's shared indices depend on that count).
* ``decompress`` and ``aggregate`` are pure functions of their arguments (state lives only on
  the sender), so a parameter server can decode with its own instance.
* ``payload`` is a list of tensors (what crosses the wire; ``CommStats`` counts their bytes).
  ``ctx`` is small metadata of plain values (shape, dtype, scale, seed: None, bool, int, float,
  dtype, str, and tuples, dicts or dataclasses of them). A receiver in another process (a
  parameter server, the other ranks of an allgather) decodes with ``decompress(payload, ctx)``
  on an instance of the same compressor, with the sender's ``ctx`` values carried along
  (:mod:`parlay.compress.ctxwire`).
* ``summable`` compressors decode a *sum* of payloads to the sum of inputs (allreduce);
  otherwise every rank's payload is gathered, then decoded with its own ``ctx`` and summed, or
  with ``shared_ctx`` (a ``ctx`` the same on every rank) by ``aggregate(payloads, ctx)``.
* ``next_round(reduced, ctx)`` (default ``None``) lets a compressor run further collective
  rounds after the first allreduce: PowerSGD sends P then Q, fp16 retries in fp32 on overflow.
  Compressors with ``point_to_point = False`` (PowerSGD) need those rounds and therefore only
  work through :func:`~parlay.compress.reduce.reduce_async`, never for parameter-server pushes.
* ``set_layout(key, shapes)`` (default no-op) tells shape-aware compressors (PowerSGD) which
  tensors a bucket concatenates; the data-parallel optimizer calls it once per bucket.
* ``is_summable(ctx)`` says whether *this* payload sums on the wire (``auto`` varies per bucket).
* Each compressor prices itself for the cost model and ``auto``: ``wire_rounds`` (the
  collectives and bytes of one reduction), ``codec_s`` (its CPU time from the machine
  constants named in ``cost_fields``) and ``convergence`` (the steps it needs to reach an
  accuracy target relative to dense, from measured factors). ``ctx_to_wire``/``ctx_from_wire``
  carry a context's plain values to a receiver that holds a different candidate's template
  (``auto``'s pushes).
"""
from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from parlay.errors import ConfigError
from parlay.registry import Registry

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["Compressor", "NoneCompressor", "register", "get_compressor", "available",
           "CommStats", "reusable", "Round", "own_compressor"]


@dataclass(frozen=True)
class Round:
    """One collective of a reduction: ``kind`` ("allreduce" | "allgather"), the bytes each rank
    gives, and whether it sums 16-bit floats (gloo sums those in software: slower per byte)."""

    kind: str
    nbytes: float
    half: bool = False


class Compressor:
    """Base class: compress a flat 1-D bucket into a payload and back.

    Subclasses set ``name`` and ``summable`` and implement :meth:`compress` /
    :meth:`decompress`. ``key`` identifies the bucket (stable across steps) so stateful
    compressors (error feedback, PowerSGD) keep per-bucket memory.
    """

    name: ClassVar[str] = "base"
    #: True when sum of payloads decodes to the sum of inputs, so allreduce can carry them.
    summable: ClassVar[bool] = True
    #: False when decoding needs further collective rounds (PowerSGD): reduce_async only.
    point_to_point: ClassVar[bool] = True
    #: Collective rounds every reduction takes (PowerSGD: 2). Reductions of such compressors
    #: return a :class:`RoundsHandle`, whose ``advance()`` lets a caller start the next round
    #: of many buckets before it waits for any. A further round that only sometimes happens
    #: (fp16's overflow retry) does not count: advancing would only wait for the first.
    rounds: ClassVar[int] = 1
    #: True when ``decompress`` (summable) or ``aggregate`` (not) accept ``out=``: a tensor
    #: shaped like the bucket to decode into instead of allocating (see reduce_async's into).
    decodes_into: ClassVar[bool] = False
    #: The :class:`parlay.plan.Costs` fields :meth:`codec_s` reads, the per-element one first: a
    #: codec time measured now replaces that one and zeroes the others (parlay.plan.insitu).
    cost_fields: ClassVar[tuple[str, ...]] = ()
    #: True when it encodes ``a * x`` as ``a`` times the encoding of ``x`` (``a > 0``): a caller
    #: may then scale the bucket before the sum instead of the result after it.
    homogeneous: ClassVar[bool] = False
    #: True when ``ctx`` is the same on every rank (sizes, a shared seed). Otherwise an
    #: allgather sends every rank's ``ctx`` along (its plain values, never pickled) and decodes
    #: each payload with its sender's: a per-rank scale may live in ``ctx``.
    shared_ctx: ClassVar[bool] = False

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        """Encode ``flat``. Returns ``(payload, ctx)``; ``ctx`` stays local."""
        raise NotImplementedError

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one payload (or the sum of payloads, when summable) to a flat tensor shaped
        and typed like the original bucket.

        Args:
            payload: What :meth:`compress` returned (or the group's sum of it).
            ctx: The context :meth:`compress` returned with it.
            out: Only for compressors with ``decodes_into``: a tensor shaped like the bucket to
                decode into (and return) when it fits. Others are never given one.
        """
        raise NotImplementedError

    def aggregate(self, payloads: list[list[torch.Tensor]], ctx: Any,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the decoded payloads of every rank (used when not summable); ``out`` as for
        :meth:`decompress`."""
        total = self.decompress(payloads[0], ctx)
        for p in payloads[1:]:
            total = total + self.decompress(p, ctx)
        return total

    def next_round(self, reduced: list[torch.Tensor], ctx: Any) -> list[torch.Tensor] | None:
        """After a round's allreduce, return the next payload to allreduce, or ``None``.

        ``reduced`` is the summed payload of the round that just finished (identical on every
        rank). When this returns ``None``, ``decompress(reduced, ctx)`` gives the result.
        """
        return None

    def shard_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype a sharded optimizer's reduce-scatter carries a ``dtype`` bucket in, or
        ``None`` when this compressor is not an element-wise cast (its payloads cannot be summed
        chunk by chunk along a ring)."""
        return None

    def set_layout(self, key: str, shapes: list[tuple[int, ...]]) -> None:
        """Hint: bucket ``key`` is the concatenation of tensors of these shapes, in order."""

    def is_summable(self, ctx: Any) -> bool:
        """Whether the payload :meth:`compress` returned with ``ctx`` sums on the wire."""
        return self.summable

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4) -> list[Round]:
        """The collectives that reduce a ``numel`` bucket (``shapes``: its tensors, if known),
        with the bytes each rank gives; the default sends the bucket as it is."""
        return [Round("allreduce" if self.summable else "allgather", numel * bytes_per_element)]

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        """CPU seconds to encode one rank's ``numel`` elements and decode the reduced result
        over ``world`` ranks, from ``costs`` (a :class:`parlay.plan.Costs`)."""
        return 0.0

    def convergence(self, factors: Mapping[str, float]) -> float | None:
        """Steps it needs to reach an accuracy target, as a multiple of dense training's, from
        ``factors`` (measured per compressor, keyed by ``repr``: see
        :func:`parlay.plan.advise.convergence_table`): ``math.inf`` when it never reached the
        target, ``None`` when unmeasured. The default looks up its own configuration; a
        compressor whose convergence is known otherwise overrides it."""
        return factors.get(repr(self))

    def ctx_to_wire(self, ctx: Any) -> tuple[Any, ...]:
        """The plain values (bool, int, float, dtype, str) a receiver needs to rebuild ``ctx``."""
        return ()

    def ctx_from_wire(self, values: tuple[Any, ...]) -> Any:
        """The context :meth:`ctx_to_wire` described."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (e.g. error-feedback residuals)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def rescale_owed(self, factor: float) -> None:
        """Multiply what error feedback owes by ``factor``: the gradients it is in units of were
        rescaled (an fp16 loss scale changed). Default: this compressor's ``memory``
        (:class:`~parlay.compress.feedback.Residuals`), where it keeps one."""
        memory = getattr(self, "memory", None)
        if memory is not None:
            memory.scale_(factor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ClassOrInstance:
    """On the class: Horovod's function ``fn(tensor, ...)``; on an instance: parlay's bucket
    method, so ``Compression.none.compress(t)`` works as in Horovod and instances are parlay's."""

    def __init__(self, horovod_fn: Callable[..., Any], method: Callable[..., Any]) -> None:
        self.horovod_fn, self.method = horovod_fn, method

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self.horovod_fn if obj is None else self.method.__get__(obj, objtype)


class NoneCompressor(Compressor):
    """Identity: the bucket goes on the wire as it is (also Horovod's ``Compression.none``:
    on the class, ``compress(tensor) -> (tensor, None)`` and ``decompress(tensor, ctx)``)."""

    name = "none"
    summable = True
    homogeneous = True
    _horovod_style = True
    compress = ClassOrInstance(lambda t: (t, None),
                               lambda self, flat, key: ([flat], None))
    decompress = ClassOrInstance(lambda t, ctx: t,
                                 lambda self, payload, ctx: payload[0])

    def shard_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return dtype


_REGISTRY: Registry[Callable[..., Compressor]] = Registry(
    "compression", valid="valid names", example="options after a colon, e.g. 'topk:0.01'")


def register(name: str, factory: Callable[..., Compressor], *, replace: bool = False) -> None:
    """Register ``factory`` under ``name``; ``"name:a,b"`` strings call ``factory(a, b)``.
    A name taken already (a built-in's too) is refused unless ``replace``."""
    _REGISTRY.register(name, factory, replace=replace)


def available() -> list[str]:
    """Names of every registered compressor."""
    return _REGISTRY.available()


def get_compressor(spec: str | Compressor | None) -> Compressor:
    """Build a compressor from a name with options (``"topk:0.01"``) or return the object given.

    Raises:
        ConfigError: Unknown name (the message lists valid ones), bad options, or an object
            whose ``compress`` cannot take ``(flat, key)`` (a Horovod-style compressor).
    """
    if spec is None:
        return NoneCompressor()
    if not isinstance(spec, str):
        comp = spec() if isinstance(spec, type) and issubclass(spec, Compressor) else spec
        # Duck-typed compressors (e.g. parlay.Compression.fp16 objects) are accepted as is.
        if not isinstance(comp, Compressor) and not (
                hasattr(comp, "compress") and hasattr(comp, "decompress")):
            raise ConfigError(f"compression must be a name like 'fp16' or 'topk:0.01' or a "
                              f"Compressor, got {type(spec).__name__}.")
        try:
            inspect.signature(comp.compress).bind(None, None)
        except TypeError:  # Horovod's static compress(tensor) would fail at the first sync
            raise ConfigError(
                f"compression {spec!r} does not follow parlay's compressor protocol: its "
                "compress cannot be called as compress(flat, key) -> (payload, ctx), with "
                "decompress(payload, ctx), as parlay.compression.Compressor defines (Horovod's "
                "compress(tensor) -> (tensor, ctx) is another protocol). Fix: pass a "
                "Horovod-style compressor to parlay.horovod.DistributedOptimizer, which adapts "
                "it, or subclass parlay.compression.Compressor.") from None
        except ValueError:  # no signature to inspect (a builtin): trust it
            pass
        return comp
    factory, args = _REGISTRY.lookup(spec)
    try:
        return factory(*args)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad options for compression {spec!r}: {e}") from e


register("none", NoneCompressor)

# id(compressor) -> the live optimizer that uses it (see own_compressor)
_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def own_compressor(spec: str | Compressor | None, owner: Any) -> Compressor:
    """:func:`get_compressor` for ``owner`` (an optimizer). A compressor object another live
    optimizer already uses is copied: compressors keep per-bucket state (residuals, scales)
    under keys every optimizer names alike (``"bucket0"``), so one object shared by two
    optimizers (a GAN's, say) would mix their state."""
    comp = get_compressor(spec)
    other = _OWNERS.get(id(comp))
    if other is not None and other is not owner:
        comp = copy.deepcopy(comp)
    _OWNERS[id(comp)] = owner
    return comp


def check_state_writer(compressor: Compressor, state: Any, wrote: str | None) -> None:
    """Refuse compression ``state`` written by another compressor (``wrote``: the writer's
    ``repr``, ``None`` where not recorded) before an optimizer loads it: ``compressor`` would
    drop or misread its residuals.

    Raises:
        ConfigError: ``state`` is not empty and another compressor wrote it.
    """
    if state and wrote is not None and wrote != repr(compressor):
        raise ConfigError(f"this optimizer state holds the compression state of {wrote}; this "
                          f"optimizer compresses with {compressor!r}, which cannot take it. "
                          "Hint: load it with the compression that wrote it.")


@dataclass
class CommStats:
    """Bytes a component put on the wire: before (dense) and after compression."""

    dense_bytes: int = 0
    wire_bytes: int = 0
    reductions: int = 0

    def add(self, dense: int, wire: int) -> None:
        self.dense_bytes += dense
        self.wire_bytes += wire
        self.reductions += 1

    def add_wire(self, wire: int) -> None:
        """Bytes of a further round of the same reduction (PowerSGD's Q, an fp16 retry)."""
        self.wire_bytes += wire

    @property
    def ratio(self) -> float:
        """Dense bytes divided by wire bytes (1.0 when nothing was sent)."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def as_dict(self) -> dict[str, float]:
        return {"dense_bytes": self.dense_bytes, "wire_bytes": self.wire_bytes,
                "reductions": self.reductions, "ratio": self.ratio}


def reusable(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> TypeIs[torch.Tensor]:
    """Whether a decoder may write its result into ``out`` (the caller's bucket, see
    :func:`~parlay.compress.reduce.reduce_async`'s ``into``): it is given and has the
    result's shape, dtype and device."""
    return (out is not None and out.dtype == dtype and out.device == device
            and tuple(out.shape) == tuple(shape))
