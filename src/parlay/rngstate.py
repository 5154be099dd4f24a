"""Every RNG a training step may draw from (torch, CUDA, NumPy, Python), saved as tensors and
plain values so ``weights_only`` loading of checkpoints and snapshots accepts them."""
from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, NumPy and Python RNG states, as tensors and plain values
    (so ``weights_only`` loading accepts them)."""
    _, keys, pos, has_gauss, gauss = cast(tuple[Any, ...], np.random.get_state())[:5]
    version, state, py_gauss = random.getstate()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64),
                   "gauss": py_gauss}}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = st["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
