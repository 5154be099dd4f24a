"""Parse the quantities users type: bandwidths, latencies, counts. Pure, no torch.

``parse_bandwidth("10gbit")`` is 1e10 bits per second; ``"1.25GB/s"`` is bytes (x 8). Units are
decimal (SI) as network rates are quoted; ``"Gibit"`` / ``"GiB/s"`` are binary.
"""
from __future__ import annotations

import re

from parlay.errors import ConfigError

__all__ = ["parse_bandwidth", "parse_latency", "parse_count", "parse_duration",
           "parse_size", "format_bandwidth", "format_seconds", "format_count", "format_bytes"]

_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2.0 ** 10, "mi": 2.0 ** 20, "gi": 2.0 ** 30, "ti": 2.0 ** 40}
_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3,
         "s": 1.0, "sec": 1.0, "": 1.0, "m": 60.0, "min": 60.0}


def _split(text: object, what: str, example: str) -> tuple[float, str]:
    s = str(text).strip()
    m = re.fullmatch(_NUM + r"([A-Za-zµ/]*)\s*", s)
    if not m:
        raise ConfigError(f"{what}: could not read {text!r} as a number with a unit. "
                          f"Hint: {example}.")
    return float(m.group(1)), m.group(2)


def parse_bandwidth(text: object, what: str = "--bandwidth") -> float:
    """Bits per second from ``"10gbit"``, ``"100Mbit/s"``, ``"25Gbps"``, ``"1.25GB/s"``,
    ``"1e9"`` (a bare number is bits per second).

    Raises:
        ConfigError: Unreadable text, an unknown unit, or a bandwidth that is not > 0.
    """
    example = f"{what} 10gbit (also 100mbit, 25Gbps, 1.25GB/s)"
    value, unit = _split(text, what, example)
    u = unit.replace("ps", "/s") if unit.lower().endswith("bps") else unit
    m = re.fullmatch(r"([kKmMgGtT]i?)?(bit|bits|b|B|byte|bytes)?(/s)?", u)
    if not m or (unit and not m.group(2)):
        raise ConfigError(f"{what}: unknown unit {unit!r} in {text!r}. Hint: {example}.")
    prefix = (m.group(1) or "").lower()
    body = m.group(2) or "bit"
    per_bit = 8.0 if body in ("B", "byte", "bytes") else 1.0
    bps = value * _PREFIX[prefix] * per_bit
    if not bps > 0:
        raise ConfigError(f"{what} must be > 0, got {text!r}: nothing could be sent. "
                          f"Hint: {example}.")
    return bps


def parse_latency(text: object) -> float:
    """Seconds from ``"50us"``, ``"0.2ms"``, ``"1e-4"`` (a bare number is seconds).

    Raises:
        ConfigError: Unreadable text, an unknown unit, or a negative latency.
    """
    value, unit = _split(text, "latency", "--latency 50us (also 2ms, 0.5ms, 100ns)")
    key = unit.lower() if unit != "µs" else unit
    if key not in _TIME or key in ("m", "min"):
        raise ConfigError(f"latency: unknown unit {unit!r} in {text!r}. "
                          "Hint: --latency 50us (ns, us, ms or s).")
    return value * _TIME[key]


def parse_duration(text: object, what: str = "time") -> float:
    """Seconds from ``"120ms"``, ``"0.12s"``, ``"0.12"``; must be >= 0."""
    value, unit = _split(text, what, f"{what} 120ms")
    key = unit.lower() if unit != "µs" else unit
    if key not in _TIME:
        raise ConfigError(f"{what}: unknown unit {unit!r} in {text!r}. Hint: 120ms or 0.12s.")
    return value * _TIME[key]


def parse_count(text: object, what: str = "count") -> float:
    """A count from ``"25e6"``, ``"25M"``, ``"1.3B"``, ``"350k"``.

    Raises:
        ConfigError: Unreadable text or a count that is not > 0.
    """
    value, unit = _split(text, what, f"{what} 25e6 (or 25M, 1.3B)")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(unit.lower())
    if scale is None:
        raise ConfigError(f"{what}: unknown suffix {unit!r} in {text!r}. "
                          "Hint: 25e6, 25M or 1.3B.")
    n = value * scale
    if not n > 0:
        raise ConfigError(f"{what} must be > 0, got {text!r}.")
    return n


def parse_size(text: object, what: str = "--memory-per-rank") -> float:
    """Bytes from ``"8GiB"``, ``"512MB"``, ``"16G"``, ``"1e9"`` (a bare number is bytes;
    ``Gi``/``GiB`` binary, ``G``/``GB`` decimal).

    Raises:
        ConfigError: Unreadable text, an unknown unit, or a size that is not > 0.
    """
    example = f"{what} 8GiB (also 512MB, 16e9)"
    value, unit = _split(text, what, example)
    m = re.fullmatch(r"([kKmMgGtT]i?)?(B|bytes?)?", unit)
    if not m:
        raise ConfigError(f"{what}: unknown unit {unit!r} in {text!r} (sizes are bytes: B, "
                          f"kB, MB, GB, TB, KiB, MiB, GiB, TiB). Hint: {example}.")
    size = value * _PREFIX[(m.group(1) or "").lower()]
    if not size > 0:
        raise ConfigError(f"{what} must be > 0 bytes, got {text!r}. Hint: {example}.")
    return size


def format_bytes(n: float) -> str:
    """``3 * 2**30`` -> ``"3 GiB"``."""
    for p, name in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= p:
            return f"{n / p:.3g} {name}"
    return f"{n:.0f} B"


def format_bandwidth(bps: float) -> str:
    """``1e10`` -> ``"10 Gbit/s"``."""
    for p, name in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if bps >= p:
            return f"{bps / p:.3g} {name}bit/s"
    return f"{bps:.3g} bit/s"


def format_seconds(s: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def format_count(x: float) -> str:
    """``12345.6`` -> ``"12,346"``; small rates keep three significant digits (``"2.1e-05"``),
    never rounding to ``"0"``."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
