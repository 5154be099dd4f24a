"""In-memory snapshots at the edges of a run: a rank killed at the same step twice, and a
failure after the training loop ended."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _trainer(**options):
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay

    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(5))
    return parlay.Trainer(lambda: (nn.Linear(6, 2), nn.CrossEntropyLoss()),
                          TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4,
                          snapshot_every=1, progress=False, **options)


# ---------------------------------------------------------------------- killed twice at step 5
def _killed_at_5():
    """Train to step 5; rank 1 then loses its record of step 5 (SIGKILLed while writing it)."""
    import parlay

    t = _trainer(max_iteration=8)
    start = t.state.step
    while t.state.step < 5:
        t.train_on_batch()
    if parlay.rank() == 1:
        for record in t.persistence.store.directory.glob("snap-0000000005.*"):
            record.unlink()
    t.close()  # like the kill: the snapshots stay
    return start


def test_a_rank_killed_at_the_same_step_twice_resumes_the_step_before_again(tmp_path):
    """After the first kill both ranks resume step 4 while rank 0 also holds 5; its second
    snapshot of 5 must not push out 4, the only step rank 1 holds after the second kill."""
    from parlay.testing import run_world

    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path), "PARLAY_RUN_ID": "twice",
           "PARLAY_SNAPSHOT_BACKGROUND": "0"}
    assert run_world(_killed_at_5, 2, env=env, timeout=90) == [0, 0]
    assert run_world(_killed_at_5, 2, env=env, timeout=90) == [4, 4]
    assert run_world(_killed_at_5, 2, env=env, timeout=90) == [4, 4]


# ---------------------------------------------------------------------- after the training loop
AFTER = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[1])
    from test_snapshot_edges import _trainer

    t = _trainer(max_iteration=3)
    while not t.should_stop():
        t.train_on_batch()
    raise RuntimeError("the export after training failed")
''')


def test_a_failure_after_training_restarts_at_the_final_step(tmp_path, monkeypatch):
    """should_stop() ends training but the script goes on: a failure there (an uncaught
    exception) keeps the final step's snapshot, so the restart does not train again; the
    snapshots go at a normal exit, or when the process starts another Trainer."""
    import parlay
    from parlay.snapshot import store

    shm = tmp_path / "shm"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PARLAY_RUN_ID="after", PARLAY_SNAPSHOT_DIR=str(shm), OMP_NUM_THREADS="1")
    first = subprocess.run([sys.executable, "-c", AFTER, str(Path(__file__).parent)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=90)
    assert first.returncode == 1 and "export after training failed" in first.stderr
    assert sorted(f.name for f in shm.rglob("snap-*")) == \
        ["snap-0000000002.s1.json", "snap-0000000003.s0.json"], "kept for the restart"
    monkeypatch.setenv("PARLAY_RUN_ID", "after")
    monkeypatch.setenv("PARLAY_SNAPSHOT_DIR", str(shm))
    monkeypatch.delattr(sys, "last_value", raising=False)  # (pytest's, of a failed test)
    try:
        t = _trainer(max_iteration=3)   # the restart
        assert t.state.step == 3 and t.should_stop()
        assert t.persistence.store.steps() == [2, 3], "kept while the script goes on"
        again = _trainer(max_iteration=2, optimizer_args={"lr": 0.5})  # not refused as live,
        assert again.state.step == 0                        # nor as another recipe's state
        again.train_to_end()
        t.close()                                           # (cleared already: a no-op)
        assert again.persistence.store.steps() == [1, 2]
        store._clear_ended(at_exit=True)                    # a normal exit
        assert not [f for f in shm.rglob("*") if f.is_file()]
    finally:
        parlay.shutdown()
