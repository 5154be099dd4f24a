"""ShardPlan: which parameter-server rank holds which part of which parameter (pure, no I/O).

The plan is the parameter-server counterpart of TF's ``replica_device_setter``: given the
trainable parameters (name, shape, dtype) and the number of servers, it assigns every element
to exactly one server. Two placements:

* ``"balanced"`` (default): greedy longest-processing-time by bytes; each tensor, largest first,
  goes to the server holding the fewest bytes so far (ties go to the lowest server index).
* ``"round_robin"``: tensor ``i`` goes to server ``i % num_servers`` in model order, as TF does.

A tensor larger than ``split_bytes`` is cut into contiguous, nearly equal chunks of its
flattened view, one per server (at most ``num_servers`` chunks, on distinct servers), so one
huge embedding does not make one server the bottleneck (BytePS partitions for the same reason).
The balanced placement also cuts, over every server, each tensor larger than an equal share of
the model (its bytes over the server count): every server's link then carries about the same
bytes, where whole tensors would leave the server with the largest one the slowest (a
784-2048-2048-10 MLP on 4 servers held 8.4 MB on one and 0.1 MB on another, not 5.8 MB each).
``split_bytes=None`` never cuts (for optimizers that need whole tensors, e.g. Adafactor; a
session passes it for an optimizer outside :data:`~parlay.ps.chunks.ELEMENTWISE` by default).

Each server's pieces are laid out back to back, in model order, in one flat buffer: the wire
format of pushes and pulls. Whole tensors keep their shape on the server (so per-tensor
optimizers see the same tensors as in single-process training); chunks are 1-D.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from parlay.errors import ConfigError

__all__ = ["Piece", "ShardPlan", "PLACEMENTS", "DEFAULT_SPLIT_BYTES"]

#: Placement policies accepted by :class:`ShardPlan`.
PLACEMENTS = ("balanced", "round_robin")

#: Tensors above this many bytes are split across servers by default (8 MiB).
DEFAULT_SPLIT_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Piece:
    """A contiguous range of one parameter's flattened elements, held by one server.

    Attributes:
        name: Parameter name (as in ``model.named_parameters()``).
        param: Index of the parameter in model order.
        start: First element of the range in the flattened parameter.
        length: Number of elements.
        server: Server index (0-based among the parameter servers) that holds the range.
        offset: Position of the range in that server's flat buffer.
        shape: Shape the server gives the piece: the parameter's shape when the piece is the
            whole tensor, ``(length,)`` for a chunk of a split tensor.
    """

    name: str
    param: int
    start: int
    length: int
    server: int
    offset: int
    shape: tuple[int, ...]

    def as_row(self) -> list[Any]:
        """Plain list form (for checkpoints loaded with ``weights_only=True``)."""
        return [self.name, self.param, self.start, self.length, self.server, self.offset,
                list(self.shape)]


class ShardPlan:
    """Placement of trainable parameters on parameter servers.

    Args:
        params: ``(name, shape, dtype)`` for each trainable parameter, in model order.
        num_servers: Number of parameter servers (>= 1).
        placement: ``"balanced"`` (by bytes) or ``"round_robin"``.
        split_bytes: Tensors with more bytes than this are split across servers (``balanced``:
            so are tensors larger than an equal share of the model); ``None`` never splits.

    Raises:
        ConfigError: No parameters, a bad server count, placement or threshold.

    Example:
        >>> plan = ShardPlan.from_module(model, num_servers=2)
        >>> [p.name for p in plan.pieces(0)]
    """

    def __init__(self, params: Sequence[tuple[str, Sequence[int], torch.dtype]], num_servers: int,
                 *, placement: str = "balanced",
                 split_bytes: int | None = DEFAULT_SPLIT_BYTES) -> None:
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise ConfigError(f"num_servers must be an int >= 1, got {num_servers!r}. "
                              "Hint: launch with `parlay run -n N --ps K` and K >= 1.")
        if placement not in PLACEMENTS:
            raise ConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}.")
        if split_bytes is not None and (isinstance(split_bytes, bool)
                                        or not isinstance(split_bytes, int) or split_bytes < 1):
            raise ConfigError(f"split_bytes must be a positive int or None, got {split_bytes!r}. "
                              "Hint: e.g. split_bytes=8 * 2**20 (8 MiB).")
        params = [(str(n), tuple(int(d) for d in s), dt) for n, s, dt in params]
        if not params:
            raise ConfigError("the model has no trainable parameters; a parameter server has "
                              "nothing to hold. Hint: check requires_grad on the model.")
        self.num_servers = num_servers
        self.placement = placement
        self.split_bytes = split_bytes
        self.params = params
        chunks = self._chunks()
        owner = self._assign(chunks)
        self._pieces: list[list[Piece]] = [[] for _ in range(num_servers)]
        # Lay each server's pieces out in model order (param, then start) for determinism.
        for (pi, start, length), server in sorted(zip(chunks, owner)):
            name, shape, _ = params[pi]
            numel = math.prod(shape)
            pshape: tuple[int, ...] = tuple(shape) if length == numel else (length,)
            off = sum(p.length for p in self._pieces[server])
            self._pieces[server].append(Piece(name, pi, start, length, server, off, pshape))

    @classmethod
    def from_module(cls, model: nn.Module, num_servers: int, **kw: object) -> ShardPlan:
        """Plan for ``model``'s parameters with ``requires_grad`` (frozen ones stay local)."""
        specs = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()
                 if p.requires_grad]
        return cls(specs, num_servers, **kw)  # type: ignore[arg-type]

    # -- construction -------------------------------------------------------------------------
    def _nbytes(self, pi: int, length: int) -> int:
        return length * torch.empty((), dtype=self.params[pi][2]).element_size()

    def _chunks(self) -> list[tuple[int, int, int]]:
        out = []
        sizes = [self._nbytes(pi, math.prod(shape)) for pi, (_, shape, _) in
                 enumerate(self.params)]
        share = math.ceil(sum(sizes) / self.num_servers)
        for pi, (_, shape, _) in enumerate(self.params):
            numel = math.prod(shape)
            n = 1
            if self.split_bytes is not None and sizes[pi] > self.split_bytes:
                n = min(self.num_servers, math.ceil(sizes[pi] / self.split_bytes),
                        max(numel, 1))
            if self.split_bytes is not None and self.placement == "balanced" and \
                    sizes[pi] > min(share, self.split_bytes):
                n = min(self.num_servers, max(numel, 1))  # a piece on every server
            base, extra = divmod(numel, n)
            start = 0
            for c in range(n):
                length = base + (1 if c < extra else 0)
                out.append((pi, start, length))
                start += length
        return out

    def _assign(self, chunks: list[tuple[int, int, int]]) -> list[int]:
        owner = [0] * len(chunks)
        if self.placement == "round_robin":
            for i in range(len(chunks)):
                owner[i] = i % self.num_servers
            return owner
        load = [0] * self.num_servers
        by_param: dict[int, list[int]] = {}
        for i, (pi, _, _) in enumerate(chunks):
            by_param.setdefault(pi, []).append(i)
        # Largest tensors first; ties in model order. Chunks of one tensor go to the least
        # loaded *distinct* servers.
        order = sorted(by_param, key=lambda pi: (-self._nbytes(pi, math.prod(self.params[pi][1])),
                                                 pi))
        for pi in order:
            idx = by_param[pi]
            servers = sorted(range(self.num_servers), key=lambda s: (load[s], s))[: len(idx)]
            for i, s in zip(idx, servers):
                owner[i] = s
                load[s] += self._nbytes(pi, chunks[i][2])
        return owner

    # -- queries ------------------------------------------------------------------------------
    def pieces(self, server: int) -> list[Piece]:
        """Pieces held by ``server``, in buffer order."""
        if not 0 <= server < self.num_servers:
            raise ConfigError(f"server must be in [0, {self.num_servers}), got {server}.")
        return list(self._pieces[server])

    def all_pieces(self) -> Iterable[Piece]:
        """Every piece of every server."""
        for ps in self._pieces:
            yield from ps

    def numel(self, server: int) -> int:
        """Elements in ``server``'s flat buffer."""
        return sum(p.length for p in self._pieces[server])

    def nbytes(self, server: int) -> int:
        """Bytes in ``server``'s flat buffer."""
        return sum(self._nbytes(p.param, p.length) for p in self._pieces[server])

    def servers_of(self, name: str) -> list[int]:
        """Servers holding (part of) parameter ``name``, in element order."""
        found = [p for p in self.all_pieces() if p.name == name]
        if not found:
            raise ConfigError(f"no parameter named {name!r} in the plan; "
                              f"known: {', '.join(n for n, _, _ in self.params)}.")
        return [p.server for p in sorted(found, key=lambda p: p.start)]

    def rows(self) -> list[list[Any]]:
        """The plan as plain lists (stored in checkpoints to detect a changed placement)."""
        return [p.as_row() for p in self.all_pieces()]

    def fingerprint(self) -> int:
        """A stable 31-bit hash of the placement and dtypes: every rank must agree on it."""
        import zlib

        text = repr((self.rows(), [str(dt) for _, _, dt in self.params]))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF

    def describe(self) -> str:
        """A readable table: one line per server with its bytes and parameters."""
        lines = []
        for s in range(self.num_servers):
            names = ", ".join(p.name if p.length == math.prod(self.params[p.param][1])
                              else f"{p.name}[{p.start}:{p.start + p.length}]"
                              for p in self._pieces[s])
            lines.append(f"ps{s}: {self.nbytes(s)} bytes: {names or '(empty)'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ShardPlan(num_servers={self.num_servers}, placement={self.placement!r}, "
                f"bytes={[self.nbytes(s) for s in range(self.num_servers)]})")
