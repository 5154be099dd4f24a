"""Snapshot folders of a run outlive its processes, and are swept once every one of them is gone.

The owner of a run (the launcher, and every rank keeping snapshots) holds a lock on the run's
owner file; the kernel drops it when the process dies, by SIGKILL too. Processes here are real
and killed for real; nothing waits on a timer.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from parlay.snapshot import SnapshotStore, run_key
from parlay.snapshot.owner import claim, run_name, sweep

pytestmark = pytest.mark.timeout(60)

# Holds run sys.argv[2]'s owner lock (as the launcher), or one rank's store of it, then blocks
# on stdin until killed.
HOLDER = textwrap.dedent('''
    import os, sys
    root, run, role = sys.argv[1], sys.argv[2], sys.argv[3]
    if role == "launcher":
        from parlay.snapshot.owner import claim
        owner = claim(run, root)
        assert owner is not None
    else:
        import torch
        from parlay.snapshot import SnapshotStore
        os.environ["PARLAY_RUN_ID"] = run
        from parlay.snapshot import run_key
        store = SnapshotStore(run_key("model"), 0, root=root)
        store.save(1, {"w": torch.ones(2)})
    print("ready", flush=True)
    sys.stdin.read()
''')


def _holder(root: Path, run: str, role: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), run, role],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _kill(p: subprocess.Popen[str]) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def _key(run: str, monkeypatch) -> str:
    monkeypatch.setenv("PARLAY_RUN_ID", run)
    key = run_key("model")
    assert key is not None and key.startswith(run_name(run) + "-")
    return key


def test_sweep_removes_a_run_only_once_its_launcher_and_ranks_are_dead(tmp_path, monkeypatch):
    key = _key("job1", monkeypatch)
    launcher = _holder(tmp_path, "job1", "launcher")
    rank = _holder(tmp_path, "job1", "rank")
    assert (tmp_path / key / "rank0").is_dir() and (tmp_path / "job1.owner").exists()
    try:
        _kill(launcher)
        assert sweep(tmp_path) == []  # a rank of the run still lives (it outlived the launcher)
        assert (tmp_path / key / "rank0").is_dir()
    finally:
        _kill(rank)
    assert sweep(tmp_path) == ["job1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sweep_spares_live_runs_and_ids_a_user_chose(tmp_path, monkeypatch):
    owner = claim("live", tmp_path)
    assert owner is not None
    live = SnapshotStore(_key("live", monkeypatch), 0, root=tmp_path)
    live.save(3, {"w": torch.zeros(1)})
    mine = SnapshotStore(_key("slurm-42", monkeypatch), 1, root=tmp_path)  # no owner file
    mine.save(5, {"w": torch.zeros(1)})
    mine.close()
    assert sweep(tmp_path) == []
    assert live.steps() == [3] and mine.steps() == [5]
    # The launcher's own exit removes its run (a generated id no later job can have).
    live.close()
    owner.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.directory.parent.name]
    assert mine.steps() == [5]


def test_a_finished_run_leaves_nothing_behind(tmp_path, monkeypatch):
    owner = claim("done", tmp_path)
    assert owner is not None
    store = SnapshotStore(_key("done", monkeypatch), 0, root=tmp_path)
    store.save(1, {"w": torch.zeros(1)})
    store.clear()  # training ended: the rank's lock goes with its snapshots
    owner.release()
    assert list(tmp_path.iterdir()) == []
