"""`parlay run` on several nodes: launchers wait PARLAY_TIMEOUT for each other (to join, to finish)
and say what went wrong. Two nodes are two `parlay run` on loopback, or simulated hosts."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from parlay.testing import free_port
from tools.cluster import Cluster, unavailable_reason

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

TAIL_FAIL = textwrap.dedent("""
    import os, torch, parlay
    parlay.init()
    parlay.comm.allreduce(torch.ones(2))
    if parlay.rank() == 1:
        raise OSError("disk full while writing results")   # after the last collective
""")
LATE = textwrap.dedent("""
    import os, time, torch, parlay
    parlay.init()
    parlay.comm.allreduce(torch.ones(2))
    if parlay.rank() == 1:
        time.sleep(6)   # a final save on one node: longer than PARLAY_TIMEOUT, and no failure
""")
HOLD = textwrap.dedent("""
    import os, threading, parlay
    parlay.init()
    os.write(1, b"up\\n")
    if parlay.rank() == 1:
        parlay.comm.barrier()      # fails when node 0 (rank 0, and the store) is gone
    threading.Event().wait(90)
""")


def _start(node: int, endpoint: str, *args: str, env: dict[str, str] | None = None,
           host: tuple[Cluster, int] | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "parlay.cli", "run", "-n", "1", "--nnodes", "2",
            "--node-rank", str(node), "--rdzv-endpoint", endpoint, *args]
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_RANK")}
    full.update(env or {})
    if host is not None:
        return host[0].run(host[1], argv, env=full, cwd=ROOT, stdout=subprocess.PIPE,  # type: ignore[return-value]
                           stderr=subprocess.PIPE, text=True)
    return subprocess.Popen(argv, cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen[str]], within: float) -> list[tuple[int, str, str]]:
    """Each launcher's exit status, stdout and stderr; one still running after ``within``
    seconds is killed and fails the test."""
    deadline, out = time.monotonic() + within, []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a launcher was still running after {within} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return out


def test_a_node_whose_peer_failed_after_training_fails_within_parlay_timeout(tmp_path):
    """torchrun's exit barrier waited 300 s, then exited 0: the job had failed on node 1."""
    script = tmp_path / "tail_fail.py"
    script.write_text(TAIL_FAIL)
    endpoint, env = f"127.0.0.1:{free_port()}", {"PARLAY_TIMEOUT": "8"}
    (rc0, _, err0), (rc1, _, err1) = _finish(
        [_start(k, endpoint, str(script), env=env) for k in (0, 1)], within=80)
    assert rc1 == 1 and "disk full" in err1, err1[-2000:]
    assert rc0 == 1, err0[-2000:]
    # node 1's agent says so in the store: node 0 learns it at once, not after the 300 s a
    # late but healthy node is given
    assert f"this node's ranks finished, but not every other node's: {socket.gethostname()}'s " \
        "ranks failed" in err0, err0[-2000:]


def test_a_node_that_ends_late_is_waited_for_and_the_job_succeeds(tmp_path):
    # the exit barrier once waited PARLAY_TIMEOUT only: both nodes exited 1, blaming the other
    script = tmp_path / "late.py"
    script.write_text(LATE)
    endpoint, env = f"127.0.0.1:{free_port()}", {"PARLAY_TIMEOUT": "2"}
    for rc, _, err in _finish([_start(k, endpoint, str(script), env=env) for k in (0, 1)],
                              within=80):
        assert rc == 0 and "parlay run:" not in err, err[-2000:]


def test_c10d_missing_endpoint_is_waited_for_parlay_timeout():
    """c10d's store connect took its read_timeout (60 s, tried twice), not PARLAY_TIMEOUT."""
    # 192.0.2.1 (TEST-NET-1) is never a host: the endpoint's node is missing.
    p = _start(1, "192.0.2.1:29400", "--rdzv-backend", "c10d", "examples/hello.py",
               env={"PARLAY_TIMEOUT": "3"})
    [(rc, _, err)] = _finish([p], within=60)
    assert rc == 1 and "timed out after 3000ms" in err, err[-2000:]


def test_a_missing_node_is_named_on_the_node_that_hosts_the_rendezvous():
    p = _start(0, f"127.0.0.1:{free_port()}", "examples/hello.py", env={"PARLAY_TIMEOUT": "4"})
    [(rc, _, err)] = _finish([p], within=60)
    assert rc == 1 and "1/2 clients joined" in err, err[-2000:]
    assert "Hint: 1 of 2 nodes joined the rendezvous within PARLAY_TIMEOUT" in err
    assert "first node is up" not in err


def test_losing_the_rendezvous_node_after_the_ranks_started_says_so(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    endpoint, env = f"127.0.0.1:{free_port()}", {"PARLAY_TIMEOUT": "20"}
    node0, node1 = (_start(k, endpoint, "--max-restarts", "1", str(script), env=env)
                    for k in (0, 1))
    assert node0.stdout is not None and node1.stdout is not None
    assert node0.stdout.readline() == node1.stdout.readline() == "up\n"   # both ranks run
    os.killpg(node0.pid, signal.SIGKILL)     # node 0's host goes down with the store
    [(rc, _, err)] = _finish([node1], within=80)
    assert rc == 1 and "the launcher failed" in err, err[-2000:]
    assert "the node hosting it is gone" in err and "before any rank ran" not in err


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
def test_two_nodes_with_the_same_node_rank_are_told_so():
    with Cluster(hosts=2) as c:
        endpoint = f"{c.addr(0)}:29400"
        procs = [_start(0, endpoint, "examples/hello.py", env={"PARLAY_TIMEOUT": "5"},
                        host=(c, k)) for k in (0, 1)]
        results = _finish(procs, within=80)
    said = "\n".join(err for _, _, err in results)
    assert "role_info" in said, said[-3000:]
    assert "two nodes were given the same --node-rank" in said
    assert "before any rank ran" not in said
