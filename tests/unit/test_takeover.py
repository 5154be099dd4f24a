"""The pure pieces of a lost worker's takeover (issue 25), without a process group: the servers'
epoch-end barrier (ServerCore) and the sampler's re-sharding and its resumable state."""
from __future__ import annotations

import pytest

from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError, ConfigError
from parlay.ps import get_consistency
from parlay.ps.consistency import ServerCore

pytestmark = pytest.mark.timeout(60)


def _core(n: int = 3) -> ServerCore:
    core = ServerCore(get_consistency("async"), n, 5.0, lambda grads, lr: None, now=0.0)
    for w in range(n):
        core.hello(w, 0.0)
    return core


def test_epoch_end_waits_for_every_live_worker_and_leaves_the_lost_one_out():
    core = _core()
    assert core.end_epoch(0, 0, 8, 1.0) == []
    assert core.end_epoch(1, 0, 8, 1.0) == []  # worker 2 has not ended epoch 0
    out = core.lose(2, 6, 2.0)  # its connection closed
    assert [(r.kind, r.worker, r.code, r.counts) for r in out] == \
        [("epoch", 0, 0, (8, 8, -1)), ("epoch", 1, 0, (8, 8, -1))]
    assert core.push(0, 4, 0, "g", 1.0, 3.0)[0].kind == "params"  # training goes on


def test_epoch_end_and_checkpoint_at_once_is_a_mismatch():
    core = _core(2)
    core.end_epoch(0, 0, 8, 1.0)
    out = core.save(1, 4, 1.0)
    assert [(r.kind, r.code) for r in out] == [("error", 5), ("error", 5)]  # SAVE_MISMATCH


def test_reshard_covers_the_dataset_and_resumes_from_the_state():
    old = [ShardedSampler(24, 3, r, seed=1) for r in range(3)]
    new = []
    for r, s in enumerate(old[:2]):  # replica 2 was lost: 0 and 1 take over
        s.reshard(2, r)
        s.set_epoch(1)
        s.advance(4)
        fresh = ShardedSampler(24, 3, r, seed=1)  # a restart builds it for every worker
        fresh.load_state_dict(s.state_dict())
        assert (fresh.num_replicas, fresh.rank, fresh.position) == (2, r, 4)
        new.append(fresh)
    assert sorted(i for s in new for i in s.epoch_indices()) == list(range(24))
    assert list(new[0]) == new[0].epoch_indices()[4:]


def test_reshard_and_resume_refuse_what_does_not_fit():
    s = ShardedSampler(24, 2, 0)
    with pytest.raises(ConfigError, match="num_replicas <= 2"):
        s.reshard(3, 0)
    with pytest.raises(ConfigError, match="rank < num_replicas"):
        s.reshard(1, 1)
    s.reshard(1, 0)
    with pytest.raises(CheckpointError, match="num_replicas=2"):
        ShardedSampler(24, 3, 0).load_state_dict(s.state_dict())
