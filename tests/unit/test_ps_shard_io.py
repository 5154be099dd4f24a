"""A parameter server's shard files are refused when they are not what they claim."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from parlay.errors import CheckpointError
from parlay.ps.shard_io import ShardPersistence


class _Server(ShardPersistence):
    def __init__(self, folder, optimizer_cls=torch.optim.SGD, **args) -> None:
        self.index, self.dir, self.path, self.worker_ranks = 0, str(folder), None, [1, 2]
        self.flat = torch.arange(4.0)
        self.optimizer = optimizer_cls([torch.nn.Parameter(self.flat.clone())],
                                       **{"lr": 0.1, **args})
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.plan = SimpleNamespace(rows=lambda: [[0, 4]])
        self.core = SimpleNamespace(version=7, clocks=[7, 7], histogram={})


def test_a_renamed_step_file_and_another_optimizers_file_are_refused(tmp_path):
    server = _Server(tmp_path)
    server.snapshot(2)
    assert server._load(server.snapshot_path(2), tag=2) == (7, [7, 7])
    # step 2's file copied as step 4 was resumed as step 4, silently
    shutil.copy(server.snapshot_path(2), server.snapshot_path(4))
    with pytest.raises(CheckpointError, match=r"says step 2, its name says step 4"):
        server._load(server.snapshot_path(4), tag=4)
    # an SGD state loaded into Adam failed at the first step with KeyError: 'betas'
    with pytest.raises(CheckpointError, match=r"state of a SGD optimizer, this run steps Adam"):
        _Server(tmp_path, torch.optim.Adam)._load(server.snapshot_path(2), tag=2)


def test_a_file_written_with_other_optimizer_settings_is_refused_naming_them(tmp_path):
    server = _Server(tmp_path, momentum=0.9)
    server.optimizer.param_groups[0]["lr"] = 0.05  # scaled for a step: the base lr counts
    server.snapshot(2)
    assert _Server(tmp_path, momentum=0.9)._load(server.snapshot_path(2), tag=2) == (7, [7, 7])
    # loading it replaced this run's momentum with the file's, silently
    with pytest.raises(CheckpointError, match=r"momentum: 0.9 then, 0.5 now.*optimizer_args"):
        _Server(tmp_path, momentum=0.5)._load(server.snapshot_path(2), tag=2)
    with pytest.raises(CheckpointError, match=r"lr: 0.1 then, 0.2 now"):
        _Server(tmp_path, momentum=0.9, lr=0.2)._load(server.snapshot_path(2), tag=2)
