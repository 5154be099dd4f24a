"""``hvd.elastic``: one live job per run id. A second job started under the run id of a running
one is refused with a ConfigError (the Trainer's "in use by a live job") and leaves the first
job's commits alone (it used to delete them, so the first job's restart started over)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

# The second job: one rank (rank 0, as the first job's rank 0) of the same run id, fresh.
SECOND_JOB = r'''
import parlay.horovod as hvd
from parlay.errors import ConfigError
hvd.init()
state = hvd.elastic.ObjectState(batch=0)


@hvd.elastic.run
def train(state):
    return "ran"


try:
    print(train(state))
except ConfigError as e:
    print("refused:", e)
'''


def _first_job():
    """Commit batches 1-4; after commit 2, rank 0 starts the second job and waits for it."""
    import parlay.horovod as hvd

    state = hvd.elastic.ObjectState(batch=0)
    seen: dict[str, object] = {}

    @hvd.elastic.run
    def train(state):
        for b in range(state.batch, 4):
            state.batch = b + 1
            state.commit()
            if b == 1 and hvd.rank() == 0:
                env = {k: v for k, v in os.environ.items() if k not in (
                    "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE")}
                held = state._store.steps()
                seen["second"] = subprocess.run([sys.executable, "-c", SECOND_JOB], env=env,
                                                capture_output=True, text=True, timeout=90)
                seen["held"] = (held, state._store.steps())
        return "done"

    return train(state), seen


def test_second_live_job_under_the_same_run_id_is_refused(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "two-jobs", "TORCHELASTIC_MAX_RESTARTS": "1",
           "TORCHELASTIC_RESTART_COUNT": "0", "PARLAY_SNAPSHOT_DIR": str(tmp_path)}
    (result, seen), (other, _) = run_world(_first_job, 2, env=env)
    second = seen["second"]
    assert "refused: run id 'two-jobs' is in use by a live job" in second.stdout, \
        second.stdout + second.stderr[-3000:]
    before, after = seen["held"]
    assert before == after == [1, 2], "the second job deleted the first job's commits"
    assert result == other == "done"
