"""`parlay run` through torchrun, end to end, and the launcher's argument mapping."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from parlay.cli import _split_parse, build_parser, main, torchrun_argv
from parlay.testing import free_port, process_alive

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    full.update(env or {})
    return full


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parlay.cli", *args], cwd=ROOT,
                          env=_clean_env(env), capture_output=True, text=True, timeout=100)


def test_parlay_run_two_ranks_hello_and_allreduce():
    p = _run("run", "-n", "2", "examples/hello.py")
    assert p.returncode == 0, p.stderr
    lines = sorted(re.findall(r"hello from rank (\d) of (\d) \(role (\w+)\): allreduce sum = (\d+)",
                              p.stdout))
    assert lines == [("0", "2", "worker", "3"), ("1", "2", "worker", "3")]


def test_parlay_run_assigns_ps_roles_first():
    p = _run("run", "-n", "3", "--ps", "1", "examples/hello.py")
    assert p.returncode == 0, p.stderr
    roles = dict(re.findall(r"hello from rank (\d) of 3 \(role (\w+)\)", p.stdout))
    assert roles == {"0": "ps", "1": "worker", "2": "worker"}


def test_failing_script_gives_nonzero_exit():
    p = _run("run", "-n", "2", "-m", "this_module_does_not_exist_xyz")
    assert p.returncode != 0


def test_a_missing_script_is_named_before_any_rank_starts():
    p = _run("run", "-n", "2", "no_such_script_xyz.py")
    assert p.returncode == 2 and "no script 'no_such_script_xyz.py'" in p.stderr
    assert "Connection" not in p.stderr and "rank 0" not in p.stderr  # nothing was launched


def test_parlay_env_reports_detected_cluster():
    p = _run("env", "--json", env={"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                    "SLURM_NODELIST": "node[07-10]", "MASTER_PORT": "29511"})
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert (info["rank"], info["world_size"], info["source"]) == (3, 8, "slurm")
    assert info["master"] == "node07:29511"


def test_parlay_env_reports_config_errors_clearly():
    p = _run("env", env={"RANK": "1"})
    assert p.returncode == 2
    assert "WORLD_SIZE" in p.stderr


def test_torchrun_argv_single_node_loopback_and_passthrough(monkeypatch):
    monkeypatch.delenv("PARLAY_TIMEOUT", raising=False)
    parser_ns, rest = _split_parse(build_parser(),
                                   ["run", "-n", "4", "--ps", "1", "train.py", "--lr", "1"])
    assert rest == ["train.py", "--lr", "1"]
    argv = torchrun_argv(parser_ns, rest)
    assert "--standalone" not in argv
    assert argv[-3:] == ["train.py", "--lr", "1"]
    for flag, val in [("--nproc-per-node", "4"), ("--nnodes", "1"),
                      ("--rdzv-backend", "parlay-local"), ("--rdzv-endpoint", "127.0.0.1:0"),
                      ("--local-addr", "127.0.0.1")]:
        assert argv[argv.index(flag) + 1] == val
    # --master-port is honoured on one node: the loopback store listens there.
    ns, rest = _split_parse(build_parser(), ["run", "-n", "2", "--master-port", "29555", "t.py"])
    argv = torchrun_argv(ns, rest)
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:29555"
    assert "--master-port" not in argv
    ns, rest = _split_parse(build_parser(), ["run", "-n", "2", "--nnodes", "2", "--node-rank", "1",
                                        "--rdzv-endpoint", "h0:29400", "--max-restarts", "3",
                                        "-m", "pkg.mod", "x"])
    argv = torchrun_argv(ns, rest)
    assert "--standalone" not in argv and "parlay-local" not in argv
    assert argv[-3:] == ["-m", "pkg.mod", "x"]
    for flag, val in [("--nnodes", "2"), ("--node-rank", "1"), ("--rdzv-endpoint", "h0:29400"),
                      ("--max-restarts", "3"),
                      # nodes wait for each other PARLAY_TIMEOUT (300 s), not torchrun's 600 s
                      # (nor c10d's store connect 2 x 60 s)
                      ("--rdzv-conf", "join_timeout=300,timeout=300,read_timeout=300")]:
        assert argv[argv.index(flag) + 1] == val
    # --nnodes 1 (or 1:1) alone is one node: parlay's loopback rendezvous
    for nodes in ("1", "1:1"):
        ns, rest = _split_parse(build_parser(), ["run", "-n", "2", "--nnodes", nodes, "t.py"])
        argv = torchrun_argv(ns, rest)
        assert argv[argv.index("--rdzv-backend") + 1] == "parlay-local"
        assert argv.count("--nnodes") == 1 and argv[argv.index("--nnodes") + 1] == "1"


def test_ps_leaving_no_worker_is_rejected():
    ns, rest = _split_parse(build_parser(), ["run", "-n", "2", "--ps", "2", "t.py"])
    with pytest.raises(SystemExit, match="no worker"):
        torchrun_argv(ns, rest)


def test_missing_script_is_a_clear_error():
    with pytest.raises(SystemExit, match="missing the script"):
        main(["run", "-n", "2"])


# -- through the real CLI: loopback binding, launcher errors, signals, droppable workers -------

LISTEN_SCRIPT = textwrap.dedent("""
    import os, socket
    import torch, parlay

    def listening(pid):
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        out = []
        for table, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    if parts[3] != "0A" or parts[9] not in inodes:   # 0A: LISTEN
                        continue
                    addr, port = parts[1].split(":")
                    raw = bytes.fromhex(addr)
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    out.append(f"{socket.inet_ntop(fam, words)}:{int(port, 16)}")
        return out

    parlay.init()
    parlay.comm.allreduce(torch.ones(1))      # gloo's sockets are up
    row = ["LISTEN", str(parlay.rank()), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
           ",".join(listening(os.getpid())), ",".join(listening(os.getppid()))]
    os.write(1, (" ".join(row) + "\\n").encode())     # one write: the ranks share the pipe
    parlay.comm.barrier()
    parlay.shutdown()
""")


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("nodes", [(), ("--nnodes", "1")])
def test_single_node_run_listens_on_loopback_only_at_master_port(tmp_path, nodes):
    script = tmp_path / "listen.py"
    script.write_text(LISTEN_SCRIPT)
    port = free_port()
    p = _run("run", "-n", "2", *nodes, "--master-port", str(port), str(script))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith("LISTEN")]
    assert len(rows) == 2
    for _, _rank, addr, mport, worker, agent in rows:
        assert (addr, mport) == ("127.0.0.1", str(port))       # --master-port honoured
        sockets = worker.split(",") + agent.split(",")
        assert f"127.0.0.1:{port}" in agent.split(","), agent   # the store, at that port
        assert all(s.startswith("127.0.0.1:") for s in sockets), sockets


def test_port_in_use_shows_the_real_reason(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = _run("run", "-n", "2", "--master-port", str(port), "examples/hello.py")
    assert p.returncode == 1
    assert "address already in use" in p.stderr.lower(), p.stderr[-3000:]
    assert f"127.0.0.1:{port}" in p.stderr and "--master-port" in p.stderr
    assert "a rank failed" not in p.stderr and "hello from" not in p.stdout


WAIT_SCRIPT = textwrap.dedent("""
    import os, sys, threading
    # one write (one syscall): the ranks share the pipe, and unbuffered prints of
    # several pieces interleave
    os.write(1, ("ready %s\\n" % os.environ["RANK"]).encode())
    threading.Event().wait(90)      # until the launcher stops us
""")


@pytest.mark.parametrize("sig, code, group", [(signal.SIGINT, 130, True),
                                              (signal.SIGTERM, 143, False)])
def test_interrupt_says_interrupted_not_failed(tmp_path, sig, code, group):
    script = tmp_path / "wait.py"
    script.write_text(WAIT_SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "parlay.cli", "run", "-n", "2", str(script)],
                            cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = [proc.stdout.readline() for _ in range(2)]      # both ranks are running
        assert all(line.startswith("ready") for line in ready), ready
        # Ctrl-C reaches the whole process group; `kill` / a scheduler reaches the launcher.
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, err[-3000:]
    assert f"interrupted by {sig.name}" in err
    assert "failed" not in err.split("interrupted by")[-1]


DROP_SCRIPT = textwrap.dedent("""
    import os, select, signal, sys
    from datetime import timedelta
    import torch.distributed as dist
    from parlay.launch import mark_droppable

    rank, mark = int(os.environ["RANK"]), sys.argv[1] == "mark"
    store = dist.PrefixStore("drop-test", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=30)))
    if rank == 1:
        if mark:
            mark_droppable(rank)
        store.set("pid1", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    # Rank 0 outlives rank 1: it waits for that process to be gone, then finishes normally.
    try:
        fd = os.pidfd_open(int(store.get("pid1")))
        assert select.select([fd], [], [], 30)[0], "rank 1 did not die"
    except ProcessLookupError:
        pass                        # already gone and reaped
    print("rank 0 finished after rank 1 was lost", flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
@pytest.mark.parametrize("mark", [True, False])
def test_droppable_worker_is_dropped_and_others_finish(tmp_path, mark):
    script = tmp_path / "drop.py"
    script.write_text(DROP_SCRIPT)
    p = _run("run", "-n", "2", str(script), "mark" if mark else "no-mark")
    if mark:
        assert p.returncode == 0, p.stderr[-3000:]
        assert ("parlay run: rank 1 (droppable parameter-server worker) was lost; "
                "the other ranks go on") in p.stderr
        assert "1 droppable rank(s) lost (1)" in p.stderr
        assert "rank 0 finished after rank 1 was lost" in p.stdout
    else:   # no marker: torchrun's policy, the job fails and names the rank
        assert p.returncode == 1
        assert "rank 1 failed (killed by SIGKILL" in p.stderr, p.stderr[-3000:]
        assert "droppable" not in p.stderr


INIT_WAIT_SCRIPT = textwrap.dedent("""
    import os, threading
    import parlay
    parlay.init()
    os.write(1, ("ready %d\\n" % os.getpid()).encode())
    threading.Event().wait(90)      # until something stops us
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_end_with_a_killed_launcher(tmp_path):
    """torchrun puts each worker in its own session: without the lifeline a SIGKILLed launcher
    leaves them running (re-parented to init), training on beside any relaunch."""
    script = tmp_path / "wait.py"
    script.write_text(INIT_WAIT_SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "parlay.cli", "run", "-n", "2", str(script)],
                            cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    try:
        pids = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
        proc.kill()                       # the launcher alone, as the OOM killer would
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)               # polling the kernel's process table, not a sync
        assert not any(process_alive(p) for p in pids), f"ranks {pids} outlived their launcher"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SPLICE_SCRIPT = textwrap.dedent("""
    import parlay
    parlay.init()
    parlay.comm.barrier()
    for i in range(2000):
        print(f"line {parlay.rank()} {i}", "x" * 40)    # three writes each when unbuffered
""")


def test_ranks_write_whole_lines_under_pythonunbuffered(tmp_path):
    """Under PYTHONUNBUFFERED two ranks' prints spliced mid-line (thousands of 4000 lines here)."""
    script = tmp_path / "splice.py"
    script.write_text(SPLICE_SCRIPT)
    p = _run("run", "-n", "2", str(script), env={"PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    bad = [ln for ln in lines if not re.fullmatch(r"line [01] \d+ x{40}", ln)]
    assert not bad, bad[:5]
    assert len(lines) == 4000
