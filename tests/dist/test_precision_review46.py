"""Review 46: hybrid fp16 with a loss autocast leaves in float16, and resuming a run stopped by
a non-finite step with the settings the error advises.

* The pipeline scaled a float16 loss by the fp16 loss scale in float16 (inf) and reported that
  inf: the step was taken for bad data (raised, or skipped without backing the scale off). It
  must back off like torch's GradScaler (and mode "allreduce"): 2 skipped steps, then training.
* A NonFiniteError says the last checkpoint is intact and advises ``nonfinite="skip"`` or a
  ``grad_clip``: a restart on that checkpoint_dir with them must continue it (with a warning
  naming the change), while other settings (``precision``) stay refused.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import parlay
from parlay.errors import NonFiniteError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

STEPS = 6


def _half_loss(o, y):
    """A hand-written squared error: float16 under fp16 autocast (above 1 at the start)."""
    return 3 * (o - F.one_hot(y, 3).to(o.dtype)).pow(2).mean()


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), _half_loss


def _data(n=STEPS * 4):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def _gradscaler_reference():
    """torch's own recipe, one process: the losses and the steps GradScaler skipped."""
    model, loss_fn = _build()
    x, y = _data().tensors
    opt, sc = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    losses, skipped = [], []
    for s in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x[s * 4:(s + 1) * 4]), y[s * 4:(s + 1) * 4])
        sc.scale(loss).backward()
        before = sc.get_scale()
        sc.step(opt)
        sc.update()
        losses.append(float(loss.detach().float()))
        skipped.append(sc.get_scale() < before)
    return losses, skipped, sc.get_scale()


def _hybrid_fp16(nonfinite):
    t = parlay.Trainer(_build, _data(), torch.optim.SGD, {"lr": 0.1}, 4, mode="hybrid",
                       precision="fp16", shuffle=False, scaling_learning_rate=False,
                       num_epochs=1, progress=False, snapshot_every=0, nonfinite=nonfinite,
                       strategy_options={"pp": 2, "chunks": 1, "balance": [2, 1]})
    losses, skipped = [], []
    while not t.should_stop():
        losses.append(t.train_on_batch())
        skipped.append(t.skipped_steps)
    return losses, skipped, t.strategy.scaler.scale


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_hybrid_fp16_half_loss_backs_off_like_gradscaler(nonfinite):
    ref_losses, ref_skipped, ref_scale = _gradscaler_reference()
    assert ref_skipped == [True, True] + [False] * (STEPS - 2)  # the scenario holds
    _, (losses, skipped, scale) = run_world(_hybrid_fp16, 2, nonfinite)
    assert skipped == [1, 2, 2, 2, 2, 2], "two loss-scale overflows, then every step trains"
    assert scale == ref_scale == 16384.0
    # The reported loss is the unscaled one (finite), and training follows GradScaler's.
    assert losses == pytest.approx(ref_losses, rel=5e-3)


# ---------------------------------------------------------------- resume after NonFiniteError
class _NanAt(torch.utils.data.Dataset):
    """22 samples per rank (6 steps of 4 on 2 ranks, unshuffled); sample 31 is NaN: rank 1's
    batch at step 4."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(44, 8, generator=g), torch.randint(0, 3, (44,), generator=g)
        self.x[31] = float("nan")

    def __len__(self):
        return 44

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), nn.CrossEntropyLoss()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _fp16_run(ckpt, nonfinite, precision="fp16", grad_clip=None):
    logs = _Records()
    logging.getLogger("parlay").addHandler(logs)
    try:
        t = parlay.Trainer(_mlp, _NanAt(), torch.optim.SGD, {"lr": 0.1}, 4, shuffle=False,
                           num_epochs=1, checkpoint_dir=ckpt, checkpoint_every=2,
                           progress=False, nonfinite=nonfinite, precision=precision,
                           grad_clip=grad_clip)
        start = t.state.step
        t.train_to_end()
        return start, t.state.step, t.skipped_steps, logs.lines
    except Exception as e:  # noqa: BLE001 - returned to the test, which checks it
        return e
    finally:
        logging.getLogger("parlay").removeHandler(logs)


def test_nonfinite_error_resumes_with_skip_and_grad_clip(tmp_path):
    ckpt = str(tmp_path)
    first = run_world(_fp16_run, 2, ckpt, "raise")
    assert all(isinstance(e, NonFiniteError) and e.step == 4 for e in first)
    assert "a restart on the same checkpoint_dir resumes with either" in str(first[0])
    # Another precision still needs a fresh checkpoint_dir, and says which settings may change.
    refused = run_world(_fp16_run, 2, ckpt, "raise", "fp32")
    assert "a resume may change only grad_clip and nonfinite" in str(refused[0])
    resumed = run_world(_fp16_run, 2, ckpt, "skip", "fp16", 1.0)
    for start, end, skipped, lines in resumed:
        assert (start, end, skipped) == (2, 6, 1), "continued from step 2, skipping the NaN"
        assert any("changed settings" in m and "nonfinite: 'raise' then, 'skip' now" in m
                   and "grad_clip: None then, 1 now" in m for m in lines), lines
