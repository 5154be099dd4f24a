"""The simulated cluster harness: hosts reach each other, links are shaped, nothing is left."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from parlay.testing import process_alive
from tools.cluster import Cluster, ClusterError, parse_rate, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
_WHY = unavailable_reason()
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(_WHY is not None, reason=f"simulated cluster: {_WHY}")]


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


def test_parse_rate():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("12.5mbps") == 100_000_000
    with pytest.raises(ValueError, match="100mbit"):
        parse_rate("fast")


def test_hosts_talk_over_the_bridge_and_only_inside_the_cluster():
    root_links = _links()
    with Cluster(hosts=3) as c:
        assert [c.addr(i) for i in range(3)] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        assert c.measure(2, 0, seconds=0.3) > 0 and c.measure(0, 1, seconds=0.3) > 0
        for ns in c.namespaces:
            routes = subprocess.run(["ip", "-n", ns, "route"], capture_output=True,
                                    text=True).stdout
            assert "default" not in routes and "10.213.0.0/24 dev eth0" in routes
        # Nothing was added to this machine's own namespace.
        assert _links() == root_links
        r = c.run(1, [sys.executable, "-c", "import os; print(os.environ['GLOO_SOCKET_IFNAME'])"],
                  wait=True, timeout=30)
        assert r.stdout.strip() == "eth0"
    with pytest.raises(ClusterError, match="closed"):
        c.run(0, ["true"])


def test_shaped_link_runs_at_its_rate_and_counters_see_the_bytes():
    with Cluster(hosts=2, rate="100mbit") as c:
        assert all("tbf" in q and "100Mbit" in q for q in c.qdiscs().values())
        before = c.counters()
        up = c.measure(1, 0, seconds=2.0)
        down = c.measure(0, 1, seconds=1.0)
        moved = c.delta(c.counters(), before)
    for bps in (up, down):
        assert 0.8e8 <= bps <= 1.05e8, f"measured {bps / 1e6:.1f} Mbit/s on a 100mbit link"
    # Host 1 sent ~2 s and host 0 ~1 s of a 100 Mbit/s stream; the other side counts the same.
    assert 0.8 * 2 * 12.5e6 < moved[1]["tx"] < 1.2 * 2 * 12.5e6
    assert abs(moved[1]["tx"] - moved[0]["rx"]) < 0.01 * moved[1]["tx"]
    assert 0.8 * 12.5e6 < moved[0]["tx"] < 1.2 * 12.5e6


def test_hosts_use_the_reported_loss_based_congestion_control_and_refuse_unknown_ones():
    def host_cc(c, host):
        return c.run(host, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], wait=True,
                     timeout=30).stdout.strip()

    with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
        allowed = f.read().split()
    with Cluster(hosts=2) as c:
        cc = c.report()["congestion"]
        assert cc == ("cubic" if "cubic" in allowed else "reno")
        assert host_cc(c, 0) == host_cc(c, 1) == cc
        assert ("cubic not allowed" in " ".join(c.report()["notes"])) == (cc == "reno")
    other = "reno" if cc != "reno" else allowed[-1]
    with Cluster(hosts=1, congestion=other) as c:
        assert host_cc(c, 0) == other == c.report()["congestion"]
    with pytest.raises(ClusterError, match="not allowed in a namespace.*Hint"):
        with Cluster(hosts=1, congestion="no-such-cc"):
            pass


def test_netem_is_detected_and_never_fatal():
    with Cluster(hosts=2, rate="1gbit", delay="2ms") as c:
        rep = c.report()
    assert isinstance(rep["netem"], bool)
    if not rep["netem"]:
        assert rep["delay"] is None and any("netem unavailable" in n for n in rep["notes"])


def test_everything_is_removed_after_an_exception():
    before_links = _links()
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(hosts=2, rate="100mbit") as c:
            sleeper = c.run(0, ["sleep", "300"])
            assert set(c.namespaces) | {c.switch} <= _netns()
            raise RuntimeError("boom")
    assert not (set(c.namespaces) | {c.switch}) & _netns()
    assert _links() == before_links
    assert sleeper.poll() is not None


_CHILD = """
import signal, sys
from tools.cluster import Cluster
# A shell that starts the suite in the background starts it with SIGINT ignored, and Python
# then installs no KeyboardInterrupt handler: restore it, as an interactive run has it.
signal.signal(signal.SIGINT, signal.default_int_handler)
with Cluster(hosts=2, rate="100mbit") as c:
    p = c.run(1, ["sleep", "300"])
    print(c.tag, p.pid, flush=True)
    sys.stdin.read()
"""


def _child() -> tuple[subprocess.Popen[str], str, int]:
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)  # ROOT holds tools/
    assert p.stdout is not None
    tag, pid = p.stdout.readline().split()
    assert {f"{tag}-h0", f"{tag}-h1", f"{tag}-sw"} <= _netns()
    return p, tag, int(pid)


# Setting up and removing namespaces runs a dozen `ip` and `tc` commands each; under a full
# suite on two shared cores that once took over a minute (alone: about 5 s).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_everything_is_removed_when_interrupted(sig):
    p, tag, sleeper = _child()
    p.send_signal(sig)
    p.wait(timeout=120)
    assert not {n for n in _netns() if n.startswith(tag + "-")}
    assert not process_alive(sleeper)


@pytest.mark.timeout(180)
def test_a_killed_creator_is_swept_by_the_next_cluster():
    p, tag, _ = _child()
    p.kill()
    p.wait(timeout=120)
    assert {n for n in _netns() if n.startswith(tag + "-")}  # SIGKILL cannot clean up
    with Cluster(hosts=1):
        assert not {n for n in _netns() if n.startswith(tag + "-")}
