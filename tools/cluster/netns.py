"""Low-level pieces of :mod:`tools.cluster`: iproute2 calls, availability, sweeping.

Kept apart so the cluster module reads as the life of one cluster.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["ClusterError", "parse_rate", "unavailable_reason", "sweep_stale"]

_PREFIX = "parlay-"
_IFNAME = "eth0"
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


# Measuring only (never parlay's transport): a TCP sink and a timed source for Cluster.measure.
_SINK = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c, _ = s.accept()
n = len(c.recv(1 << 20)); t0 = time.perf_counter()
while True:
    k = len(c.recv(1 << 20))
    if not k:
        break
    n += k
print(n, time.perf_counter() - t0)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
buf = bytes(1 << 16); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    c.sendall(buf)
c.close()
"""


class ClusterError(RuntimeError):
    """Setting up or using the simulated cluster failed (the command and its output included)."""


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate: ``"100mbit"``, ``"1gbit"``, ``"12.5mbps"`` (bytes).

    Raises:
        ValueError: Not a rate tc understands in these units.
    """
    m = _RATE_RE.match(rate)
    if not m:
        raise ValueError(f"rate must look like '100mbit' or '1gbit', got {rate!r}")
    bits = float(m.group(1)) * _UNIT[m.group(2).lower()]
    return int(bits * 8 if m.group(3).lower() == "bps" else bits)


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


_reason: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why no cluster can be built here (one line), or ``None`` when it can. Cached."""
    if _reason:
        return _reason[0]
    why: str | None = None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        why = "needs root (network namespaces and tc)"
    elif not (shutil.which("ip") and shutil.which("tc")):
        why = "needs iproute2 ('ip' and 'tc'); e.g. apt-get install -y iproute2"
    else:
        probe = f"{_PREFIX}{os.getpid()}-probe"
        p = _sh(["ip", "netns", "add", probe], check=False)
        if p.returncode != 0:
            why = f"cannot create a network namespace: {p.stderr.strip()}"
        else:
            _sh(["ip", "netns", "del", probe], check=False)
    _reason.append(why)
    return why


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove namespaces left by clusters whose creating process is dead (killed outright).

    Returns:
        The names removed.
    """
    removed = []
    for name in _netns_names():
        m = re.match(rf"^{re.escape(_PREFIX)}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(name)
            if _sh(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in our namespace ``ns`` (it keeps the links alive)."""
    out = _sh(["ip", "netns", "pids", ns], check=False).stdout
    for tok in out.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
