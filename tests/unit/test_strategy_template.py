"""The shared step template of the Trainer's strategies (``parlay.strategies.template``).

The one fp16 loss scaler must be GradScaler's recipe step for step (same scales, same skipped
steps, bitwise the same weights), must read the checkpoints either form wrote, and the
precision, clip and optimizer checks must speak to the user. Registration stays lazy: asking
for one mode imports only its adapter.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from parlay.errors import ConfigError
from parlay.strategies import get_strategy
from parlay.strategies.template import (LossScaler, autocast_context, build_optimizer,
                                        check_grad_clip, check_precision, to_device)

pytestmark = pytest.mark.timeout(60)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def test_loss_scaler_follows_grad_scaler_bitwise() -> None:
    # A 2**40 scale overflows fp16 at first, halves until it fits, then grows every 3 clean
    # steps and overflows again: both recipes must take exactly the same steps.
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 2
    a, b = _model(), _model()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=3)
    ours = LossScaler(2.0 ** 40, growth_interval=3, agree=False)
    skipped_a, skipped_b = [], []
    for _ in range(40):
        opt_a.zero_grad()
        opt_b.zero_grad()
        with autocast_context("fp16", torch.device("cpu")):
            loss_a = nn.functional.cross_entropy(a(x), y)
        torch_scaler.scale(loss_a).backward()
        torch_scaler.unscale_(opt_a)
        before = torch_scaler.get_scale()
        torch_scaler.step(opt_a)
        torch_scaler.update()
        skipped_a.append(torch_scaler.get_scale() < before)
        with autocast_context("fp16", torch.device("cpu")):
            loss_b = nn.functional.cross_entropy(b(x), y)
        ours.scale_loss(loss_b).backward()
        skip = ours.unscale_([p.grad for p in b.parameters()])
        if not skip:
            opt_b.step()
        ours.update(skip)
        skipped_b.append(skip)
        assert ours.scale == torch_scaler.get_scale()
    assert skipped_a == skipped_b
    assert any(skipped_b) and not all(skipped_b)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_loss_scaler_policy_and_state() -> None:
    s = LossScaler(8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0 and s.growth_tracker == 0
    s.update(False)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 8.0, "growth_tracker": 1,
                                                "growth_interval": 2}
    # Checkpoints written by the earlier scalers (GradScaler's and the pipeline's own).
    t.load_state_dict({"scale": 2.0 ** 10, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000, "_growth_tracker": 7})
    assert (t.scale, t.growth_tracker, t.growth_interval) == (1024.0, 7, 2000)
    t.load_state_dict({"scale": 64.0, "clean": 3})
    assert (t.scale, t.growth_tracker) == (64.0, 3)


def test_loss_scaler_unscales_only_finite_steps() -> None:
    s = LossScaler(4.0)
    g = [torch.full((3,), 8.0), torch.full((2,), 4.0)]
    assert not s.unscale_(g)
    assert g[0].tolist() == [2.0] * 3 and g[1].tolist() == [1.0] * 2
    bad = [torch.ones(2), torch.tensor([1.0, float("inf")])]
    assert s.unscale_(bad) and bad[0].tolist() == [1.0, 1.0]   # left alone: the step is skipped
    with pytest.raises(ConfigError, match="loss_scale must be a positive finite number"):
        LossScaler(0.0)
    from parlay.strategies.allreduce import AllreduceStrategy  # accepted, and did nothing
    with pytest.raises(ConfigError, match=r"precision 'fp32' scales no loss.*precision='fp16'"):
        AllreduceStrategy(loss_scale=1024.0)


def test_checks_speak_to_the_user() -> None:
    assert check_precision("bf16") == "bf16"
    with pytest.raises(ConfigError, match=r"precision must be one of \['bf16', 'fp16', 'fp32'\]"):
        check_precision("fp8")
    with pytest.raises(ConfigError, match="mode 'ps' supports precision 'fp32' or 'bf16', got "
                                          "'fp16'"):
        check_precision("fp16", "ps", supported=("fp32", "bf16"))
    assert check_grad_clip(None) is None and check_grad_clip(1) == 1
    with pytest.raises(ConfigError, match="grad_clip must be a positive number"):
        check_grad_clip(0)
    with pytest.raises(ConfigError, match=r"could not build SGD with optimizer_args=\{'lrr'"):
        build_optimizer(torch.optim.SGD, _model().parameters(), {"lrr": 0.1})
    batch = {"x": torch.ones(2), "y": [torch.zeros(1), 3]}
    moved = to_device(batch, torch.device("cpu"))
    assert torch.equal(moved["x"], batch["x"]) and moved["y"][1] == 3


def test_every_mode_checks_precision_alike() -> None:
    for mode in ("allreduce", "hybrid", "ps", "diloco"):
        with pytest.raises(ConfigError, match="precision must be one of"):
            get_strategy(mode, precision="fp8")
    with pytest.raises(ConfigError, match="mode 'ps' supports precision"):
        get_strategy("ps", precision="fp16")
    assert get_strategy("ps", precision="bf16").precision == "bf16"
    assert get_strategy("allreduce", precision="fp16", loss_scale=2.0 ** 8).scaler.scale == 256.0
    assert get_strategy("hybrid", precision="fp32").scaler is None


def test_asking_for_one_mode_imports_only_its_adapter() -> None:
    code = ("import sys; from parlay.strategies import get_strategy; get_strategy('allreduce'); "
            "print(sorted(m for m in sys.modules if m.startswith('parlay.strategies.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, check=True).stdout.strip()
    assert out == "['parlay.strategies.allreduce', 'parlay.strategies.base', " \
                  "'parlay.strategies.template']", out


def test_micro_batches_cut_each_tensor_once_and_lists_of_plain_values_too() -> None:
    # Each part re-split every tensor (k views made k times: 198 s for k=4096); a list of
    # strings (the default collate's) went whole into every part beside its split targets.
    import time

    from parlay.strategies.template import micro_batches

    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    parts = micro_batches(((x, ["a", "b", "c", "d", "e"], torch.ones(3)), y), 5, 2)
    assert [p[0][1] for p in parts] == [["a", "b", "c"], ["d", "e"]]
    assert [p[0][0].tolist() for p in parts] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]
    assert all(p[0][2].shape == (3,) for p in parts)  # not n rows: whole into every part
    t = torch.zeros(4096, 2)
    t0 = time.process_time()
    assert len(micro_batches(t, 4096, 4096)) == 4096
    assert time.process_time() - t0 < 20  # linear: well under a second (quadratic: minutes)
