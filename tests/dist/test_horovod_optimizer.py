"""Horovod's DistributedOptimizer, optimizer-state broadcast and SyncBatchNorm on parlay,
against single-process training (float64, so only summation order differs: tolerance 1e-10),
and the Horovod-style example through the real launcher."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, PER = 3, 4
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _data(world: int, passes: int = 1):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, world, passes, PER, 5, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).repeat(1, 1, 1, 1, 2).sin()


def _train(passes: int, average_aggregated: bool):
    import parlay.horovod as hvd

    r, world = hvd.rank(), hvd.size()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Horovod's positional order: optimizer, named_parameters, compression, passes, op.
    opt = hvd.DistributedOptimizer(opt, model.named_parameters(), hvd.Compression.none, passes,
                                   hvd.Average, average_aggregated_gradients=average_aggregated)
    x, y = _data(world, passes)
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            F.mse_loss(model(x[s, r, k]), y[s, r, k]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _reference(world: int, passes: int, divide: bool):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(world, passes)
    for s in range(STEPS):
        opt.zero_grad()
        # Mean over ranks of each pass, summed over passes (Horovod), or averaged (parlay).
        loss = sum(F.mse_loss(model(x[s, :, k].reshape(-1, 5)), y[s, :, k].reshape(-1, 2))
                   for k in range(passes))
        (loss / passes if divide else loss).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("passes,average_aggregated", [(1, True), (2, False)])
def test_horovod_signature_equals_single_process(passes, average_aggregated):
    ref = _reference(2, passes, divide=average_aggregated)
    for params in run_world(_train, 2, passes, average_aggregated):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, **TOL)


class _Branchy(nn.Module):
    """``_model()`` plus two heads of one shape: rank 0 uses ``b``, rank 1 ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.b, self.c = nn.Linear(5, 2).double(), nn.Linear(5, 2).double()

    def forward(self, x: torch.Tensor, r: int) -> torch.Tensor:
        return self.body(x) + (self.b if r == 0 else self.c)(x)


def _adasum_train(none, passes):
    import parlay.horovod as hvd
    from parlay.errors import ConfigError

    r = hvd.rank()
    model = _Branchy()
    # Horovod's pytorch_mnist --use-adasum passes compression=hvd.Compression.none with it
    extra = {"compression": hvd.Compression.none} if none else {}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=passes, **extra)
    x, y = _data(2, passes)
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            F.mse_loss(model(x[s, r, k], r), y[s, r, k]).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with pytest.raises(ConfigError, match="more than backward_passes_per_step"):
        for _ in range(passes + 1):   # one pass too many: raised, as under Average
            F.mse_loss(model(x[0, r, 0], r), y[0, r, 0]).backward()
    return params


def _adasum_amp(unscale_by_parlay):
    import parlay.horovod as hvd

    r = hvd.rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for s in range(3):
        x = torch.ones(8, 4)
        if r == 1 and s == 1:
            x[0, 0] = float("inf")  # an overflow on rank 1 only
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        opt.synchronize()  # Horovod's AMP recipe
        opt.unscale_(scaler) if unscale_by_parlay else scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("unscale_by_parlay", [False, True])
def test_adasum_with_grad_scaler_skips_an_overflow_on_every_rank(unscale_by_parlay):
    # Adasum reduces updates, so each rank's scaler saw only its own gradients: rank 0 stepped
    # into the Adasum while rank 1 skipped, and waited there until the timeout.
    (s0, w0), (s1, w1) = run_world(_adasum_amp, 2, unscale_by_parlay, comm_timeout=20)
    for p, q in zip(w0, w1):
        assert torch.equal(p, q)
    # Each scaler backs off on its own overflows; opt.unscale_(scaler) agrees them as well.
    assert (s0, s1) == ((512.0, 512.0) if unscale_by_parlay else (1024.0, 512.0))


@pytest.mark.parametrize("none,passes", [(False, 1), (True, 2)])
def test_adasum_optimizer_combines_each_ranks_update(none, passes):
    # Each parameter's update is combined with the same parameter's on the other rank (one
    # whose branch it did not use: a zero update), after averaging the rank's k passes.
    from parlay.horovod.execute import adasum

    model = _Branchy()
    x, y = _data(2, passes)
    for s in range(STEPS):
        deltas = []
        for r in range(2):
            model.zero_grad()
            for k in range(passes):
                F.mse_loss(model(x[s, r, k], r), y[s, r, k]).backward()
            deltas.append([torch.zeros_like(p) if p.grad is None else -0.1 * p.grad / passes
                           for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(adasum([deltas[0][i], deltas[1][i]]))
    for params in run_world(_adasum_train, 2, none, passes):
        for p, q in zip(params, model.parameters()):
            torch.testing.assert_close(p, q.detach(), **TOL)


def test_argument_checks_without_a_group():
    import parlay.horovod as hvd
    from parlay.errors import ConfigError
    from parlay.horovod.optimizer import _adapt_compression, _check_groups

    with pytest.raises(ConfigError, match="pass op= by keyword"):
        _adapt_compression(hvd.Sum)
    with pytest.raises(ValueError, match="only appear once"):
        w = torch.zeros(1)
        _check_groups([[w], [w]], 0)
    assert _check_groups(None, 3) == 3


def _process_set_training():
    import parlay.horovod as hvd

    r = hvd.rank()
    pair = hvd.add_process_set([0, 1])
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=pair)
    names = set(opt._parameter_names.values())
    x, y = _data(3)
    for s in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[s, r, 0]), y[s, r, 0]).backward()
        opt.step()
    hvd.remove_process_set(pair)
    return [p.detach() for p in model.parameters()], names


def test_process_set_members_average_and_others_train_alone():
    outs = run_world(_process_set_training, 3)
    x, y = _data(3)
    for ranks, got in (([0, 1], outs[0][0]), ([0, 1], outs[1][0]), ([2], outs[2][0])):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[s, ranks, 0].reshape(-1, 5)), y[s, ranks, 0].reshape(-1, 2)).backward()
            opt.step()
        for p, q in zip(got, model.parameters()):
            torch.testing.assert_close(p, q.detach(), **TOL)
    assert outs[0][1] == {"0.weight", "0.bias", "2.weight", "2.bias"}


IDS = [[[1, 2, 4], [4, 3, 9]], [[1, 7, 7], [0, 5, 5]]]


def _sparse(sparse_as_dense: bool):
    import parlay.horovod as hvd

    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   sparse_as_dense=sparse_as_dense)
    for _ in range(STEPS):
        opt.zero_grad()
        (emb(torch.tensor(IDS[hvd.rank()])) ** 2).sum().backward()
        opt.step()
    return emb.weight.detach()


def test_sparse_gradients_come_back_sparse_for_sparse_adam():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        (sum((emb(torch.tensor(ids)) ** 2).sum() for ids in IDS) / 2).backward()
        opt.step()
    for sparse_as_dense in (False, True):
        for w in run_world(_sparse, 2, sparse_as_dense):
            torch.testing.assert_close(w, emb.weight.detach(), **TOL)


def _optimizer_states():
    import parlay.horovod as hvd

    r = hvd.rank()
    states = {}
    classes = sorted((c for c in torch.optim.Optimizer.__subclasses__()
                      if c.__module__.startswith("torch.optim")), key=lambda c: c.__name__)
    for cls in classes:
        torch.manual_seed(r)          # different weights and hyper-parameters on each rank
        if cls is torch.optim.SparseAdam:
            model = nn.Embedding(6, 2, sparse=True)
        else:
            model = nn.Linear(4, 3, bias=False)   # 2-D only: Muon accepts nothing else
        opt = cls(model.parameters(), lr=0.01 * (r + 1))

        def closure(opt=opt, model=model, cls=cls):
            opt.zero_grad()
            out = model(torch.tensor([1, 2])) if cls is torch.optim.SparseAdam else \
                model(torch.randn(2, 4))
            loss = out.pow(2).sum()
            loss.backward()
            return loss
        opt.step(closure)
        hvd.broadcast_optimizer_state(opt, root_rank=1)
        states[cls.__name__] = opt.state_dict()
    return states


def test_broadcast_optimizer_state_covers_every_torch_optimizer():
    outs = run_world(_optimizer_states, 2)
    assert "Muon" in outs[0] and "LBFGS" in outs[0] and "SparseAdam" in outs[0]
    for name, root_state in outs[1].items():
        _assert_same(outs[0][name], root_state, name)


def _assert_same(a, b, where):
    assert type(a) is type(b), where
    if isinstance(b, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    elif isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in b:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _bn_inputs():
    """Per-rank inputs (2 ranks x 6 samples) and output weights, identical on every rank."""
    g = torch.Generator().manual_seed(5)
    return (torch.randn(2, 6, 4, 3, generator=g, dtype=torch.float64),
            torch.randn(2, 6, 4, 3, generator=g, dtype=torch.float64))


def _bn_weights(bn):
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(6))
    return bn


def _sync_bn():
    import parlay.horovod as hvd

    r = hvd.rank()
    x, w = _bn_inputs()
    bn = _bn_weights(hvd.SyncBatchNorm(4).double())
    xi = x[r].clone().requires_grad_()
    y = bn(xi)
    (y * w[r]).sum().backward()
    wgrad = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
    return y.detach(), xi.grad, wgrad, bn.running_mean, bn.running_var


def test_sync_batch_norm_equals_batch_norm_over_the_whole_batch():
    outs = run_world(_sync_bn, 2)
    x, w = _bn_inputs()
    bn = _bn_weights(nn.BatchNorm1d(4).double())
    xs = x.reshape(12, 4, 3).clone().requires_grad_()
    y = bn(xs)
    (y * w.reshape(12, 4, 3)).sum().backward()
    for r, (yr, xg, wg, rm, rv) in enumerate(outs):
        torch.testing.assert_close(yr, y.detach()[6 * r: 6 * r + 6], **TOL)
        torch.testing.assert_close(xg, xs.grad[6 * r: 6 * r + 6], **TOL)
        torch.testing.assert_close(wg, bn.weight.grad, **TOL)
        torch.testing.assert_close(rm, bn.running_mean, **TOL)
        torch.testing.assert_close(rv, bn.running_var, **TOL)


def test_horovod_style_example_runs_under_parlay_run():
    proc = subprocess.run([sys.executable, "-m", "parlay.cli", "run", "-n", "2",
                           "examples/horovod_style.py", "--steps", "12"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, proc.stdout
    assert "2 ranks hold the same weights" in proc.stdout


def _horovod_habits():
    import parlay
    import parlay.horovod as hvd

    out = {}

    class Doubled(hvd.compression.Compressor):      # Horovod's base of custom compressors
        @staticmethod
        def compress(tensor):
            return tensor * 2.0, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 2.0

    class Halved(hvd.Compression.none):             # ... or its NoneCompressor
        @staticmethod
        def compress(tensor):
            return tensor / 2.0, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor * 2.0

    for comp in (Doubled, Halved):
        torch.manual_seed(0)
        m = nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                       m.named_parameters(), compression=comp)
        m(torch.full((1, 2), float(hvd.rank() + 1))).sum().backward()
        opt.step()
        out[comp.__name__] = m.weight.grad.clone()
    m = nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters())
    m(torch.ones(1, 2)).sum().backward()
    for name, call in (("zero_grad", opt.zero_grad), ("adasum", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Adasum,
            gradient_predivide_factor=2.0))):
        try:
            call()
        except parlay.ConfigError as e:
            out[name] = str(e)
    return out


def test_horovod_habits_custom_compressors_and_refusals():
    # A subclass of hvd.Compression.none with Horovod's static compress(tensor) failed in
    # backward with a TypeError; hvd.compression.Compressor did not exist; zero_grad between
    # backward and step warned and then stepped the gradients it had zeroed; Adasum ignored
    # gradient_predivide_factor (Horovod refuses both).
    for out in run_world(_horovod_habits, 2):
        for name in ("Doubled", "Halved"):
            torch.testing.assert_close(out[name], torch.full((1, 2), 1.5))  # mean of 1 and 2
        assert "zero_grad() was called after loss.backward()" in out["zero_grad"]
        assert "not op=Adasum" in out["adasum"]
