"""No data dropped with a lost worker (issue 25): in ``async``/``stale`` a worker killed with
``os._exit`` mid-epoch is dropped, and from the next epoch on the survivors train its share of
the data too. Exact bookkeeping: every sample index a survivor's loss saw is recorded, per epoch;
each later epoch holds every sample exactly once, and the printed epoch summary counts what the
survivors trained. A checkpoint written after the takeover resumes with the new sharding.
"""
from __future__ import annotations

import collections
import json
import logging
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.testing import WorldError, run_world

pytestmark = pytest.mark.timeout(180)

PS1 = {"PARLAY_NUM_PS": "1"}
N, BATCH = 24, 2  # 3 workers: 4 steps per epoch each; 2 survivors: 6
DEAD_RANK, DIE_AT = 3, 2  # worker 2 dies at step 2, in the middle of epoch 0


def _train(consistency: str, metrics: str, epochs: int, ckpt: str | None = None,
           dead: int = DEAD_RANK) -> dict:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g)
    # Column 0 of each target is the sample's index: the loss records what was trained.
    y = torch.cat([torch.arange(N, dtype=torch.float32)[:, None], x[:, :2]], 1)
    seen: list[int] = []

    def build():
        def loss(out, target):
            seen.extend(int(i) for i in target[:, 0])
            return nn.functional.mse_loss(out, target[:, 1:])
        return nn.Linear(5, 2), loss

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: warnings.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("parlay.ps").addHandler(handler)
    t = parlay.Trainer(build, TensorDataset(x, y), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.01}, batch_size=BATCH, num_epochs=epochs,
                       progress=False, mode="ps", metrics_path=metrics, checkpoint_dir=ckpt,
                       strategy_options={"consistency": consistency})
    per_epoch: dict[int, list[int]] = collections.defaultdict(list)
    while not t.should_stop():
        if parlay.rank() == dead and t.state.step == DIE_AT:  # (sitting out: never)
            os._exit(1)
        epoch = t.state.epoch
        t.train_on_batch()
        per_epoch[epoch] += seen
        seen.clear()
    return {"seen": dict(per_epoch), "step": t.state.step,
            # the schedule ends at its last step (its total counts the new steps per epoch)
            "schedule_end": (t.state.step + t.state.schedule_shift, t.total_steps),
            "warnings": [w for w in warnings if "no longer train" in w]}


def _summaries(path) -> dict[int, int]:
    with open(path) as f:
        return {r["epoch"]: r["samples"] for r in map(json.loads, f) if r["event"] == "epoch"}


def _check_later_epochs(survivors: list[dict], epochs: range) -> None:
    for e in epochs:
        counts = collections.Counter(i for s in survivors for i in s["seen"].get(e, []))
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, (e, counts)


@pytest.mark.parametrize("consistency", ["async", "stale:1"])
def test_survivors_take_over_a_lost_workers_share_from_the_next_epoch(tmp_path, consistency):
    metrics = tmp_path / "metrics.jsonl"
    out = run_world(_train, 4, consistency, str(metrics), 3, env=PS1, comm_timeout=30,
                    timeout=150, return_exceptions=True)
    assert isinstance(out[DEAD_RANK], WorldError)
    survivors = [out[1], out[2]]
    # Epoch 0: each survivor its own third (the dead worker's untrained rest is gone);
    # epochs 1 and 2: the survivors' halves hold every sample exactly once.
    assert [sorted(s["seen"]) for s in survivors] == [[0, 1, 2]] * 2
    assert all(len(s["seen"][0]) == N // 3 for s in survivors)
    _check_later_epochs(survivors, range(1, 3))
    assert [s["step"] for s in survivors] == [4 + 6 + 6] * 2
    assert [s["schedule_end"] for s in survivors] == [(3 * 6, 3 * 6)] * 2
    # The summaries count what was trained: the survivors' samples, not the dataset's size.
    trained = {e: sum(len(s["seen"][e]) for s in survivors) for e in range(3)}
    assert _summaries(metrics) == trained == {0: 2 * N // 3, 1: N, 2: N}
    for s in survivors:  # each survivor says who was lost and that its share is taken over
        assert len(s["warnings"]) == 1, s["warnings"]
        w = s["warnings"][0]
        assert "epoch 0: worker(s) 2 (rank 3) no longer train" in w and "from epoch 1" in w, w


def test_a_checkpoint_after_the_takeover_resumes_with_the_new_sharding(tmp_path):
    # Run 1: worker 2 dies in epoch 0; the survivors take over in epoch 1 and checkpoint at
    # its end. Run 2 (every rank, one more epoch): worker 2 holds no checkpoint and sits out;
    # the survivors resume sharded in two, and epoch 2 again trains every sample once.
    ckpt = str(tmp_path / "ckpt")
    first = run_world(_train, 4, "async", str(tmp_path / "m1.jsonl"), 2, ckpt, env=PS1,
                      comm_timeout=30, timeout=150, return_exceptions=True)
    assert isinstance(first[DEAD_RANK], WorldError)
    _check_later_epochs([first[1], first[2]], range(1, 2))
    out = run_world(_train, 4, "async", str(tmp_path / "m2.jsonl"), 3, ckpt, env=PS1,
                    comm_timeout=30, timeout=150)
    assert out[DEAD_RANK]["seen"] == {} and out[DEAD_RANK]["step"] == 0
    assert [sorted(s["seen"]) for s in out[1:3]] == [[2], [2]]
    _check_later_epochs([out[1], out[2]], range(2, 3))
    assert [s["step"] for s in out[1:3]] == [4 + 6 + 6] * 2
    assert _summaries(tmp_path / "m2.jsonl") == {2: N}


def test_when_the_printing_worker_is_lost_the_lowest_survivor_writes_the_summaries(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    out = run_world(_train, 4, "async", str(metrics), 3, None, 1, env=PS1, comm_timeout=30,
                    timeout=150, return_exceptions=True)
    assert isinstance(out[1], WorldError)  # worker 0, the printer, dies in epoch 0
    _check_later_epochs([out[2], out[3]], range(1, 3))
    assert _summaries(metrics) == {0: 2 * N // 3, 1: N, 2: N}
