"""Run identity: a second live job under one run id is refused; a job with another recipe
under the same run id (or checkpoint_dir) never continues the first one's state."""
from __future__ import annotations

import os

import pytest
import torch

from parlay.errors import CheckpointError, ConfigError
from parlay.snapshot.owner import hold_live, release_live
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(180)


def _job(ckpt_dir, steps, lr, snapshot_every):
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 6, generator=g)
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)),
                                nn.CrossEntropyLoss()),
                       TensorDataset(x, (x[:, 0] > 0).long()), optimizer_args={"lr": lr},
                       batch_size=4, max_iteration=10, checkpoint_dir=ckpt_dir,
                       checkpoint_every=3, snapshot_every=snapshot_every, progress=False)
    start = (t.state.step, t.resumed_from_snapshot)
    while t.state.step < steps:
        t.train_on_batch()
    t.close()  # like a crash: snapshots stay
    return start


def test_the_live_lock_is_one_per_run_id_and_rank_and_names_its_holder(tmp_path):
    fd = hold_live(tmp_path, "job-x-0123456789ab", 0)
    with pytest.raises(ConfigError, match=rf"run id 'job-x' is in use by a live job on this "
                                          rf"host: pid {os.getpid()} on .* holds rank 0"):
        hold_live(tmp_path, "job-x-ffffffffffff", 0)   # any recipe of the same id
    os.close(hold_live(tmp_path, "job-x-0123456789ab", 1))   # another rank of the same job
    os.close(fd)
    os.close(hold_live(tmp_path, "job-x-0123456789ab", 0))   # the holder died: a restart


_FORKS_AND_DIES = """
import os, signal, sys, time
from pathlib import Path
from parlay.snapshot.owner import hold_live
hold_live(Path(sys.argv[1]), "job-f-0123456789ab", 0)
if os.fork() == 0:  # a DataLoader worker, say: outlives its parent for a while
    time.sleep(10)
    os._exit(0)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_child_does_not_keep_a_killed_ranks_live_lock(tmp_path):
    # The restart of a SIGKILLed rank was refused as "a live job" while its orphaned worker
    # lived on with the inherited flock.
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _FORKS_AND_DIES, str(tmp_path)], timeout=60)
    release_live(hold_live(tmp_path, "job-f-0123456789ab", 0))


def test_a_second_live_job_with_the_same_run_id_refuses_to_start(tmp_path):
    shm = tmp_path / "shm"
    env = {"PARLAY_SNAPSHOT_DIR": str(shm), "PARLAY_RUN_ID": "job-live"}
    fd = hold_live(shm, "job-live-0123456789ab", 1)   # the first job's rank 1, alive
    try:
        out = run_world(_job, 2, None, 4, 1e-2, 1, env=env, timeout=90, return_exceptions=True)
    finally:
        os.close(fd)
    assert all(isinstance(e, ConfigError) for e in out), out
    assert "in use by a live job on this host" in str(out[1]) and "holds rank 1" in str(out[1])
    assert "rank(s) [1]" in str(out[0])
    assert run_world(_job, 2, None, 4, 1e-2, 1, env=env, timeout=90) == [(0, None)] * 2


def test_same_run_id_other_recipe_is_refused_and_never_resumes_the_first_jobs_state(tmp_path):
    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "job-r"}
    assert run_world(_job, 2, None, 7, 1e-2, 1, env=env, timeout=90) == [(0, None)] * 2
    # Same id, another learning rate: the first job's snapshots of step 7 are refused.
    out = run_world(_job, 2, None, 4, 2e-2, 1, env=env, timeout=90, return_exceptions=True)
    for e in out:
        assert isinstance(e, CheckpointError), out
        assert "snapshot of step 7" in str(e) and "optimizer_args: {'lr': 0.01} then, " \
            "{'lr': 0.02} now" in str(e) and "'job-r'" in str(e)
    # The same recipe again resumes them.
    assert run_world(_job, 2, None, 8, 1e-2, 1, env=env, timeout=90) == [(7, 7)] * 2


def test_a_checkpoint_of_another_recipe_is_refused_naming_the_setting(tmp_path):
    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "job-c"}
    ck = str(tmp_path / "ckpt")
    run_world(_job, 2, ck, 7, 1e-2, 0, env=env, timeout=90)
    out = run_world(_job, 2, ck, 8, 2e-2, 0, env=env, timeout=90, return_exceptions=True)
    for e in out:
        assert isinstance(e, CheckpointError), out
        assert "other training settings (optimizer_args: {'lr': 0.01} then, {'lr': 0.02} now" \
            in str(e)
    assert run_world(_job, 2, ck, 8, 1e-2, 0, env=env, timeout=90) == [(6, None)] * 2


def _job_warnings(*args):
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        start = _job(*args)
    return start, [str(w.message) for w in seen]


def test_an_unwritable_snapshot_dir_warns_and_trains_without_snapshots(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = {"PARLAY_SNAPSHOT_DIR": str(blocker / "shm"), "PARLAY_RUN_ID": "job-w"}
    for start, seen in run_world(_job_warnings, 2, None, 4, 1e-2, 1, env=env, timeout=90):
        assert start == (0, None)
        off = [m for m in seen if m.startswith("in-memory snapshots off")]
        assert len(off) == 1 and str(blocker / "shm") in off[0] and "PARLAY_SNAPSHOT_DIR" in \
            off[0], seen


def _ps_job():
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay

    x = torch.randn(24, 6, generator=torch.Generator().manual_seed(3))
    parlay.Trainer(lambda: (nn.Linear(6, 2), nn.CrossEntropyLoss()),
                   TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4, max_iteration=4,
                   mode="ps", progress=False)


def test_a_second_live_ps_job_with_the_same_run_id_refuses_to_start(tmp_path):
    shm = tmp_path / "shm"
    env = {"PARLAY_SNAPSHOT_DIR": str(shm), "PARLAY_RUN_ID": "job-ps", "PARLAY_NUM_PS": "1"}
    fds = [hold_live(shm, "job-ps-0123456789ab", r) for r in range(3)]  # the first job, alive
    try:
        out = run_world(_ps_job, 3, env=env, timeout=90, return_exceptions=True)
    finally:
        for fd in fds:
            os.close(fd)
    for r, e in enumerate(out):
        assert isinstance(e, ConfigError) and f"holds rank {r}" in str(e), out
