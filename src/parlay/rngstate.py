"""Every RNG a training step may draw from (torch, CUDA, NumPy, Python), saved as tensors and
plain values so ``weights_only`` loading of checkpoints and snapshots accepts them."""
from __future__ import annotations

import ctypes
import functools
import random
import struct
import sys
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


# The last NumPy and Python states converted, with the raw generator bytes they were read at:
# most training loops never draw from them, and reading them in full costs 50-100 us right after
# a step (a snapshot per step asks for the RNG state every step). A state is read in full only
# when its raw bytes (~1 us to compare) or its cached Gaussian changed.
_last: dict[str, Any] = {}


_MT19937_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos


# The global generator whose state address was last read, and that address: ``bg.ctypes``
# builds ctypes objects on every access (~20 us right after a step, when nothing is cached).
# Holding the generator keeps the address valid; a generator set in its place is read anew.
_np_addr: list[Any] = [None, 0]


def _numpy_raw() -> bytes | None:
    """The raw bytes of NumPy's global MT19937 state (~1 us; ``get_state()`` takes ~50), or
    ``None`` where it cannot be read so."""
    try:
        bg = np.random.get_bit_generator()
        if type(bg) is not np.random.MT19937:
            return None
        if _np_addr[0] is not bg:
            _np_addr[:] = [bg, bg.ctypes.state_address]
        return ctypes.string_at(_np_addr[1], _MT19937_BYTES)
    except Exception:  # noqa: BLE001 - an older NumPy or another generator: read it in full
        return None


def _numpy_state() -> dict[str, Any]:
    # Unchanged raw bytes with no cached Gaussian mean no draw since the last read (a draw
    # moves pos; only the legacy Gaussian cache can be used up without one). The one change the
    # bytes do not show is a state set from outside that differs from the last read only in
    # that cache: set_rng_state() forgets the last read; np.random.set_state() by hand to such
    # a state is not seen until the generator next moves.
    raw = _numpy_raw()
    prev = _last.get("numpy")
    if prev is not None and raw is not None and raw == prev[0] and not prev[1]["has_gauss"]:
        return dict(prev[1])
    _, keys, pos, has_gauss, gauss = np.random.get_state()[:5]
    out = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
           "has_gauss": int(has_gauss), "gauss": float(gauss)}
    _last["numpy"] = (raw, out)
    return dict(out)


# CPython's Random object: PyObject_HEAD (16 bytes), int index, uint32_t state[624]. Checked
# once against getstate() before it is trusted (None: not checked yet).
_PY_OFFSET, _PY_BYTES = 16, 4 + 624 * 4
_py_layout_ok: bool | None = None if sys.implementation.name == "cpython" else False


def _python_raw() -> bytes | None:
    """The raw bytes of the ``random`` module's Mersenne Twister (~1 us; ``getstate()`` builds
    625 ints), or ``None`` where they cannot be read so."""
    global _py_layout_ok
    if _py_layout_ok is False:
        return None
    inst = getattr(random, "_inst", None)
    if type(inst) is not random.Random:
        return None
    raw = ctypes.string_at(id(inst) + _PY_OFFSET, _PY_BYTES)
    if _py_layout_ok is None:
        state = random.getstate()[1]
        _py_layout_ok = (struct.unpack("i", raw[:4])[0] == state[-1]
                         and raw[4:] == struct.pack("624I", *state[:-1]))
    return raw if _py_layout_ok else None


def _python_state() -> dict[str, Any]:
    raw = _python_raw()
    prev = _last.get("python")
    if prev is not None and raw is not None and raw == prev[0] and \
            random._inst.gauss_next == prev[1]["gauss"]:  # type: ignore[attr-defined]
        return dict(prev[1])
    version, state, gauss = random.getstate()
    out = {"version": version, "state": torch.tensor(state, dtype=torch.int64), "gauss": gauss}
    _last["python"] = (raw, out)
    return dict(out)


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, NumPy and Python RNG states, as tensors and plain values
    (so ``weights_only`` loading accepts them). Read-only: the tensors of an unchanged NumPy or
    Python state are shared between calls."""
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": _numpy_state(),
                          "python": _python_state()}
    if _cuda():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


@functools.cache
def _cuda() -> bool:
    """``torch.cuda.is_available()``, asked once per process (~15 us each time right after a
    step, and a snapshot asks every step)."""
    return torch.cuda.is_available()


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    _last.clear()  # a restored state may differ from the last read only in NumPy's Gaussian
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = st["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if "cuda" in st and _cuda():
        torch.cuda.set_rng_state_all(st["cuda"])
