"""Nested state, walked one way: batches, optimizer states and snapshots as trees of tensors.

Every walk over dicts, lists and tuples of tensors in parlay goes through these helpers, which
stand on torch's own pytree (``torch.utils._pytree``, what ``torch.compile``, ``torch.export``
and DTensor use). Containers are therefore handled one way everywhere: dict, list, tuple,
namedtuple, OrderedDict, defaultdict and deque are walked, rebuilt as their own type;
``torch.Size`` and anything else is a leaf, passed through untouched.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["map_tensors", "flatten", "tensors_in", "tensors_with_paths", "to_device"]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, torch.Size)  # pytree would rebuild it as a plain tuple


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; other leaves stay as they are."""
    return pytree.tree_map_only(torch.Tensor, fn, tree, is_leaf=_is_leaf)


def flatten(tree: Any, whole: Callable[[list[Any]], bool]) -> tuple[list[Any],
                                                                   Callable[[list[Any]], Any]]:
    """``tree``'s leaves (the lists ``whole`` accepts are leaves, not walked into) and the
    function that builds a tree of its shape from as many new leaves."""
    leaves, spec = pytree.tree_flatten(tree, is_leaf=lambda x: _is_leaf(x) or (
        isinstance(x, list) and whole(x)))
    return leaves, lambda new: pytree.tree_unflatten(new, spec)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, in pytree order (dicts in insertion order)."""
    return [x for x in pytree.tree_leaves(tree, is_leaf=_is_leaf) if isinstance(x, torch.Tensor)]


def tensors_with_paths(tree: Any) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` pairs, the path as Python would index it: ``"['state'][0]['exp']"``."""
    pairs, _ = pytree.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    return [(pytree.keystr(path), x) for path, x in pairs if isinstance(x, torch.Tensor)]


def to_device(tree: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """``tree`` (a tensor, or a batch of nested tensors) on ``device``."""
    if isinstance(tree, torch.Tensor):  # the common batch: no walk at all
        return tree.to(device, non_blocking=non_blocking)
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), tree)
