"""The Trainer drives any registered strategy, including ranks that only serve.

A small strategy defined here (rank 0 serves, the others train data-parallel among
themselves) checks the contract the "ps" and "hybrid" modes rely on, without depending on them:
``should_stop()`` serves on serving ranks and returns True when the workers finish, data is
sharded over ``dp_size``, and checkpoints and the printer involve the training ranks only.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay import comm
from parlay.strategies.allreduce import AllreduceStrategy
from parlay.strategies import available_strategies, register_strategy
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


class _ServeOnRankZero(AllreduceStrategy):
    name = "test-serve-rank0"

    def __init__(self, **options):
        world = dist.get_world_size()
        self._workers_group = dist.new_group(list(range(1, world)))  # collective: every rank
        self._serving = dist.get_rank() == 0
        self.served = False
        super().__init__(process_group=None if self._serving else self._workers_group, **options)

    @property
    def dp_size(self):
        return dist.get_world_size() - 1

    @property
    def dp_rank(self):
        return max(0, dist.get_rank() - 1)

    @property
    def consumes_data(self):
        return not self._serving

    def setup(self, model, loss_fn, optimizer_cls, optimizer_args):
        if not self._serving:
            super().setup(model, loss_fn, optimizer_cls, optimizer_args)

    def serve_until_done(self):
        if not self._serving:
            return False
        done = torch.zeros(1)
        comm.recv(done, src=1)          # the first worker's finish() releases the server
        self.served = True
        return True

    def finish(self):
        if not self._serving and dist.get_rank() == 1:
            comm.send(torch.ones(1), dst=0)


register_strategy(_ServeOnRankZero.name, _ServeOnRankZero)


def _run(ckpt_dir):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(60, 4, generator=g)
    ds = TensorDataset(x, (x.sum(1) > 0).long())
    t = parlay.Trainer(lambda: (nn.Linear(4, 2), nn.CrossEntropyLoss()), ds,
                       optimizer_args={"lr": 0.05}, batch_size=5, num_epochs=2,
                       mode=_ServeOnRankZero.name, checkpoint_dir=ckpt_dir,
                       validation_dataset=ds, progress=False)
    metrics = t.train_and_validate_to_end()
    params = [p.detach().clone() for p in t.model.parameters()] if parlay.rank() else None
    return dict(stop=t.should_stop(), state=t.state, metrics=metrics, params=params,
                printer=t.metrics.printer, served=t.strategy.served,
                steps_per_epoch=t.steps_per_epoch, lr_scale=t.lr_scale)


def test_serving_rank_stops_when_workers_finish(tmp_path):
    assert _ServeOnRankZero.name in available_strategies()
    server, w1, w2 = run_world(_run, 3, str(tmp_path))
    assert server["stop"] and server["served"] and server["metrics"] == {}
    assert server["state"].step == 0 and not server["printer"]
    assert w1["printer"] and not w2["printer"], "exactly one printer: the first worker"
    for w in (w1, w2):
        assert w["stop"] and not w["served"]
        assert w["steps_per_epoch"] == 6 and w["state"].step == 12, "60 samples over 2 replicas"
        assert w["lr_scale"] == 2.0
        assert w["metrics"]["samples"] == 60 and w["metrics"]["accuracy"] > 0.8
    for p, q in zip(w1["params"], w2["params"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    ranks = sorted({p.name.split(".")[1] for p in tmp_path.glob("ckpt-*.pt")})
    assert ranks == ["rank1", "rank2"], "only the training ranks checkpoint"
    events = [json.loads(x)["event"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert events == ["start", "epoch", "validation", "epoch", "validation"], "printer only"
