"""Trainer(reshard=True) on real gloo ranks: which files make a step, torn steps, leftover files
of removed ranks and pruning after a change of world size ("a rank died while writing" is
simulated by deleting its file)."""
from __future__ import annotations

import warnings

import pytest

import parlay
from parlay.testing import run_world
from tests.dist.test_shard_trainer import _build, _dataset, _dcp_run

pytestmark = pytest.mark.timeout(120)


def _run(ckpt, max_iteration, reshard, keep_last=3):
    """Train to ``max_iteration`` (a checkpoint every 2 steps); the resumed step and the
    warnings given while resuming."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = parlay.Trainer(_build, _dataset(), batch_size=4, num_epochs=4,
                           max_iteration=max_iteration, checkpoint_dir=ckpt, checkpoint_every=2,
                           keep_last=keep_last, reshard=reshard, progress=False)
    resumed = t.state.step
    t.train_to_end()
    return resumed, [str(w.message) for w in caught]


def _names(d, step=None):
    return sorted(p.name for p in d.glob("ckpt-*.pt") if step is None or f"{step:010d}" in p.name)


def test_a_removed_ranks_leftover_file_does_not_hide_this_worlds_newest_step(tmp_path):
    run_world(_run, 3, str(tmp_path), 4, False)        # 3 ranks: steps 2 and 4
    (tmp_path / "ckpt-0000000004.rank1.pt").unlink()    # rank 1 died while writing step 4
    leftover = tmp_path / "ckpt-0000000004.rank2.pt"
    old_file = leftover.read_bytes()
    assert [r[0] for r in run_world(_run, 2, str(tmp_path), 4, True)] == [2, 2]
    # the 2-rank run's step 4 replaced old rank 2's file: its first rank removed that one
    assert _names(tmp_path, 4) == ["ckpt-0000000004.rank0.pt", "ckpt-0000000004.rank1.pt"]
    leftover.write_bytes(old_file)                      # one it could not see (or a copy)
    again = run_world(_run, 2, str(tmp_path), 6, True)
    assert [r[0] for r in again] == [4, 4]              # this world's newest, not step 2
    assert not any("falling back" in w or "resharded" in w for r in again for w in r[1])


def test_a_torn_step_whose_survivors_are_the_new_worlds_ranks_falls_back_and_reshards(tmp_path):
    run_world(_dcp_run, 4, str(tmp_path), 4)           # 4 ranks (shard="gradients"): 2 and 4
    for r in (2, 3):                                    # ranks 2 and 3 died writing step 4
        (tmp_path / f"ckpt-0000000004.rank{r}.pt").unlink()
    two = run_world(_dcp_run, 2, str(tmp_path), 6, True)
    assert [r[0] for r in two] == [2, 2]
    for _, _, caught in two:
        assert any("step 4 holds the files of 2 of its 4 ranks" in w for w in caught), caught
        assert any("resharded checkpoint step 2 written by 4" in w for w in caught), caught


def test_the_first_save_after_resharding_onto_more_ranks_keeps_the_older_steps(tmp_path):
    run_world(_run, 2, str(tmp_path), 6, False)        # 2 ranks: steps 2, 4, 6
    assert [r[0] for r in run_world(_run, 3, str(tmp_path), 8, True)] == [6, 6, 6]
    # keep_last=3: step 8 and the two newest older ones (new rank 2 holds none of them)
    assert _names(tmp_path) == [f"ckpt-{s:010d}.rank{r}.pt" for s in (4, 6) for r in range(2)] \
        + [f"ckpt-0000000008.rank{r}.pt" for r in range(3)]
