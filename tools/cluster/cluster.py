"""A simulated cluster on one machine: hosts in network namespaces joined by shaped links.

``Cluster(hosts=H, rate="100mbit")`` creates H Linux network namespaces (the *hosts*) and one
more holding a bridge (the *switch*). Each host reaches the switch through a veth pair whose
two ends are both shaped with a ``tc`` token bucket (``tbf``) to ``rate``, so every host has
its own full-duplex link of that bandwidth, as on a real top-of-rack switch. Addresses come from
a private /24 the harness assigns inside its own namespaces only; nothing is created in, or
routed to, the machine's own network namespace, so traffic never leaves the simulated cluster.

Inside each host the interface is called ``eth0`` and loopback is up. :meth:`Cluster.run`
starts a command in a host with ``GLOO_SOCKET_IFNAME=eth0`` (gloo otherwise resolves the
machine's hostname, which resolves to 127.0.0.1 or to an address that does not exist inside
the namespace: without it the ranks of different hosts never connect) and
``TP_SOCKET_IFNAME=eth0`` (the same for tensorpipe). ``parlay run``'s default (static)
rendezvous uses the ``--rdzv-endpoint`` address as the master, which needs nothing more; a
rendezvous backend that advertises hostnames (``--rdzv-backend c10d``) also needs
``--local-addr <cluster.addr(host)>``, since every namespace shares this machine's hostname.
:meth:`Cluster.parlay_run` starts ``parlay run --nnodes H --node-rank K`` on every host.

Everything made is removed on exit, on an exception, on ``KeyboardInterrupt`` and on
``SIGTERM`` (the handler is installed while the cluster is open in the main thread). If the
process is killed outright, the next ``Cluster`` removes namespaces whose creator is dead.

TCP inside the hosts uses CUBIC, Linux's default, whatever this machine's own default is: a
host's congestion control decides how its flows share a shaped link. (Under BBR, this machine's
default, a pipeline's small messages that follow a dense allreduce on the same connection
stalled for about 60 ms in half of their steps: BBR's probing, not the link.) Where the kernel
does not allow CUBIC inside a namespace (``net.ipv4.tcp_allowed_congestion_control``) the hosts
use Reno, the other loss-based algorithm (CUBIC itself grows like Reno at round trips this
short); :meth:`Cluster.report` says which. ``congestion=`` picks another, ``None`` keeps the
machine's.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable_reason` says why not when not.
``netem`` (added delay) is used when the kernel has it and reported in :meth:`Cluster.report`
otherwise; it is never an error.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import os
import signal
import subprocess
import threading
from typing import Any
from collections.abc import Mapping, Sequence

from tools.cluster.netns import (
    _IFNAME,
    _PREFIX,
    _SINK,
    _SOURCE,
    ClusterError,
    _kill_inside,
    _sh,
    parse_rate,
    sweep_stale,
    unavailable_reason,
)

__all__ = ["Cluster", "ClusterError", "unavailable_reason", "parse_rate", "sweep_stale",
           "tbf_burst"]

_counter = itertools.count()


def tbf_burst(rate_bps: int) -> int:
    """Bytes of the token bucket the harness gives a link of ``rate_bps``: a whole GSO segment
    (64 KiB) and a timer tick's worth of tokens (HZ may be 100), or tbf stalls or drops
    instead of shaping. That many bytes pass at once after the link has rested."""
    return max(64 * 1024, int(rate_bps) // 8 // 100)


class Cluster:
    """H hosts in network namespaces, each on its own shaped link to one switch.

    Args:
        hosts: Number of hosts (1..250).
        rate: Bandwidth of every host's link in each direction, as tc writes it
            (``"100mbit"``, ``"1gbit"``); ``None`` leaves links unshaped.
        delay: One-way delay per link (``"1ms"``) through ``netem``, when the kernel has it.
        subnet: The private /24 to number hosts from (host i gets ``.i+1``).
        latency: tbf's queueing bound (how long a packet may wait for tokens).
        env: Extra environment for every command started with :meth:`run`.
        congestion: TCP congestion control inside the hosts (``"cubic"``, the default, falls
            back to ``"reno"`` where the kernel does not allow it in a namespace; ``"bbr"``...;
            ``None``: the machine's own default).

    Raises:
        ClusterError: Not available here (see :func:`unavailable_reason`), setup failed, or
            the kernel does not allow ``congestion`` in a namespace.
    """

    def __init__(self, hosts: int = 2, rate: str | None = None, *, delay: str | None = None,
                 subnet: str = "10.213.0.0/24", latency: str = "50ms",
                 env: Mapping[str, str] | None = None,
                 congestion: str | None = "cubic") -> None:
        if not 1 <= int(hosts) <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        self.hosts = int(hosts)
        self.rate = rate
        self.rate_bps = parse_rate(rate) if rate else None
        self.delay = delay
        self.latency = latency
        net = ipaddress.ip_network(subnet)
        if net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet must be a private /24, got {subnet}")
        self._net = net
        self._extra_env = dict(env or {})
        self.congestion = congestion
        self.tag = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self.namespaces = [f"{self.tag}-h{i}" for i in range(self.hosts)]
        self.netem: bool | None = None
        self.notes: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._old_term: Any = None
        self._open = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Cluster:
        why = unavailable_reason()
        if why:
            raise ClusterError(f"simulated cluster unavailable: {why}")
        sweep_stale()
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Unwind through __exit__ (and every other finally) as Ctrl-C would.
        raise KeyboardInterrupt(f"signal {signum}")

    def close(self) -> None:
        """Stop what :meth:`run` started and remove every namespace, link and qdisc made."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            _kill_inside(ns)
            # Deleting a namespace deletes the veth ends in it, their peers and their qdiscs.
            _sh(["ip", "netns", "del", ns], check=False)
        self._made.clear()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        self._open = False

    def _ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        self._made.append(name)
        _sh(["ip", "-n", name, "link", "set", "lo", "up"])

    def _pick_congestion(self) -> None:
        if not self.congestion:
            return
        try:
            with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
                allowed = f.read().split()
        except OSError:  # no such control here: keep the machine's
            self.notes.append("TCP congestion control not settable here: the machine's kept")
            self.congestion = None
            return
        if self.congestion == "cubic" and "cubic" not in allowed and "reno" in allowed:
            self.notes.append(f"cubic not allowed in namespaces here (allowed: "
                              f"{' '.join(allowed)}): hosts use reno")
            self.congestion = "reno"
        elif self.congestion not in allowed:
            raise ClusterError(f"TCP congestion control {self.congestion!r} is not allowed in "
                               f"a namespace here (net.ipv4.tcp_allowed_congestion_control: "
                               f"{' '.join(allowed)}). Hint: one of those, or None for the "
                               "machine's own.")

    def _build(self) -> None:
        self._pick_congestion()
        sw = self.switch
        self._ns(sw)
        self.netem = self._netem_works(sw, "lo")
        _sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.namespaces):
            self._ns(ns)
            port = f"h{i}"
            _sh(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", _IFNAME,
                 "netns", ns])
            _sh(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _sh(["ip", "-n", sw, "link", "set", port, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", _IFNAME])
            _sh(["ip", "-n", ns, "link", "set", _IFNAME, "up"])
            if self.congestion:
                _sh(["ip", "netns", "exec", ns, "sh", "-c",
                     f"echo {self.congestion} > /proc/sys/net/ipv4/tcp_congestion_control"])
            # Egress of the host's end is its upload, egress of the switch's end its download.
            self._shape(ns, _IFNAME)
            self._shape(sw, port)

    def _shape(self, ns: str, dev: str) -> None:
        parent = ["root"]
        if self.delay:
            if self.netem:
                _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                     "handle", "1:", "netem", "delay", self.delay])
                parent = ["parent", "1:1"]
        if self.rate_bps is None:
            return
        burst = tbf_burst(self.rate_bps)
        _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf",
             "rate", str(self.rate_bps), "burst", str(burst), "latency", self.latency])

    def _netem_works(self, ns: str, dev: str) -> bool:
        p = _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                 "netem", "delay", "0ms"], check=False)
        if p.returncode != 0:
            if self.delay:
                self.notes.append(f"netem unavailable ({p.stderr.strip()}): delay {self.delay} "
                                  "not applied, links have bandwidth limits only")
            return False
        _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        return True

    # ------------------------------------------------------------------ use
    def addr(self, host: int) -> str:
        """IPv4 address of ``host`` (inside the simulated cluster)."""
        self._check_host(host)
        return str(self._net.network_address + host + 1)

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise ValueError(f"host must be in 0..{self.hosts - 1}, got {host}")

    def host_env(self, host: int) -> dict[str, str]:
        """Variables :meth:`run` sets in ``host`` so collective libraries use its link."""
        self._check_host(host)
        return {"GLOO_SOCKET_IFNAME": _IFNAME, "TP_SOCKET_IFNAME": _IFNAME,
                "PARLAY_CLUSTER_HOST": str(host), "PARLAY_CLUSTER_ADDR": self.addr(host)}

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside ``host`` (``ip netns exec``)."""
        self._check_host(host)
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def run(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            wait: bool = False, timeout: float | None = None,
            **popen: Any) -> subprocess.Popen[Any] | subprocess.CompletedProcess[Any]:
        """Start ``argv`` in ``host``; the process is killed when the cluster closes.

        Args:
            host: Host index.
            argv: Command and arguments.
            env: Variables added to this process's environment and :meth:`host_env`.
            wait: Wait for it and return a ``CompletedProcess`` (output captured as text unless
                ``stdout``/``stderr`` are given) instead of the ``Popen``.
            timeout: With ``wait``, seconds before it is killed and ``TimeoutExpired`` raised.
            **popen: Passed to ``subprocess.Popen`` (``stdout``, ``cwd``, ``text``...).
        """
        if not self._open:
            raise ClusterError("the cluster is closed; use it inside 'with Cluster(...)'")
        full = dict(os.environ)
        full.update(self._extra_env)
        full.update(self.host_env(host))
        full.update(env or {})
        if wait:
            popen.setdefault("stdout", subprocess.PIPE)
            popen.setdefault("stderr", subprocess.PIPE)
            popen.setdefault("text", True)
        p = subprocess.Popen(self.command(host, argv), env=full, start_new_session=True, **popen)
        self._procs.append(p)
        if not wait:
            return p
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def parlay_run(self, target: Sequence[str], nproc_per_host: int = 1,
                   flags: Sequence[str] = (), port: int = 29400,
                   env: Mapping[str, str] | None = None, **popen: Any) -> list[Any]:
        """Start ``parlay run`` on every host, as a user would on each node of a cluster.

        Host ``k`` runs ``parlay run -n nproc_per_host --nnodes H --node-rank k
        --rdzv-endpoint <host 0>:port *flags *target`` (torchrun's static rendezvous: global
        ranks are numbered host by host).

        Returns:
            One ``Popen`` per host, in host order.
        """
        import sys

        return [self.run(k, [sys.executable, "-m", "parlay.cli", "run", "-n", str(nproc_per_host),
                             "--nnodes", str(self.hosts), "--node-rank", str(k),
                             "--rdzv-endpoint", f"{self.addr(0)}:{port}", *flags, *target],
                         env=env, **popen)
                for k in range(self.hosts)]

    def counters(self) -> dict[int, dict[str, int]]:
        """Bytes each host has sent (``tx``) and received (``rx``) on its link so far."""
        out = {}
        for i, ns in enumerate(self.namespaces):
            js = json.loads(_sh(["ip", "-n", ns, "-s", "-j", "link", "show", _IFNAME]).stdout)
            st = js[0]["stats64"]
            out[i] = {"tx": int(st["tx"]["bytes"]), "rx": int(st["rx"]["bytes"])}
        return out

    @staticmethod
    def delta(after: Mapping[int, Mapping[str, int]],
              before: Mapping[int, Mapping[str, int]]) -> dict[int, dict[str, int]]:
        """Per-host byte counts between two :meth:`counters` snapshots."""
        return {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in after}

    def measure(self, src: int, dst: int, seconds: float = 2.0, port: int = 5201) -> float:
        """Measured TCP goodput from host ``src`` to host ``dst``, bits per second.

        One connection sends for ``seconds``; the receiver times from its first byte to EOF.
        """
        import sys

        server = self.run(dst, [sys.executable, "-c", _SINK, self.addr(dst), str(port)],
                          stdout=subprocess.PIPE, text=True)
        assert isinstance(server, subprocess.Popen) and server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise ClusterError(f"throughput sink on host {dst} did not start")
        self.run(src, [sys.executable, "-c", _SOURCE, self.addr(dst), str(port), str(seconds)],
                 wait=True, timeout=seconds + 30)
        out, _ = server.communicate(timeout=30)
        nbytes, elapsed = (float(x) for x in out.split())
        return nbytes * 8 / elapsed

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of every shaped device, for logs and checks."""
        out = {}
        for i, ns in enumerate(self.namespaces):
            for where, dev in ((ns, _IFNAME), (self.switch, f"h{i}")):
                out[f"{where}:{dev}"] = _sh(["ip", "netns", "exec", where, "tc", "qdisc", "show",
                                             "dev", dev]).stdout.strip()
        return out

    def report(self) -> dict[str, Any]:
        """What was built: hosts, addresses, rate, whether netem is available, the hosts' TCP
        congestion control (``None``: the machine's), notes."""
        return {"hosts": self.hosts, "namespaces": list(self.namespaces), "switch": self.switch,
                "addresses": [self.addr(i) for i in range(self.hosts)], "rate": self.rate,
                "delay": self.delay if self.netem else None, "netem": self.netem,
                "congestion": self.congestion, "notes": list(self.notes)}

    def __repr__(self) -> str:
        return f"Cluster(hosts={self.hosts}, rate={self.rate!r}, tag={self.tag!r})"
