"""Wire format of parameter-server messages: one flat ``uint8`` tensor per message.

Every message is a fixed 256-byte header of int64 fields followed by up to
:data:`MAX_TENSORS` tensors' raw bytes (each 8-byte aligned). Packing header and payload into
one buffer makes each push or reply *atomic*: a worker that dies mid-step can never leave a
server holding a header whose payload will not come, and the server's any-source receive
(gloo ``recv(src=None)``) takes whole messages in arrival order. gloo accepts a message smaller
than the posted buffer, so receivers post one buffer of the largest size they can get.
No pickling: only tensors and integers cross the wire.

A push's last tensor ends with an int64 flag for each piece of the server's shard, 1 where the
worker had no gradient for it (a frozen or unused parameter). A ``sync`` dense push may instead
be chunked (:mod:`parlay.ps.chunks`): a PUSH header whose ``extra`` is the number of chunks (its
one tensor: the flags), then each chunk of the flat gradient as a raw tensor tagged
``TAG_PUSH_CHUNK + k``; the parameters come back as raw chunks tagged ``TAG_REPLY_CHUNK + k``,
then a PARAMS header without payload. Per-chunk tags keep every chunk's receive unambiguous.
"""
from __future__ import annotations

import copy
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from parlay.compress import ctxwire
from parlay.compress.ctxwire import encode_ctx
from parlay.errors import CommError, ConfigError

__all__ = ["Op", "Err", "Message", "HEADER_BYTES", "MAX_TENSORS", "pack", "unpack", "capacity",
           "TAG_PUSH", "TAG_REPLY", "TAG_PUSH_CHUNK", "TAG_REPLY_CHUNK", "MAX_CHUNKS",
           "encode_ctx", "decode_ctx", "probe", "push_capacity", "reply_capacity"]

#: Tag of worker -> server messages (any-source on the server).
TAG_PUSH = 0x5053
#: Tag of server -> worker replies.
TAG_REPLY = 0x5054
#: Chunk ``k`` of a chunked push travels with tag ``TAG_PUSH_CHUNK + k`` ...
TAG_PUSH_CHUNK = 0x10000
#: ... and chunk ``k`` of the parameters that answer it with ``TAG_REPLY_CHUNK + k``.
TAG_REPLY_CHUNK = 0x20000
#: Most chunks per push (each needs a tag of its own).
MAX_CHUNKS = 0x10000

MAX_TENSORS = 4
_MAX_DIMS = 3
_FIELDS = 8  # op, sender, step, version, scalar, ntensors, nbytes, extra
_META = 2 + _MAX_DIMS  # dtype, ndim, dims
HEADER_INTS = 32
HEADER_BYTES = HEADER_INTS * 8
assert _FIELDS + MAX_TENSORS * _META <= HEADER_INTS

_DTYPES, _CODE = ctxwire.DTYPES, ctxwire.DTYPE_CODE


class Op:
    """Message kinds (header field 0)."""

    HELLO = 1  #: worker -> server: send me the parameters (first pull)
    PUSH = 2   #: worker -> server: a gradient; the reply carries fresh parameters
    DONE = 3   #: worker -> server: I finished; the reply is BYE
    FAIL = 4   #: worker -> server: I raised an error and stop
    SAVE = 5   #: worker -> server: checkpoint at my step (``extra``); the reply is SAVED
    EPOCH = 6  #: worker -> server: I ended epoch ``extra``, training ``scalar`` samples of it
    PARAMS = 10  #: server -> worker: parameters (version, staleness of the last push)
    BYE = 11     #: server -> worker: acknowledged DONE
    ERROR = 12   #: server -> worker: training cannot go on (field ``extra`` = lost rank)
    SAVED = 13   #: server -> worker: checkpoint ``extra`` is written (every live worker asked)
    EPOCHED = 14  #: server -> worker: every live worker ended the epoch; the payload holds
    #: the samples each worker trained of it (-1: lost or done)
    WAIT = 15  #: server -> worker: still waiting for other workers (the reply follows);
    #: worker -> server: heard, listening on (the server sends the next WAIT only then)


class Err:
    """Error kinds of an ERROR reply (header field ``scalar``)."""

    LOST = 1      #: a peer worker was lost (sync cannot continue)
    FAILED = 2    #: a peer worker raised an error (sync cannot continue)
    EVICTED = 3   #: this worker was declared lost earlier (it was silent past the timeout)
    MISMATCH = 4  #: this worker's model (its ShardPlan) differs from the server's
    SAVE_MISMATCH = 5  #: the live workers waited at different checkpoints or epoch ends, or
    #: some at one while the others went on training
    GONE = 6      #: a peer worker's connection closed (its process died; sync cannot continue)


@dataclass
class Message:
    """A decoded message.

    Attributes:
        op: One of :class:`Op`.
        sender: Worker index (pushes) or server index (replies).
        step: Worker clock: pushes of that worker applied so far (or the push's step).
        version: Parameter version (the base version of a push, the version of a reply).
        scalar: A float (learning-rate factor of a push) or small int (staleness, error kind).
        extra: Free int (the lost peer's global rank of an ERROR, a timeout in ms...).
        tensors: Payload tensors (views into the receive buffer unless cloned).
    """

    op: int
    sender: int
    step: int = 0
    version: int = 0
    scalar: float = 0.0
    extra: int = 0
    tensors: list[torch.Tensor] = field(default_factory=list)


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def capacity(payload_bytes: int, ntensors: int = 1) -> int:
    """Buffer bytes needed for a message whose tensors hold ``payload_bytes`` in total."""
    return HEADER_BYTES + payload_bytes + 8 * max(ntensors, 1)


def reply_capacity(numel: int, element_size: int, num_workers: int) -> int:
    """Buffer bytes of a server's replies: its shard's parameters, or the per-worker sample
    counts of an epoch end (EPOCHED)."""
    return capacity(max(numel * element_size, 8 * num_workers))


def pack(msg: Message, out: torch.Tensor) -> torch.Tensor:
    """Write ``msg`` into the ``uint8`` buffer ``out``; return the used prefix (a view).

    Raises:
        ConfigError: Too many tensors, too many dimensions, an unsupported dtype, or a payload
            larger than ``out``.
    """
    if len(msg.tensors) > MAX_TENSORS:
        raise ConfigError(f"a parameter-server message carries at most {MAX_TENSORS} tensors, "
                          f"got {len(msg.tensors)}. Hint: use a compressor with fewer payload "
                          "tensors.")
    head = [0] * HEADER_INTS
    head[0], head[1], head[2], head[3] = msg.op, msg.sender, msg.step, msg.version
    head[4] = struct.unpack("<q", struct.pack("<d", float(msg.scalar)))[0]
    head[5], head[7] = len(msg.tensors), msg.extra
    pos = HEADER_BYTES
    spans = []
    for i, t in enumerate(msg.tensors):
        if t.dtype not in _CODE:
            raise ConfigError(f"payload dtype must be one of {_DTYPES}, got {t.dtype}.")
        if t.dim() > _MAX_DIMS:
            raise ConfigError(f"payload tensors have at most {_MAX_DIMS} dims, got {t.dim()}.")
        dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        base = _FIELDS + i * _META
        head[base: base + _META] = [_CODE[t.dtype], t.dim(), *dims]
        n = t.numel() * t.element_size()
        spans.append((pos, n, t))
        pos = _align(pos + n)
    head[6] = pos - HEADER_BYTES
    if pos > out.numel():
        raise ConfigError(f"message of {pos} bytes does not fit the {out.numel()}-byte buffer "
                          "agreed with the server. Hint: the compressor's payload grew beyond "
                          "what it produced at setup; use a compressor with a fixed payload size.")
    out[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(head, dtype=torch.int64))
    for start, n, t in spans:
        if n:
            src = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
            out[start: start + n].copy_(src)
    return out[:pos]


def unpack(buf: torch.Tensor, clone: bool = False) -> Message:
    """Decode a message from the ``uint8`` buffer ``buf``.

    Args:
        buf: The receive buffer (only the prefix the header describes is read).
        clone: Copy payload tensors out of ``buf`` (needed when ``buf`` is reused).
    """
    if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1):
        raise _malformed(f"expected a 1-D uint8 buffer, got {getattr(buf, 'dtype', type(buf))}")
    if buf.numel() < HEADER_BYTES:
        raise _malformed(f"{buf.numel()} bytes, shorter than the {HEADER_BYTES}-byte header")
    head = buf[:HEADER_BYTES].contiguous().view(torch.int64).tolist()
    scalar = struct.unpack("<d", struct.pack("<q", head[4]))[0]
    msg = Message(op=head[0], sender=head[1], step=head[2], version=head[3], scalar=scalar,
                  extra=head[7])
    if not 0 <= head[5] <= MAX_TENSORS:
        raise _malformed(f"it announces {head[5]} tensors (at most {MAX_TENSORS})")
    pos = HEADER_BYTES
    for i in range(head[5]):
        base = _FIELDS + i * _META
        code, ndim = head[base], head[base + 1]
        if not (0 <= code < len(_DTYPES) and 0 <= ndim <= _MAX_DIMS):
            raise _malformed(f"tensor {i} has dtype code {code} and {ndim} dims")
        dtype = _DTYPES[code]
        shape = tuple(head[base + 2: base + 2 + ndim])
        if any(d < 0 for d in shape):
            raise _malformed(f"tensor {i} has a negative dimension {shape}")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if pos + n > buf.numel():
            raise _malformed(f"tensor {i} {shape} needs bytes up to {pos + n}, the message "
                             f"has {buf.numel()}")
        t = buf[pos: pos + n].view(dtype).view(shape)
        msg.tensors.append(t.clone() if clone else t)
        pos = _align(pos + n)
    return msg


def _malformed(why: str) -> CommError:
    """A message no parlay peer would send (truncated, corrupt, or not from parlay)."""
    return CommError(f"malformed parameter-server message: {why}. Hint: every rank must run "
                     "the same parlay version, and only parlay ranks may reach the cluster's "
                     "ports (see docs/security.md).", op="ps-unpack")


def decode_ctx(codes: torch.Tensor, template: Any) -> Any:
    """A pushed compressor context shaped like ``template`` (see :mod:`parlay.compress.ctxwire`).

    Raises:
        CommError: The codes do not describe a context shaped like ``template``.
    """
    try:
        return ctxwire.decode_ctx(codes, template)
    except ValueError as e:
        raise _malformed(f"its compressor context does not decode ({e})") from e


def probe(compressor: Any, numel: int, dtype: torch.dtype,
          key: str) -> tuple[list[torch.Tensor], Any]:
    """``(payload, ctx)`` that a copy of ``compressor`` gives for a zero bucket (the copy keeps a
    stateful compressor's memory untouched). Sizes buffers and gives the server its template."""
    if numel == 0:
        return [], None
    try:
        compressor = copy.deepcopy(compressor)
    except Exception:  # noqa: BLE001 - uncopyable compressors are probed as they are
        pass
    probed: tuple[list[torch.Tensor], Any] = compressor.compress(torch.zeros(numel, dtype=dtype),
                                                                 key)
    return probed


def push_capacity(compressor: Any, numel: int, dtype: torch.dtype, key: str,
                  pieces: int = 0) -> int:
    """Bytes of the largest push of a ``numel`` bucket: the compressed payload or, after an
    overflow fallback, the dense bucket, plus the encoded context (with slack) and an int64
    flag for each of its ``pieces`` (1: no gradient)."""
    payload, ctx = probe(compressor, numel, dtype, key)
    dense = numel * torch.empty((), dtype=dtype).element_size()
    sent = sum(t.numel() * t.element_size() for t in payload)
    return capacity(max(sent, dense) + (encode_ctx(ctx).numel() + pieces) * 8 + 512, MAX_TENSORS)
