"""DistributedOptimizer(shard=...) on real gloo ranks against single-process training on the
concatenated batch: every level, optimizer, parameter group, accumulation mode and clipping;
averages (never sums); the memory each rank holds; compression; ZeRO-3 forward in eval; a rank
lost mid-step. float64 models: only summation order differs from the oracle."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay
from parlay.errors import CommError, ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(90)

TOL = dict(rtol=1e-10, atol=1e-10)
LEVELS = ("optimizer", "gradients", "parameters")
STEPS, MICRO, PER = 3, 2, 3  # steps, micro-batches per step, samples per micro-batch and rank
TINY = 0.0002                 # bucket_cap_mb: several units per model


class _Edge(nn.Module):
    """An unused branch, a unit (``s``: 2 elements) smaller than the world, and a module
    (``t``) whose weight is tied to the unused branch's (it belongs to that module's unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.unused = nn.Linear(5, 6), nn.Linear(6, 6)
        self.tiny, self.s, self.b = nn.Linear(6, 1), nn.Linear(1, 1), nn.Linear(1, 3)
        self.t = nn.Linear(6, 6)
        self.t.weight = self.unused.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.t(torch.tanh(self.a(x))))
        return self.b(torch.tanh(self.s(torch.tanh(self.tiny(h)))))


def _model(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    if kind == "edge":
        return _Edge().double()
    if kind == "big":
        return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).double()
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """``sgd``/``adam``; ``*_groups``: weights decay, biases do not and step at another lr."""
    cls, kw = (torch.optim.SGD, dict(lr=0.1, momentum=0.9)) if name.startswith("sgd") else \
        (torch.optim.Adam, dict(lr=0.01))
    if not name.endswith("_groups"):
        return cls(model.parameters(), **kw)
    named = list(model.named_parameters())
    return cls([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.05},
                {"params": [p for n, p in named if n.endswith("bias")], "lr": kw["lr"] / 3}],
               **kw)


def _data(world: int, features: int = 5, outs: int = 3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, MICRO, world, PER, features, generator=g, dtype=torch.float64)
    return x, torch.sin(x[..., :outs] * 2)


def _scale(r: int, spread: bool) -> float:
    return 1.0 + 30.0 * r if spread else 1.0


def _reference(world: int, opt: str = "sgd", *, kind: str = "mlp", spread: bool = False,
               sum_op: bool = False, clip: float | None = None):
    """Single process: per step the mean over every rank's and micro-batch's loss (times the
    world for Sum); parameters without a gradient get zeros, as the wrapper gives them."""
    model = _model(kind)
    o = _optimizer(opt, model)
    x, y = _data(world)
    norms = []
    for s in range(STEPS):
        o.zero_grad()
        loss = sum(_scale(r, spread) * F.mse_loss(model(x[s, m, r]), y[s, m, r])
                   for r in range(world) for m in range(MICRO))
        (loss / MICRO / (1 if sum_op else world)).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        o.step()
    return model, [p.detach().clone() for p in model.parameters()], norms


def _same(got, ref, what, **tol) -> None:
    assert len(got) == len(ref)
    for p, q in zip(got, ref):
        torch.testing.assert_close(p, q, **(tol or TOL), msg=lambda m: f"{what}: {m}")


def _full(opt) -> list[torch.Tensor]:
    with opt.gathered_parameters():
        return [p.detach().clone() for p in opt._model_params]


def _train(level: str, opt: str = "sgd", *, kind: str = "mlp", how: str = "plain",
           spread: bool = False, sum_op: bool = False, clip: float | None = None,
           compression: str | None = None):
    """One rank's training; ``how``: "plain" (one pass of both micro-batches), "inner_zero"
    (the same, zeroing through the wrapped optimizer), "passes" (backward_passes_per_step),
    "no_sync" (the first micro-batch inside no_sync()), "no_sync_all" (every one inside:
    step() reduces)."""
    r, world = parlay.rank(), parlay.size()
    model = _model(kind)
    o = parlay.DistributedOptimizer(
        _optimizer(opt, model), named_parameters=model.named_parameters(), bucket_cap_mb=TINY,
        shard=level, model=model, op=parlay.Sum if sum_op else parlay.Average,
        backward_passes_per_step=MICRO if how == "passes" else 1, compression=compression)
    o._model_params = list(model.parameters())
    x, y = _data(world)
    norms = []
    for s in range(STEPS):
        (o.optimizer if how == "inner_zero" else o).zero_grad()
        losses = [_scale(r, spread) * F.mse_loss(model(x[s, m, r]), y[s, m, r])
                  for m in range(MICRO)] if how in ("plain", "inner_zero") else None
        if losses is not None:
            (sum(losses) / MICRO).backward()
        for m in range(MICRO if losses is None else 0):
            loss = _scale(r, spread) * F.mse_loss(model(x[s, m, r]), y[s, m, r])
            if how == "no_sync_all" or (how == "no_sync" and m < MICRO - 1):
                with o.no_sync():
                    (loss / MICRO).backward()
            else:
                (loss if how == "passes" else loss / MICRO).backward()
        if clip is None:
            o.step()
            continue
        o.synchronize()
        norms.append(o.clip_grad_norm_(clip))
        with o.skip_synchronize():
            o.step()
    return model, o, norms


# ------------------------------------------------------------------- exactness
def _levels(opts):
    """Every level and optimizer; for "parameters" also the model's eval forward."""
    out = []
    x = _data(parlay.size())[0][0, 0].reshape(-1, 5)
    for opt in opts:
        for level in LEVELS:
            model, o, _ = _train(level, opt)
            with torch.no_grad():
                model.eval()
                pred = model(x)
            held = sum(p.numel() for p in model.parameters())
            out.append(((opt, level), _full(o), pred, held, len(o.plan.buckets)))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_level_equals_single_process(world):
    opts = ("sgd", "adam", "sgd_groups", "adam_groups")
    refs = {opt: _reference(world, opt) for opt in opts}
    x = _data(world)[0][0, 0].reshape(-1, 5)
    for rank_out in run_world(_levels, world, opts):
        for (opt, level), params, pred, held, units in rank_out:
            model, ref, _ = refs[opt]
            assert units > 2, "the test needs several units"
            _same(params, ref, (opt, level))
            with torch.no_grad():
                torch.testing.assert_close(pred, model.eval()(x), **TOL)
            if level == "parameters":
                assert held == 0  # the eval forward freed what it gathered


# ------------------------------------------------------------------- averages, accumulation
def _modes():
    out = {}
    for level in LEVELS:
        for how in ("passes", "no_sync", "no_sync_all"):
            out[level, how] = _full(_train(level, "adam", how=how)[1])
        out[level, "spread"] = _full(_train(level, spread=True)[1])
        out[level, "inner_zero"] = _full(_train(level, "adam", how="inner_zero")[1])
        out[level, "sum"] = _full(_train(level, sum_op=True)[1])
        _, o, norms = _train(level, "sgd_groups", how="no_sync", clip=0.05)
        out[level, "clip"] = _full(o), norms
    return out


def test_averages_accumulation_and_clipping_equal_single_process():
    world = 2
    adam = _reference(world, "adam")[1]
    spread = _reference(world, spread=True)[1]
    summed = _reference(world, sum_op=True)[1]
    _, clipped, norms = _reference(world, "sgd_groups", clip=0.05)
    assert all(float(n) > 0.05 for n in norms), "clipping must really happen"
    for out in run_world(_modes, world):
        for level in LEVELS:
            for key, ref in (("passes", adam), ("no_sync", adam), ("no_sync_all", adam),
                             ("inner_zero", adam), ("spread", spread),
                             ("sum", summed)):
                _same(out[level, key], ref, (level, key))
            params, got = out[level, "clip"]
            _same(params, clipped, (level, "clip"))
            torch.testing.assert_close(torch.stack(got), torch.stack(norms), **TOL)


# ------------------------------------------------------------------- edge cases
def _edges():
    out = {}
    for level in LEVELS:
        _, o, _ = _train(level, "adam_groups", kind="edge")
        out[level] = _full(o)
        # zero_grad(set_to_none=False), then a step without backward: zero gradients.
        model = _model("edge")
        o = parlay.DistributedOptimizer(_optimizer("sgd", model), model.named_parameters(),
                                        shard=level, model=model, bucket_cap_mb=TINY)
        o._model_params = list(model.parameters())
        x, y = _data(parlay.size())
        F.mse_loss(model(x[0, 0, parlay.rank()]), y[0, 0, parlay.rank()]).backward()
        o.step()
        o.step()  # no backward in between: gradients do not carry over, this steps zeros
        o.zero_grad(set_to_none=False)
        F.mse_loss(model(x[1, 0, parlay.rank()]), y[1, 0, parlay.rank()]).backward()
        o.step()
        o.zero_grad(set_to_none=False)
        o.step()  # zeroed: only momentum moves the parameters
        out[level, "twice"] = _full(o)
    return out


def test_unused_branch_tiny_unit_zero_grad_and_repeated_step():
    world = 4
    ref = _reference(world, "adam_groups", kind="edge")[1]
    model = _model("edge")
    o = _optimizer("sgd", model)
    x, y = _data(world)
    for s in range(2):
        o.zero_grad(set_to_none=False)
        F.mse_loss(model(x[s, 0].reshape(-1, 5)), y[s, 0].reshape(-1, 3)).backward()
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        o.step()
        o.zero_grad(set_to_none=False)
        o.step()  # what the wrapper's step without backward does: zero gradients
    twice = [p.detach() for p in model.parameters()]
    for out in run_world(_edges, world):
        for level in LEVELS:
            _same(out[level], ref, level)
            _same(out[level, "twice"], twice, (level, "twice"))


# ------------------------------------------------------------------- memory
def _memory():
    out = {}
    x = torch.randn(4, 256, dtype=torch.float64)
    for level in LEVELS:
        model = _model("big")
        o = parlay.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        model.named_parameters(), shard=level, model=model)
        F.mse_loss(model(x), x).backward()
        o.step()
        state = sum(t.numel() for s in o.optimizer.state.values() for t in s.values()
                    if t.dim() > 0)
        grads = sum(g.numel() for g in o.local_gradients())
        grads += sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
        held = sum(p.numel() for p in model.parameters()) + \
            sum(p.numel() for g in o.param_groups for p in g["params"])
        out[level] = state, grads, held
    return out


def test_each_rank_holds_its_share():
    world = 4
    total = sum(p.numel() for p in _model("big").parameters())
    share = total / world * 1.1
    for out in run_world(_memory, world):
        for level in LEVELS:
            state, grads, held = out[level]
            assert state <= 2 * share, (level, state)  # Adam: exp_avg and exp_avg_sq
            if level != "optimizer":
                assert grads <= share, (level, grads)
            if level == "parameters":
                assert held <= share, (level, held)


# ------------------------------------------------------------------- compression, config
def _compressed():
    out = {}
    for comp in ("fp16", "bf16"):
        for level in LEVELS:
            out[comp, level] = _full(_train(level, compression=comp)[1])
    model = _model()
    errors = []
    for kw in (dict(shard="optimizer", compression="topk:0.01"), dict(shard="zero3"),
               dict(shard="parameters")):
        with pytest.raises(ConfigError) as e:
            parlay.DistributedOptimizer(_optimizer("sgd", model), model.named_parameters(), **kw)
        errors.append(str(e.value))
    return out, errors


def test_compression_and_bad_configurations():
    ref = _reference(2)[1]
    for out, errors in run_world(_compressed, 2):
        for (comp, level), params in out.items():
            tol = 1e-3 if comp == "fp16" else 1e-2
            _same(params, ref, (comp, level), rtol=tol, atol=tol)
        assert all("shard" in e for e in errors), errors
        assert "element-wise" in errors[0] and "model=" in errors[2]


# ------------------------------------------------------------------- a lost rank
def _dies():
    model = _model()
    o = parlay.DistributedOptimizer(_optimizer("sgd", model), model.named_parameters(),
                                     shard="parameters", model=model, bucket_cap_mb=TINY)
    x, y = _data(2)
    for s in range(STEPS):
        if s == 1 and parlay.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        o.zero_grad()
        F.mse_loss(model(x[s, 0, parlay.rank()]), y[s, 0, parlay.rank()]).backward()
        o.step()


def test_a_lost_rank_is_an_error_not_a_hang():
    out = run_world(_dies, 2, return_exceptions=True, timeout=40, comm_timeout=10)
    assert isinstance(out[0], CommError), out[0]


# ------------------------------------------------------------------- DCP form, resharded
def _dcp_whole(level, path, save):
    """Train 3 steps and save (``save``), or load; each unit's parameter and Adam state
    chunks of this rank, with the chunk it holds."""
    import torch.distributed.checkpoint as dcp
    from parlay.dp.shard_dcp import dcp_state_dict, load_dcp
    m = _model()
    opt = parlay.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                      named_parameters=m.named_parameters(), shard=level,
                                      model=m, bucket_cap_mb=0.0005)
    if save:
        x, y = _data(parlay.size())
        for s in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(m(x[s, 0, parlay.rank()]), y[s, 0, parlay.rank()]).backward()
            opt.step()
        dcp.save(dcp_state_dict(opt), checkpoint_id=path)
    else:
        load_dcp(opt, path)
    eng = opt.shard_engine
    state = [{k: v.clone() for k, v in opt.optimizer.state[c].items()} for c in eng.shards]
    return [c.detach().clone() for c in eng.shards], state, [b.numel for b in eng.plan.buckets]


def _joined(per_rank):
    def rechunk(parts, numel, *_):
        return torch.cat(parts)[:numel]
    units = per_rank[0][2]
    out = []
    for u, numel in enumerate(units):
        out.append(rechunk([r[0][u] for r in per_rank], numel, 1, 0))
        for name, v in sorted(per_rank[0][1][u].items()):
            out.append(rechunk([r[1][u][name] for r in per_rank], numel, 1, 0) if v.dim()
                       else v)
    return out


@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_dcp_form_reloads_exactly_at_other_world_sizes(tmp_path, level):
    saved = _joined(run_world(_dcp_whole, 2, level, str(tmp_path), True))
    for world in (4, 3):
        got = _joined(run_world(_dcp_whole, world, level, str(tmp_path), False))
        assert len(got) == len(saved)
        assert all(torch.equal(a, b) for a, b in zip(saved, got)), world
