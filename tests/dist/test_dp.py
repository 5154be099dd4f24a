"""DistributedOptimizer on real gloo ranks against single-process training."""
from __future__ import annotations

import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

import parlay
from parlay.testing import WorldError, run_world

pytestmark = pytest.mark.timeout(120)

# float64 everywhere: the only difference from the oracle is summation order, so a tight
# tolerance (1e-10) states exactly what equivalence means here.
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, PER_RANK = 4, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _data(world: int, steps: int = STEPS, per_rank: int = PER_RANK):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, world * per_rank, 5, generator=g, dtype=torch.float64)
    y = torch.randn(steps, world * per_rank, 3, generator=g, dtype=torch.float64)
    return x, y


def _make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _reference(opt_name: str, world: int, loss_scale: float = 1.0):
    model = _model()
    opt = _make_opt(opt_name, model.parameters())
    x, y = _data(world)
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[s]), y[s]) * loss_scale
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _train(opt_name: str, op_name: str = "Average", bucket_cap_mb: float = 25):
    world, r = parlay.size(), parlay.rank()
    model = _model()
    opt = parlay.DistributedOptimizer(_make_opt(opt_name, model.parameters()),
                                      named_parameters=model.named_parameters(),
                                      op=getattr(parlay, op_name), bucket_cap_mb=bucket_cap_mb)
    x, y = _data(world)
    sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[s][sl]), y[s][sl])
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_average_equals_single_process(world, opt_name):
    # Tiny buckets (several per model) exercise in-order launching across buckets.
    out = run_world(_train, world, opt_name, "Average", 0.0005)
    ref = _reference(opt_name, world)
    for rank_params in out:
        for p, q in zip(rank_params, ref):
            torch.testing.assert_close(p, q, **TOL)


def test_sum_equals_world_times_mean_loss():
    # Sum of per-rank mean losses == world * mean over the full batch.
    out = run_world(_train, 2, "sgd", "Sum")
    ref = _reference("sgd", 2, loss_scale=2.0)
    for p, q in zip(out[0], ref):
        torch.testing.assert_close(p, q, **TOL)


def _accumulate():
    world, r = parlay.size(), parlay.rank()
    model = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      backward_passes_per_step=2)
    x, y = _data(world, per_rank=2 * PER_RANK)
    base = r * 2 * PER_RANK
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(2):
            sl = slice(base + k * PER_RANK, base + (k + 1) * PER_RANK)
            nn.functional.mse_loss(model(x[s][sl]), y[s][sl]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_backward_passes_per_step_equals_doubled_batch():
    out = run_world(_accumulate, 2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(2, per_rank=2 * PER_RANK)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        opt.step()
    for rank_params in out:
        for p, q in zip(rank_params, model.parameters()):
            torch.testing.assert_close(p, q.detach(), **TOL)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.left = nn.Linear(4, 2)
        self.right = nn.Linear(4, 2)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x, go_left):
        h = self.trunk(x)
        return self.left(h) if go_left else self.right(h)


def _unused_branch():
    model = _Branchy()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      bucket_cap_mb=0.00001)
    for step in range(3):
        opt.zero_grad()
        # Ranks take different branches, and in step 2 both take the same one.
        go_left = (parlay.rank() == 0) if step < 2 else True
        model(torch.ones(2, 4), go_left).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_unused_branch_does_not_hang_and_ranks_agree():
    out = run_world(_unused_branch, 2, timeout=60, comm_timeout=20)
    for p, q in zip(out[0], out[1]):
        torch.testing.assert_close(p, q)


def _mismatch():
    width = 4 if parlay.rank() == 0 else 5
    model = nn.Sequential(nn.Linear(3, width), nn.Linear(width, 1))
    parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters())


def test_parameter_mismatch_raises_config_error_on_every_rank():
    out = run_world(_mismatch, 2, return_exceptions=True)
    for e in out:
        assert isinstance(e, parlay.ConfigError), e
        assert "'0.weight'" in str(e) and "rank 1" in str(e)


def _settings_apart_and_unfrozen() -> list[str]:
    rank = parlay.rank()
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    out = []
    for kwargs in ({"compression": ("topk:0.1", "topk:0.5")[rank]},
                   {"compression": ("fp16", "fp16:1024")[rank]},
                   {"compression": "fp16", "gradient_predivide_factor": 1.0 + rank}):
        try:
            parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **kwargs)
            out.append("")
        except parlay.ConfigError as e:
            out.append(str(e))
    model[0].requires_grad_(False)  # frozen when wrapped, trainable at the step
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    model[0].requires_grad_(True)
    model(torch.randn(2, 3)).sum().backward()
    try:
        opt.step()
        out.append("")
    except parlay.ConfigError as e:
        out.append(str(e))
    return out


def test_settings_apart_and_a_layer_unfrozen_after_wrapping_are_refused_on_every_rank():
    a, b = run_world(_settings_apart_and_unfrozen, 2, comm_timeout=20)
    assert a == b
    topk, fp16, predivide, unfrozen = a
    assert "different settings" in topk and "ratio=0.5" in topk
    assert "different settings" in fp16 and "init_scale=1024" in fp16
    assert "gradient_predivide_factor=2.0" in predivide
    assert "2 parameter(s) frozen when the DistributedOptimizer was built" in unfrozen
    assert "remove_hooks()" in unfrozen and "gathered_parameters()" in unfrozen


def _unfreeze_as_the_hint_says(level, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].requires_grad_(False)
    rank, n = (parlay.rank() if world > 1 else 0), 16 // world

    def wrap(params):
        opt = torch.optim.SGD(params, lr=0.1)
        return parlay.DistributedOptimizer(opt, model.named_parameters(), shard=level,
                                           model=model) if world > 1 else opt
    opt = wrap([p for p in model.parameters() if p.requires_grad])
    for s in range(4):
        if s == 2:
            model[0].requires_grad_(True)
            if world > 1:  # the refusal's hint: remove_hooks(), then wrap a new one
                opt.remove_hooks()
                with opt.gathered_parameters() if level == "parameters" else nullcontext():
                    opt = wrap(model.parameters())
            else:
                opt = wrap(model.parameters())
        g = torch.Generator().manual_seed(s)
        x, y = (torch.randn(16, k, generator=g, dtype=torch.float64) for k in (6, 3))
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * n:][:n]), y[rank * n:][:n]).backward()
        opt.step()
    with opt.gathered_parameters() if world > 1 else nullcontext():
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("level", [None, "gradients", "parameters"])
def test_unfreezing_by_rewrapping_as_the_hint_says_trains_as_one_process(level):
    want = _unfreeze_as_the_hint_says(level, 1)
    for got in run_world(_unfreeze_as_the_hint_says, 2, level, 2):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _broadcast():
    torch.manual_seed(parlay.rank())  # different init on every rank
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (parlay.rank() + 1))
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    parlay.broadcast_parameters(model.state_dict(), root_rank=1)
    parlay.broadcast_optimizer_state(opt, root_rank=1)
    state = opt.state_dict()
    return ({k: v.clone() for k, v in model.state_dict().items()},
            state["param_groups"][0]["lr"],
            [s["exp_avg"].clone() for s in state["state"].values()])


def test_broadcast_makes_ranks_identical():
    a, b = run_world(_broadcast, 2)
    for k in a[0]:
        torch.testing.assert_close(a[0][k], b[0][k], rtol=0, atol=0)
    assert a[1] == b[1] == pytest.approx(2e-3)
    for x, y in zip(a[2], b[2]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _broadcast_other_shapes():
    model = nn.Linear(4, 8 if parlay.rank() == 0 else 16)  # a per-rank configuration slip
    try:
        parlay.broadcast_parameters(model.state_dict(), root_rank=0)
    except parlay.ConfigError as e:
        return str(e)
    return None


def _other_optimizer_classes():
    model = nn.Linear(3, 2)
    cls = torch.optim.Adam if parlay.rank() == 0 else torch.optim.SGD
    opt = cls(model.parameters(), lr=0.1)
    try:
        parlay.broadcast_optimizer_state(opt, root_rank=0)
    except parlay.ConfigError as e:
        return str(e)
    return None


def test_broadcasting_optimizer_state_between_classes_is_refused_on_every_rank():
    for msg in run_world(_other_optimizer_classes, 2):
        assert msg is not None and "different optimizer classes" in msg


def test_broadcasting_into_other_shapes_is_refused_on_every_rank():
    # gloo takes a smaller message into a larger buffer: without the check rank 1 got a
    # shifted mix of rank 0's values and its own, silently
    for msg in run_world(_broadcast_other_shapes, 2):
        assert msg is not None and "shapes" in msg and "Hint" in msg


def _clip_then_step():
    model = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(parlay.size())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        nn.functional.mse_loss(model(x[0]), y[0]).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with opt.skip_synchronize():
            opt.step()
        clean = len(w)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[1]), y[1]).backward()
        opt.synchronize()
        opt.step()  # misuse: synchronize() then step() without skip_synchronize()
    return clean, [str(m.message) for m in w]


def test_skip_synchronize_and_misuse_warning():
    out = run_world(_clip_then_step, 2)
    clean, msgs = out[0]
    assert clean == 0
    assert any("skip_synchronize" in m for m in msgs)


def _lr_scheduler_and_scaler():
    model = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data(parlay.size())
    for s in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"], opt.optimizer.param_groups[0]["lr"]


def test_works_with_lr_scheduler():
    assert run_world(_lr_scheduler_and_scaler, 2) == [(0.25, 0.25)] * 2


def test_bad_arguments_are_config_errors():
    parlay.init(environ={})
    try:
        m = nn.Linear(2, 2)
        with pytest.raises(parlay.ConfigError, match="backward_passes_per_step"):
            parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                        backward_passes_per_step=0)
        with pytest.raises(parlay.ConfigError, match="not named"):
            parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                        named_parameters=[("w", m.weight)])
        with pytest.raises(parlay.ConfigError, match="torch.optim.Optimizer"):
            parlay.DistributedOptimizer(m)
        with pytest.raises(parlay.ConfigError, match="unknown compression"):
            parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                        compression="zip")
    finally:
        parlay.shutdown()


def test_world_error_type_exported():
    assert issubclass(WorldError, parlay.ParlayError)


def _positional_orders():
    model = _model()
    a = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), parlay.Sum, None, 2)
    a.remove_hooks()  # (a second optimizer over the same parameters is refused otherwise)
    b = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), "fp16", 3, parlay.Sum)
    res = (int(a.op), a.backward_passes_per_step, type(a.compression).__name__,
           int(b.op), b.backward_passes_per_step, type(b.compression).__name__)
    b.remove_hooks()
    return res


def test_positional_arguments_in_parlay_and_horovod_order():
    # parlay's documented order puts op third; Horovod's puts compression third.
    out = run_world(_positional_orders, 2)
    assert out[0] == (int(parlay.Sum), 2, "NoneCompressor", int(parlay.Sum), 3, out[0][5])
    assert out[0][5] != "NoneCompressor"


def _sparse_embedding(use_base: bool, views: bool = True):
    from parlay.dp.optimizer import DistributedOptimizer as Base

    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    cls = Base if use_base else parlay.DistributedOptimizer
    opt = cls(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
              named_parameters=emb.named_parameters(), gradient_as_bucket_view=views)
    idx = torch.tensor([[1, 2], [3, 4]])[parlay.rank()]
    for _ in range(3):
        opt.zero_grad()
        emb(idx).sum().backward()
        opt.step()
    return emb.weight.detach().clone()


@pytest.mark.parametrize("use_base,views", [(True, True), (True, False), (False, True)])
def test_sparse_gradients_with_sparse_adam(use_base, views):
    out = run_world(_sparse_embedding, 2, use_base, views)
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        # Average over 2 ranks of sum-losses == half the sum over the full batch.
        (emb(torch.tensor([1, 2, 3, 4])).sum() / 2).backward()
        opt.step()
    for w in out:
        torch.testing.assert_close(w, emb.weight.detach(), **TOL)


def _two_passes_before_step():
    model = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(parlay.size())
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    try:
        nn.functional.mse_loss(model(x[1]), y[1]).backward()  # a second pass, passes=1
    except parlay.ConfigError as e:
        return str(e)
    return None


def test_a_pass_beyond_backward_passes_per_step_is_refused_not_lost():
    # it used to warn and drop the pass's gradient; Horovod raises too
    for msg in run_world(_two_passes_before_step, 2):
        assert msg is not None and "backward_passes_per_step=1" in msg
        assert "would be lost" in msg and "no_sync()" in msg
