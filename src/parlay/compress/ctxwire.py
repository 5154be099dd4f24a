"""A compressor context's plain values as an int64 tensor, and back, without pickling.

A ``ctx`` (shape, dtype, scale, seed...) must reach a receiver that decodes the payload: a
parameter server, or the other ranks of an allgather when the context differs per rank. Its
*structure* (which dataclass, which fields) is the same for every payload of a bucket, so the
receiver takes it from a template ctx (its own) and only the leaf values travel, as tagged
int64s: None, bool, int, float (bit pattern), torch.dtype and short str.
"""
from __future__ import annotations

import copy
import struct
from typing import Any

import torch

from parlay.errors import ConfigError

__all__ = ["DTYPES", "DTYPE_CODE", "encode_ctx", "decode_ctx"]

#: The dtypes a wire carries, by code.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
_NONE, _BOOL, _INT, _FLOAT, _DTYPE, _STR = range(6)


# ``object.__getstate__`` exists from Python 3.11 on; before, only classes that define one have it.
_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)


def _fields(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, (tuple, list, dict)) or not hasattr(obj, "__dict__"):
        return None
    # A class's own __getstate__ is honoured (e.g. CastCtx dropping its source tensor).
    if getattr(type(obj), "__getstate__", None) is not _DEFAULT_GETSTATE:
        state = obj.__getstate__()
        if isinstance(state, dict):
            return state
    return dict(vars(obj))


def _leaves(obj: Any, out: list[int], where: str) -> None:
    if obj is None:
        out += [_NONE]
    elif isinstance(obj, bool):
        out += [_BOOL, int(obj)]
    elif isinstance(obj, int):
        out += [_INT, obj]
    elif isinstance(obj, float):
        out += [_FLOAT, struct.unpack("<q", struct.pack("<d", obj))[0]]
    elif isinstance(obj, torch.dtype):
        if obj not in DTYPE_CODE:
            raise ConfigError(f"compressor context {where} has unsupported dtype {obj}.")
        out += [_DTYPE, DTYPE_CODE[obj]]
    elif isinstance(obj, str):
        b = obj.encode()
        out += [_STR, len(b), *b]
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _leaves(v, out, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k in sorted(obj):
            _leaves(obj[k], out, f"{where}[{k!r}]")
    elif (f := _fields(obj)) is not None:
        for k in sorted(f):
            _leaves(f[k], out, f"{where}.{k}")
    else:
        raise ConfigError(f"compressor context {where} holds a {type(obj).__name__}, which cannot "
                          "travel to another process (only None, bool, int, float, "
                          "dtype, str and containers of them). Hint: keep tensors out of ctx.")


def encode_ctx(ctx: Any) -> torch.Tensor:
    """The leaf values of a compressor context as an int64 tensor (no pickling).

    Raises:
        ConfigError: The context holds something other than plain values.
    """
    out: list[int] = []
    _leaves(ctx, out, "ctx")
    return torch.tensor(out, dtype=torch.int64)


def decode_ctx(codes: torch.Tensor, template: Any) -> Any:
    """Rebuild a context shaped like ``template`` from :func:`encode_ctx`'s values.

    Raises:
        ValueError: The codes do not describe a context shaped like ``template``.
    """
    try:
        return _decode_ctx(codes.tolist(), template)
    except (IndexError, TypeError, OverflowError, struct.error) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from e


def _decode_ctx(vals: list[int], template: Any) -> Any:
    pos = 0

    def build(t: Any) -> Any:
        nonlocal pos
        if isinstance(t, (tuple, list)):
            items = [build(v) for v in t]
            return type(t)(items) if isinstance(t, list) else tuple(items)
        if isinstance(t, dict):
            return {k: build(t[k]) for k in sorted(t)}
        f = None if t is None or isinstance(t, (bool, int, float, str, torch.dtype)) else _fields(t)
        if f is not None:
            new = copy.copy(t)
            new.__dict__.update({k: build(f[k]) for k in sorted(f)})
            return new
        tag = vals[pos]
        pos += 1
        if tag == _NONE:
            return None
        v = vals[pos]
        pos += 1
        if tag == _BOOL:
            return bool(v)
        if tag == _INT:
            return v
        if tag == _FLOAT:
            return struct.unpack("<d", struct.pack("<q", v))[0]
        if tag == _DTYPE:
            if not 0 <= v < len(DTYPES):
                raise ValueError(f"dtype code {v}")
            return DTYPES[v]
        if tag != _STR or not 0 <= v <= len(vals) - pos:
            raise ValueError(f"tag {tag} with length {v}")
        s = bytes(vals[pos: pos + v]).decode()
        pos += v
        return s

    return build(template)
