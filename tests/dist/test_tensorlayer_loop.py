"""The seed's TensorLayer loop, ``while not trainer.session.should_stop()``, in every mode, and
``examples/tensorlayer_mnist.py`` through the real launcher."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import parlay
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _build():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), nn.CrossEntropyLoss()


def _seed_loop(mode):
    rng = np.random.default_rng(3)
    X, y = rng.random((48, 8)).astype(np.float32), rng.integers(0, 3, 48)
    trainer = parlay.Trainer(build_training_func=_build, training_dataset=parlay.data.from_arrays(X, y),
                             optimizer=torch.optim.Adam, optimizer_args={"lr": 0.001},
                             batch_size=4, mode=mode, progress=False)
    steps = 0
    while not trainer.session.should_stop():
        trainer.train_on_batch()
        steps += 1
    return parlay.role(), steps, trainer.state.step, trainer.should_stop()


@pytest.mark.parametrize("mode, world, env", [("allreduce", 2, {}), ("ps", 3, {"PARLAY_NUM_PS": "1"}),
                                              ("hybrid", 2, {"PARLAY_PP": "2"})])
def test_trainer_session_should_stop_drives_every_mode(mode, world, env):
    out = run_world(_seed_loop, world, mode, env=env)
    for role, steps, state_step, stopped in out:
        assert stopped
        if role == "worker":
            dp = world - int(env.get("PARLAY_NUM_PS", 0)) if mode != "hybrid" else 1
            assert steps == state_step == 48 // (4 * dp), "one epoch by default"
        else:
            assert steps == 0, "parameter servers serve inside should_stop()"


def test_tensorlayer_example_runs_under_parlay_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER"))}
    env.pop("PARLAY_DATA_DIR", None)                 # an empty cache: the bundled copy serves
    env["XDG_CACHE_HOME"] = str(tmp_path)
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "parlay.cli", "run", "-n", "2",
                        "examples/tensorlayer_mnist.py", "--max-iteration", "6"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "test accuracy" in p.stdout


def _tensorlayer_names():
    rng = np.random.default_rng(3)
    X, y = rng.random((48, 8)).astype(np.float32), rng.integers(0, 3, 48)
    data = parlay.data.from_arrays(X, y)
    # tl.distributed.Trainer's own order: the dataset first, then the build function
    trainer = parlay.Trainer(data, _build, torch.optim.Adam, {"lr": 0.001}, 4, prefetch_size=2,
                             validation_dataset=data, num_epochs=2, progress=False)
    trainer.train_and_validate_to_end(validate_step_size=4)
    metrics = trainer.validation_metrics
    # the dataset by position, the rest by name (a TypeError: "multiple values")
    named = parlay.Trainer(data, build_training_func=_build, optimizer=torch.optim.Adam,
                           optimizer_args={"lr": 0.001}, batch_size=4, progress=False)
    assert named.config.training_dataset is data and named.config.build_training_func is _build
    return (trainer.global_step, trainer.training_network is trainer.model,
            [name for name, _ in metrics], dict(metrics) == trainer.validate())


def test_trainer_takes_tensorlayer_s_argument_order_and_names():
    for step, same, names, agreed in run_world(_tensorlayer_names, 2):
        assert step == 2 * 48 // (4 * 2) and same and agreed and "loss" in names
