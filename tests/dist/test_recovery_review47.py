"""Resumes the ranks must agree on (review 47): a first checkpoint left incomplete by a killed
rank, a checkpoint_dir of another mode, and parameter servers resumed at another --ps count."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.errors import CheckpointError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _train(ckpt, steps, mode="allreduce", **options):
    x = torch.randn(48, 5, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t = parlay.Trainer(lambda: (nn.Linear(5, 2), nn.CrossEntropyLoss()),
                               TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4,
                               max_iteration=steps, checkpoint_dir=ckpt, checkpoint_every=2,
                               progress=False, mode=mode, **options)
        except CheckpointError as e:
            return e
    start = t.state.step
    while not t.should_stop():
        t.train_on_batch()
    t.close()
    return start, t.state.step, [str(w.message) for w in caught if "only some" in str(w.message)]


@pytest.mark.parametrize("reshard", [False, True])
def test_a_first_checkpoint_a_killed_rank_left_incomplete_is_skipped_on_every_rank(tmp_path,
                                                                                   reshard):
    # Rank 1 died while writing the job's first checkpoint (step 2), after rank 0 wrote its
    # file: the restart was refused as "another layout" (reshard=True: "none usable") forever.
    run_world(_train, 2, str(tmp_path), 2)
    (tmp_path / "ckpt-0000000002.rank1.pt").unlink()
    for start, end, warned in run_world(_train, 2, str(tmp_path), 4, reshard=reshard):
        assert (start, end) == (0, 4) and "step(s) 2" in warned[0] and "cannot be resumed" in \
            warned[0]
    assert (tmp_path / "ckpt-0000000004.rank1.pt").is_file()


def test_a_checkpoint_dir_of_mode_ps_resumed_in_mode_allreduce_names_the_mode(tmp_path):
    # The ps workers' files (global ranks 1, 2) and an allreduce run's ranks (0, 1) overlap
    # in part: the message blamed the number of parameter servers, never the mode.
    run_world(_train, 3, str(tmp_path), 2, "ps", env={"PARLAY_NUM_PS": "1"})
    for e in run_world(_train, 2, str(tmp_path), 4):
        assert isinstance(e, CheckpointError), "every rank refuses, with the same reason"
        assert "it was written in mode 'ps', this run uses mode 'allreduce'" in str(e)
        assert "Fix: resume with mode='ps'" in str(e)


def _servers_agree(disk):
    from parlay.ps.recovery import agree_resume

    try:
        agree_resume(disk[parlay.rank()], [], is_worker=parlay.rank() == 2, tagged=False,
                     snapshots=False, relaxed=False, group=None)
    except CheckpointError as e:
        return str(e)
    return None


def test_servers_resumed_at_another_ps_count_say_so_not_missing_files():
    # 1 server wrote versions 2, 3; resumed with --ps 2, server 1 holds none.
    for msg in run_world(_servers_agree, 3, [[2, 3], [], []]):
        assert "Server(s) [1] hold none" in msg and "number of parameter servers probably " \
            "changed" in msg and "--ps count" in msg and "restore the missing" not in msg
    for msg in run_world(_servers_agree, 3, [[2, 3], [1], []]):  # both hold files: missing
        assert "restore the missing ps-<k>.step-*.pt files" in msg
