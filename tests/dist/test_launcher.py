"""`parlay run` through torchrun, end to end, and the launcher's argument mapping."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parlay.cli import _split_parse, build_parser, main, torchrun_argv

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "parlay.cli", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=100)


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


def test_torchrun_argv_standalone_and_passthrough():
    parser_ns, rest = _split_parse(build_parser(), ["run", "-n", "4", "--ps", "1", "train.py", "--lr", "1"])
    assert rest == ["train.py", "--lr", "1"]
    assert torchrun_argv(parser_ns, rest) == ["--nproc-per-node", "4", "--standalone",
                                              "train.py", "--lr", "1"]
    ns, rest = _split_parse(build_parser(), ["run", "-n", "2", "--nnodes", "2", "--node-rank", "1",
                                        "--rdzv-endpoint", "h0:29400", "--max-restarts", "3",
                                        "-m", "pkg.mod", "x"])
    argv = torchrun_argv(ns, rest)
    assert "--standalone" not in argv
    assert argv[-3:] == ["-m", "pkg.mod", "x"]
    for flag, val in [("--nnodes", "2"), ("--node-rank", "1"), ("--rdzv-endpoint", "h0:29400"),
                      ("--max-restarts", "3")]:
        assert argv[argv.index(flag) + 1] == val


def test_ps_leaving_no_worker_is_rejected():
    ns, rest = _split_parse(build_parser(), ["run", "-n", "2", "--ps", "2", "t.py"])
    with pytest.raises(SystemExit, match="no worker"):
        torchrun_argv(ns, rest)


def test_missing_script_is_a_clear_error():
    with pytest.raises(SystemExit, match="missing the script"):
        main(["run", "-n", "2"])
