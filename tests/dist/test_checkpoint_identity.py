"""A resume that cannot continue a checkpoint exactly is refused, on every rank, with the fix.

Each case writes checkpoints with a 2-rank Trainer, then resumes from the same directory with
something changed (the number of ranks, the batch size, the model, the files of one step, a
second run holding the directory) and checks the error and that no file was touched.
"""
from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.checkpoint import load
from parlay.errors import CheckpointError
from parlay.runinfo import DirLock
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

N = 48


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, 5, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _build(width: int = 8):
    return nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 2)), nn.CrossEntropyLoss()


def _build_wide():
    return _build(12)


def _train(ckpt, steps, batch=4, build=_build, **options):
    try:
        t = parlay.Trainer(build, _dataset(), optimizer_args={"lr": 1e-2}, batch_size=batch,
                           max_iteration=steps, checkpoint_dir=ckpt, checkpoint_every=2,
                           progress=False, **options)
    except CheckpointError as e:
        return e
    while not t.should_stop():
        t.train_on_batch()
    return t.state.step


def _files(d):
    return {p.name: p.read_bytes() for p in d.glob("ckpt-*.pt")}


@pytest.fixture
def two_rank_dir(tmp_path):
    assert run_world(_train, 2, str(tmp_path), 4) == [4, 4]
    return tmp_path


@pytest.mark.parametrize("world", [3, 1])
def test_other_world_size_is_refused_and_nothing_is_pruned(two_rank_dir, world):
    before = _files(two_rank_dir)
    out = run_world(_train, world, str(two_rank_dir), 8)
    for e in out:
        assert isinstance(e, CheckpointError), "never a silent fresh start"
        assert "2 rank(s)" in str(e) and f"this run has {world}" in str(e)
        assert "parlay run -n 2" in str(e) or "relaunch" in str(e)
    assert _files(two_rank_dir) == before, "the old run's checkpoints are untouched"


def test_other_batch_size_is_refused(two_rank_dir):
    out = run_world(_train, 2, str(two_rank_dir), 8, 8)
    for e in out:
        assert isinstance(e, CheckpointError)
        assert "batch_size=4" in str(e) and "batch_size=8" in str(e)


def test_other_architecture_is_refused_with_the_first_difference(two_rank_dir):
    out = run_world(_train, 2, str(two_rank_dir), 8, 4, _build_wide)
    for e in out:
        assert isinstance(e, CheckpointError) and "different model architecture" in str(e)
        assert "'0.weight' (8, 5)" in str(e) and "'0.weight' (12, 5)" in str(e)


class _Proj(nn.Module):
    """x @ w with w of shape (5, 8), or x @ w.T with w of shape (8, 5): same names, same sizes."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.t = transposed
        self.w = nn.Parameter(torch.randn(8, 5) if transposed else torch.randn(5, 8))

    def forward(self, x):
        return x @ self.w.T if self.t else x @ self.w


def _build_proj(transposed):
    return nn.Sequential(_Proj(transposed), nn.Linear(8, 2)), nn.CrossEntropyLoss()


def test_shard_parameters_records_the_shapes_as_built(tmp_path):
    # Sharded, the model holds size-0 placeholders: the identity must be taken before.
    def train(steps, transposed):
        return run_world(_train, 2, str(tmp_path), steps, 4,
                         functools.partial(_build_proj, transposed), shard="parameters")
    assert train(3, False) == [3, 3]
    for e in train(6, True):
        assert isinstance(e, CheckpointError) and "different model architecture" in str(e)
        assert "'0.w' (5, 8)" in str(e) and "'0.w' (8, 5)" in str(e)
    assert train(6, False) == [6, 6]


def test_same_config_resumes_and_keeps_the_run_id(two_rank_dir):
    first = load(two_rank_dir / f"ckpt-{4:010d}.rank0.pt")["identity"]
    assert (first["world_size"], first["dp_size"], first["pp"], first["batch_size"]) == (2, 2, 1, 4)
    assert run_world(_train, 2, str(two_rank_dir), 6) == [6, 6]
    again = load(two_rank_dir / f"ckpt-{6:010d}.rank1.pt")["identity"]
    assert again["run_id"] == first["run_id"]
    assert again["model_fingerprint"] == first["model_fingerprint"]


def test_files_of_two_runs_in_one_step_are_refused(two_rank_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    run_world(_train, 2, str(other), 4)
    shutil.copy(other / f"ckpt-{4:010d}.rank1.pt", two_rank_dir / f"ckpt-{4:010d}.rank1.pt")
    for r, e in enumerate(run_world(_train, 2, str(two_rank_dir), 8)):
        assert isinstance(e, CheckpointError) and "different runs" in str(e)
        assert f"ckpt-{4:010d}.rank{r}.pt" in str(e) and "to resume the step before" in str(e)


def test_a_second_run_cannot_share_the_directory(tmp_path):
    holder = DirLock(tmp_path)
    assert holder.acquire({"run_id": "first-run"}) is None   # a run holding the directory
    try:
        for e in run_world(_train, 2, str(tmp_path), 2):
            assert isinstance(e, CheckpointError)
            assert "in use by run first-run" in str(e) and "own checkpoint_dir" in str(e)
        assert not list(tmp_path.glob("ckpt-*")), "the refused run wrote nothing"
    finally:
        holder.release()
    assert run_world(_train, 2, str(tmp_path), 2) == [2, 2], "free again once released"


def test_other_architecture_without_identity_is_a_checkpoint_error(two_rank_dir):
    # Checkpoints written before identities were recorded: the load itself must not surface
    # torch's raw RuntimeError.
    from parlay.checkpoint import save_atomic

    for path in two_rank_dir.glob("ckpt-*.pt"):
        state = load(path)
        del state["identity"]
        save_atomic(state, path)
    for e in run_world(_train, 2, str(two_rank_dir), 8, 4, _build_wide):
        assert isinstance(e, CheckpointError) and "does not fit this model" in str(e)
        assert "size mismatch" in str(e) and "same model" in str(e)


def _hybrid_with_sample(ckpt, steps, seed):
    torch.manual_seed(seed)  # the example input is drawn anew by each run
    options = {"pp": 2, "by": "params", "sample": torch.randn(4, 5)}
    t = parlay.Trainer(_build, _dataset(), optimizer_args={"lr": 1e-2}, batch_size=4,
                       max_iteration=steps, checkpoint_dir=ckpt, checkpoint_every=2,
                       progress=False, mode="hybrid", strategy_options=options)
    start = t.state.step
    while not t.should_stop():
        t.train_on_batch()
    return start, t.state.step


def test_hybrid_resumes_with_an_example_input_drawn_anew(tmp_path):
    assert run_world(_hybrid_with_sample, 2, str(tmp_path), 4, 1) == [(0, 4)] * 2
    assert run_world(_hybrid_with_sample, 2, str(tmp_path), 6, 2) == [(4, 6)] * 2
