"""``compression="auto"``'s candidates by default, and the check of its options."""
from __future__ import annotations

from typing import Sequence

from parlay.errors import ConfigError

__all__ = ["DEFAULT_CANDIDATES", "check_options"]

#: top-k on both wires: the compact one (bfloat16 values, 16-bit offsets: 4 bytes a coordinate,
#: :mod:`parlay.compress.sparsewire`) wins where bytes cost, the plain one (8) where they don't.
DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:4", "topk:0.01", "topk:0.01,compact=1")

_ALLOWED = ("none", "fp16", "bf16", "powersgd", "topk", "randomk")


def check_options(candidates: Sequence[str], every: int, threshold: float, margin: float,
                  trial: int, budget: float) -> list[str]:
    """The candidate specs, normalised; raises ConfigError on anything out of range."""
    if isinstance(candidates, str) or not candidates:
        raise ConfigError(f"auto compression needs a non-empty list of candidate specs, got "
                          f"{candidates!r}. Hint: ['none', 'fp16', 'topk:0.01'].")
    specs = [str(c).strip().lower() for c in candidates]
    for s in specs:
        if s.partition(":")[0] not in _ALLOWED:
            raise ConfigError(f"auto compression cannot choose {s!r}; candidates may be "
                              f"{', '.join(_ALLOWED)} (with one option, e.g. 'topk:0.01').")
    if len(set(specs)) != len(specs):
        raise ConfigError(f"auto compression candidates repeat: {specs}.")
    for name, v, least in (("every", every, 1), ("trial", trial, 0)):
        if isinstance(v, bool) or int(v) != v or v < least:
            raise ConfigError(f"auto {name} must be an integer >= {least} (steps), got {v!r}.")
    if not 0 < float(threshold) < 10 or not 0 <= float(margin) < 1:
        raise ConfigError(f"auto threshold must be in (0, 10) and margin in [0, 1), got "
                          f"{threshold!r} and {margin!r}. Hint: threshold=0.2, margin=0.25.")
    if not 0 <= float(budget) <= 1:
        raise ConfigError(f"auto budget must be a fraction in [0, 1], got {budget!r}.")
    return specs
