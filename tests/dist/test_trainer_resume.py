"""Checkpoint and resume through the Trainer on real gloo ranks (each phase a fresh world)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.checkpoint import load
from parlay.errors import CheckpointError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

N, BATCH = 44, 4          # 2 ranks: 22 samples each -> 6 steps per epoch (last batch of 2)
TOTAL, CUT = 15, 8        # the cut falls in the middle of the second epoch


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def _build():
    # Dropout: the resumed run must also restore the RNG to draw the same masks.
    return (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)),
            nn.CrossEntropyLoss())


def _train(ckpt_dir, max_iteration, checkpoint_every=None, keep_last=3, compression=None,
           prefetch=None, reshard=False):
    t = parlay.Trainer(_build, _dataset(), optimizer_args={"lr": 1e-2}, batch_size=BATCH,
                       max_iteration=max_iteration, checkpoint_dir=ckpt_dir,
                       checkpoint_every=checkpoint_every, keep_last=keep_last,
                       compression=compression, prefetch=prefetch, progress=False,
                       reshard=reshard)
    start = t.state.step
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    return start, losses, [p.detach().clone() for p in t.model.parameters()], t.state


# The second case also loads through the prefetch thread, which runs ahead of training: the
# checkpoint must record what was consumed, not what was loaded.
@pytest.mark.parametrize("compression, prefetch", [(None, None), ("topk:0.25", 3)])
def test_resume_mid_epoch_is_bit_for_bit(tmp_path, compression, prefetch):
    if compression is not None and compression.split(":")[0] not in parlay.compress.available():
        pytest.skip(f"compressor {compression} not registered")
    full = run_world(_train, 2, None, TOTAL, None, 3, compression, prefetch)
    first = run_world(_train, 2, str(tmp_path), CUT, 5, 3, compression, prefetch)
    second = run_world(_train, 2, str(tmp_path), TOTAL, 5, 3, compression, prefetch)
    for r in range(2):
        start_a, losses_a, params_a, state_a = full[r]
        start_b, losses_b, _, state_b = first[r]
        start_c, losses_c, params_c, state_c = second[r]
        assert (start_a, start_b, start_c) == (0, 0, CUT)
        assert state_b.epoch == 1 and state_b.batch_in_epoch == CUT - 6, "cut is mid-epoch"
        assert losses_b + losses_c == losses_a            # exactly, not approximately
        for p, q in zip(params_a, params_c):
            assert torch.equal(p, q)
        assert state_c == state_a
    # keep_last=3 of the saves at steps 5, 8 (final of the first run), 10, 15 (final).
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert names == [f"ckpt-{s:010d}.rank{r}.pt" for s in (8, 10, 15) for r in range(2)]
    assert not list(tmp_path.glob(".*tmp*")), "no temporary files are left behind"


def _resume_after_corruption(ckpt_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = parlay.Trainer(_build, _dataset(), optimizer_args={"lr": 1e-2}, batch_size=BATCH,
                           max_iteration=TOTAL, checkpoint_dir=ckpt_dir, progress=False)
    step = t.state.step
    params = [p.detach().clone() for p in t.model.parameters()]
    t.close()
    return step, params, [str(w.message) for w in caught]


def _params_at(ckpt_dir, step):
    sd = load(f"{ckpt_dir}/ckpt-{step:010d}.rank0.pt")["strategy"]["model"]
    return list(sd.values())


def test_truncated_checkpoint_raises_and_previous_one_is_used(tmp_path):
    run_world(_train, 2, str(tmp_path), 6, 3)                 # checkpoints at steps 3 and 6
    bad = tmp_path / f"ckpt-{6:010d}.rank1.pt"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])                   # a copy cut short
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load(bad)
    out = run_world(_resume_after_corruption, 2, str(tmp_path))
    want = _params_at(tmp_path, 3)
    for step, params, messages in out:
        assert step == 3, "every rank falls back to the same, previous checkpoint"
        assert any("step 6 is not usable" in m for m in messages)
        for p, q in zip(params, want):
            assert torch.equal(p, q)


def _logged(ckpt_dir, max_iteration, metrics_path):
    t = parlay.Trainer(_build, _dataset(), optimizer_args={"lr": 1e-2}, batch_size=BATCH,
                       max_iteration=max_iteration, checkpoint_dir=ckpt_dir, log_step_size=3,
                       checkpoint_every=5, metrics_path=metrics_path, progress=False)
    while not t.should_stop():
        t.train_on_batch()


def _epoch_lines(path):
    import json

    recs = [json.loads(line) for line in open(path)]
    return [(r["epoch"], r["step"], r.get("samples"), round(r["loss"], 12))
            for r in recs if r["event"] in ("epoch", "train")]


def test_the_summary_of_an_epoch_spanning_a_resume_covers_it_whole(tmp_path):
    # the cut (step 8) is two steps into epoch 1: its summary must count steps 7-12, not 9-12
    # (and the log record of step 9 steps 7-9, not step 9 alone)
    run_world(_logged, 2, None, TOTAL, str(tmp_path / "full.jsonl"))
    run_world(_logged, 2, str(tmp_path / "ck"), CUT, str(tmp_path / "cut.jsonl"))
    run_world(_logged, 2, str(tmp_path / "ck"), TOTAL, str(tmp_path / "cut.jsonl"))
    full = _epoch_lines(tmp_path / "full.jsonl")
    assert [e[:3] for e in full if e[2]] == [(0, 6, 44), (1, 12, 44)]
    assert [e[1] for e in full if not e[2]] == [3, 6, 9, 12, 15]
    assert _epoch_lines(tmp_path / "cut.jsonl") == full


def test_a_setting_spelled_as_an_equal_int_or_float_resumes(tmp_path):
    # one process: the recipe saved "1.0" (the default warmup_epochs) and now reads "1"
    kw = {"batch_size": BATCH, "checkpoint_dir": str(tmp_path), "progress": False}
    t = parlay.Trainer(_build, _dataset(), optimizer_args={"lr": 1}, grad_clip=1,
                       max_iteration=2, **kw)
    t.train_to_end()
    t = parlay.Trainer(_build, _dataset(), optimizer_args={"lr": 1.0}, grad_clip=1.0,
                       warmup_epochs=1, max_iteration=3, **kw)
    assert t.state.step == 2
    t.close()
    parlay.shutdown()


@pytest.mark.parametrize("reshard", [False, True])
def test_a_step_one_rank_did_not_write_is_neither_resumed_nor_kept_over_a_whole_one(tmp_path,
                                                                                     reshard):
    # The job ended between the ranks' files of step 8: rank 1's is missing. reshard=True
    # took rank 0's file alone for a 1-rank checkpoint and resharded it (a batch trained
    # twice); and the next save's pruning counted step 8 on rank 0, deleting step 6, the
    # newest step every rank held, while keeping the torn one.
    full = run_world(_train, 2, None, TOTAL, None, 2)
    run_world(_train, 2, str(tmp_path), CUT, 2, 2)
    (tmp_path / f"ckpt-{CUT:010d}.rank1.pt").unlink()
    second = run_world(_train, 2, str(tmp_path), 9, 3, 2, None, None, reshard)
    assert [second[r][0] for r in range(2)] == [6, 6]
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert names == [f"ckpt-{s:010d}.rank{r}.pt" for s in (6, 9) for r in range(2)]
    third = run_world(_train, 2, str(tmp_path), TOTAL, 3, 2, None, None, reshard)
    for r in range(2):
        assert third[r][0] == 9
        assert all(torch.equal(p, q) for p, q in zip(full[r][2], third[r][2]))
