"""DistributedOptimizer with compression on real gloo ranks, against single-process training."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

import parlay
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

PER_RANK, WORLD = 8, 2


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(dtype)


def _data(steps: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, WORLD * PER_RANK, 20, generator=g, dtype=torch.float64)
    teacher = torch.randn(20, 4, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.tanh(x @ teacher).to(dtype)


def _run(model, opt, steps, start=0, rank=None, dtype=torch.float32):
    x, y = _data(max(start + steps, 8), dtype)
    xe, ye = x[:8].reshape(-1, 20), y[:8].reshape(-1, 4)  # fixed evaluation set
    losses = []
    for s in range(start, start + steps):
        sl = slice(None) if rank is None else slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s][sl]), y[s][sl]).backward()
        opt.step()
        with torch.no_grad():
            losses.append(float(nn.functional.mse_loss(model(xe), ye)))
    return losses


def _reference(steps, dtype=torch.float32, lr=0.1, momentum=0.9):
    model = _model(dtype)
    losses = _run(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), steps,
                  dtype=dtype)
    return [p.detach() for p in model.parameters()], losses


def _train(compression, steps, dtype=torch.float32, lr=0.1, momentum=0.9):
    model = _model(dtype)
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                      named_parameters=model.named_parameters(),
                                      compression=compression)
    losses = _run(model, opt, steps, rank=parlay.rank(), dtype=dtype)
    return [p.detach() for p in model.parameters()], losses, opt.comm_stats()


def _resume(compression, before, after, keep_compression_state=True):
    dt = torch.float64
    model = _model(dt)
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      compression=compression)
    _run(model, opt, before, rank=parlay.rank(), dtype=dt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # what a checkpoint reload does
    if not keep_compression_state:
        ckpt["opt"].pop("parlay_compression")
    model2 = _model(dt)
    model2.load_state_dict(ckpt["model"])
    opt2 = parlay.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model2.named_parameters(),
                                       compression=compression)
    opt2.load_state_dict(ckpt["opt"])
    _run(model, opt, after, start=before, rank=parlay.rank(), dtype=dt)
    _run(model2, opt2, after, start=before, rank=parlay.rank(), dtype=dt)
    return ([p.detach() for p in model.parameters()], [p.detach() for p in model2.parameters()],
            sorted(ckpt["opt"].get("parlay_compression", {})))


def test_fp16_training_matches_fp32_within_fp16_rounding():
    steps = 6
    ref, _ = _reference(steps)
    for params, _, stats in run_world(_train, WORLD, parlay.Compression.fp16, steps):
        # fp16 keeps 11 bits (relative 2**-11 ~ 5e-4 per gradient entry); after 6 SGD steps
        # (lr 0.1, momentum 0.9) that moves weights by ~1e-4 at most; 1e-3 leaves margin while
        # a scale that was not undone or a lost rank would be off by orders of magnitude.
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-3)
        assert stats["wire_bytes"] * 2 == stats["dense_bytes"]


def test_topk_at_full_density_is_exact_through_allgather():
    ref, _ = _reference(4, torch.float64)
    for params, _, _ in run_world(_train, WORLD, "topk:1.0", 4, torch.float64):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec", ["topk:0.05", "randomk:0.1", "powersgd:2"])
def test_compressed_training_with_error_feedback_converges(spec):
    # Plain SGD: with heavy optimizer momentum, random-k's stale residuals oscillate at this
    # learning rate (momentum amplifies delayed coordinates); see parlay.compression's notes.
    steps, lr = 60, 0.2
    _, dense_losses = _reference(steps, lr=lr, momentum=0.0)
    out = run_world(_train, WORLD, spec, steps, torch.float32, lr, 0.0)
    params0, losses, stats = out[0]
    for params, _, _ in out[1:]:  # every rank applied the same update
        for p, q in zip(params, params0):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    # Error feedback delays coordinates but loses none: the loss falls nearly as far as dense.
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < 1.25 * dense_losses[-1] + 0.01, (losses[-1], dense_losses[-1])
    assert stats["ratio"] > 4


@pytest.mark.parametrize("masking", [False, True])
def test_dgc_momentum_correction_at_full_density(masking):
    # Lin et al. (2018): with everything sent and no masking, the compressor's velocity
    # u = m*u + g is exactly the optimizer's momentum buffer, so plain SGD + correction equals
    # SGD(momentum=m). Momentum factor masking clears u wherever a coordinate is sent: at full
    # density that is every coordinate every step, i.e. plain SGD.
    ref, _ = _reference(5, torch.float64, lr=0.1, momentum=0.0 if masking else 0.9)
    spec = f"topk:1.0,momentum=0.9,masking={int(masking)}"
    for params, _, _ in run_world(_train, WORLD, spec, 5, torch.float64, 0.1, 0.0):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)


def test_comm_stats_report_the_real_payload_bytes():
    _, _, stats = run_world(_train, WORLD, "topk:0.01", 2)[0]
    numel = 20 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4  # one bucket
    k = int(0.01 * numel)
    assert stats["dense_bytes_per_step"] == numel * 4
    assert stats["wire_bytes_per_step"] == k * (4 + 4)  # fp32 values + int32 indices


@pytest.mark.parametrize("spec", ["topk:0.1", "powersgd:2"])
def test_residuals_survive_state_dict_round_trip(spec):
    for cont, resumed, keys in run_world(_resume, WORLD, spec, 3, 3):
        assert "residual" in keys
        for p, q in zip(cont, resumed):  # resuming continues the same run, bit for bit
            torch.testing.assert_close(q, p, rtol=0, atol=0)
    # Control: dropping the compression state changes the run, so the check above has teeth.
    cont, resumed, _ = run_world(_resume, WORLD, spec, 3, 3, False)[0]
    assert any(not torch.equal(p, q) for p, q in zip(cont, resumed))


def _layout():
    model = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=parlay.compression.PowerSGD(rank=2))
    n = sum(p.numel() for p in model.parameters())
    plan = opt.compression.plan("bucket0", n)
    return [(m.rows, m.cols) for m in plan.mats], [n for _, n in plan.dense]


def test_powersgd_gets_the_per_tensor_layout_from_the_optimizer():
    mats, dense = run_world(_layout, WORLD)[0]
    # Buckets list parameters last layer first; (4, 32) is too small for rank 2 to pay.
    assert mats == [(32, 32), (32, 20)]
    assert sum(dense) == 4 * 32 + 4 + 32 + 32


def _two_optimizers(shared: bool):
    # A GAN-like pair of models and optimizers; one compressor object given to both, or one each.
    rank = parlay.rank()
    a, b = _model(), _model()
    b[0].weight.data.mul_(-2.0)  # other gradients than a's
    comps = [parlay.compression.TopK(0.1)] * 2 if shared else \
        [parlay.compression.TopK(0.1), parlay.compression.TopK(0.1)]
    opts = [parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=m.named_parameters(), compression=c)
            for m, c in zip((a, b), comps)]
    for m, opt in zip((a, b), opts):
        _run(m, opt, 3, rank=rank)
    return [p.detach().clone() for m in (a, b) for p in m.parameters()]


def test_one_compressor_object_given_to_two_optimizers_keeps_their_state_apart():
    shared, own = run_world(_two_optimizers, WORLD, True), run_world(_two_optimizers, WORLD, False)
    for s, o in zip(shared, own):
        assert all(torch.equal(x, y) for x, y in zip(s, o))


def _load_into_another_compressor() -> list[str]:
    m = nn.Linear(20, 5)
    a = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                    named_parameters=m.named_parameters(), compression="topk:0.1")
    m(torch.randn(4, 20)).sum().backward()
    a.step()
    sd = a.state_dict()
    a.remove_hooks()
    errors = []
    for spec in ("fp16", "none", "topk:0.1"):
        b = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=m.named_parameters(), compression=spec)
        try:
            b.load_state_dict(sd)
        except parlay.ConfigError as e:
            errors.append(str(e))
        b.remove_hooks()
    return errors


def test_another_compressors_state_is_refused_not_dropped():
    # the top-k residual loaded into fp16 (or none) was dropped without a word
    for errors in run_world(_load_into_another_compressor, 2):
        assert len(errors) == 2, errors
        assert all("compression state of TopK(ratio=0.1)" in e for e in errors)
        assert "compresses with FP16()" in errors[0]


def _complex_grads(spec):
    w = nn.Parameter(torch.zeros(8, 6, dtype=torch.complex64))
    g = torch.Generator().manual_seed(5 + parlay.rank())
    target = torch.complex(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))
    opt = parlay.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                      compression=spec)
    own = w.detach().clone().requires_grad_()  # this rank's own gradient, alone
    (own.conj() * target).real.sum().backward()
    try:
        (w.conj() * target).real.sum().backward()
        opt.step()
    except parlay.ConfigError as e:
        return str(e)
    return w.grad.detach().clone(), own.grad


@pytest.mark.parametrize("spec", [None, "fp16", "int8", "topk:1.0", "auto", "powersgd:1"])
def test_complex_gradients_are_averaged_or_refused(spec):
    # a complex bucket skipped the after-sum scaling (it is not "floating point"): summed, not
    # averaged; PowerSGD's real factors dropped the imaginary part
    out = run_world(_complex_grads, 2, spec)
    if spec == "powersgd:1":
        assert all("PowerSGD compresses real gradients" in o for o in out)
        return
    mean = (out[0][1] + out[1][1]) / 2
    for grad, _ in out:
        torch.testing.assert_close(grad, mean, rtol=1e-2, atol=1e-2)
