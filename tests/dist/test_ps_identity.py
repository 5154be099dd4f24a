"""A parameter server's shard file belongs to the run of the workers' checkpoint files of its
step: a server file of another run copied into the folder is not resumed (the ranks fall back
to the previous step, with a warning naming the file), so the result equals the run's own."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)
PS1 = {"PARLAY_NUM_PS": "1"}


def _train(ckpt: str, seed: int):
    """A sync ps Trainer (1 server, 2 workers): 6 steps, a checkpoint every 3. Returns the
    step it resumed and its final weights (workers), or the warnings it logged (server)."""
    import parlay

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("parlay.ps").addHandler(handler)
    x = torch.randn(48, 6, generator=torch.Generator().manual_seed(11))
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)),
                                nn.CrossEntropyLoss()),
                       TensorDataset(x, (x[:, :3].sum(1) > 0).long()), optimizer_args={"lr": 0.05},
                       batch_size=4, max_iteration=6, mode="ps", checkpoint_dir=ckpt,
                       checkpoint_every=3, snapshot_every=0, seed=seed, progress=False,
                       strategy_options={"consistency": "sync"})
    start = t.state.step
    while not t.should_stop():
        t.train_on_batch()
    if not t.strategy.consumes_data:
        return warned
    return start, {k: v.clone() for k, v in t.model.state_dict().items()}


def _two_runs(a: str, b: str):
    """Run A (seed 0), then run B: another run (seed 1) of the same layout."""
    first = _train(a, 0)
    _train(b, 1)
    return first


def test_server_file_of_another_run_is_not_resumed(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    first = run_world(_two_runs, 3, str(a), str(b), env=PS1)
    name = "ps-0.step-0000000006.pt"
    shutil.copy(b / "ps" / name, a / "ps" / name)  # its server file of the newest step
    again = run_world(_train, 3, str(a), 0, env=PS1)
    assert any(name in m and "another run" in m for m in again[0]), again[0]
    for rank in (1, 2):
        start, weights = again[rank]
        assert start == 3, f"rank {rank} resumed step {start}, not the previous step 3"
        for k, v in first[rank][1].items():  # steps 4-6 redone: the run's own result
            assert torch.equal(v, weights[k]), k
