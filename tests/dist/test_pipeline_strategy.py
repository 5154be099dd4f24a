"""The "hybrid" strategy driven directly (setup + train_step), as the Trainer drives it."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parlay.errors import ConfigError
from parlay.strategies import available_strategies, get_strategy
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, PER_REPLICA, CLIP = 3, 8, 0.05


def build_training_func():
    """What an example's build function returns: (nn.Sequential, loss_fn(output, target))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4)).double()
    return model, nn.CrossEntropyLoss()


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS, 2 * PER_REPLICA, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (STEPS, 2 * PER_REPLICA), generator=g)
    return x, y


def _strategy_run(grad_clip):
    s = get_strategy("hybrid", compression=None, precision="fp32", grad_clip=grad_clip,
                     pp=2, chunks=2)
    assert s.dp_size == 2                       # known before setup: the Trainer shards with it
    model, loss_fn = build_training_func()
    s.setup(model, loss_fn, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    x, y = _data()
    sl = slice(s.dp_rank * PER_REPLICA, (s.dp_rank + 1) * PER_REPLICA)
    losses = []
    for step in range(STEPS):
        s.set_lr_factor(0.5 if step == 0 else 1.0)
        r = s.train_step(x[step][sl], y[step][sl])
        assert r.samples == PER_REPLICA
        losses.append(r.loss)
    out = s.eval_forward(x[0][sl])
    sd = s.state_dict()
    s.load_state_dict(sd)
    return (s.dp_rank, s.dp_size, s.reports_loss, losses, out, sd["model"],
            s.comm_stats()["pipeline_fwd_bytes_per_step"])


def _reference(grad_clip):
    model, loss_fn = build_training_func()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = 0.1 * (0.5 if step == 0 else 1.0)
        opt.zero_grad()
        loss_fn(model(x[step]), y[step]).backward()
        if grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            assert norm > grad_clip             # the clip is active in this test
        opt.step()
    with torch.no_grad():
        halves = [model(x[0][r * PER_REPLICA:(r + 1) * PER_REPLICA]) for r in range(2)]
    return model.state_dict(), halves


def _replica_losses():
    """Each replica's batch loss at every step of the reference run (before its update)."""
    model, loss_fn = build_training_func()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    out = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = 0.1 * (0.5 if step == 0 else 1.0)
        with torch.no_grad():
            out.append([float(loss_fn(model(x[step][r * PER_REPLICA:(r + 1) * PER_REPLICA]),
                                      y[step][r * PER_REPLICA:(r + 1) * PER_REPLICA]))
                        for r in range(2)])
        opt.zero_grad()
        loss_fn(model(x[step]), y[step]).backward()
        opt.step()
    return out


@pytest.mark.parametrize("grad_clip", [None, CLIP])
def test_hybrid_strategy_equals_single_process(grad_clip):
    assert "hybrid" in available_strategies()
    ranks = run_world(_strategy_run, 4, grad_clip)
    ref_state, ref_halves = _reference(grad_clip)
    ref_losses = _replica_losses() if grad_clip is None else None
    state = {}
    for rank, (dp_rank, dp_size, reports, losses, out, sd, fwd_bytes) in enumerate(ranks):
        assert (dp_rank, dp_size) == (rank // 2, 2)
        assert reports == (rank % 2 == 1)       # only last stages report the loss
        if reports:
            assert all(isinstance(v, float) for v in losses)
            torch.testing.assert_close(out, ref_halves[dp_rank], **TOL)
            if ref_losses is not None:
                torch.testing.assert_close(losses, [r[dp_rank] for r in ref_losses], **TOL)
        else:
            assert losses == [None] * STEPS and out is None
            assert fwd_bytes == PER_REPLICA * 16 * 8   # one float64 activation per sample
        state.update(sd)
    assert sorted(state) == sorted(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, **TOL, msg=name)


def test_hybrid_strategy_options_are_checked():
    with pytest.raises(ConfigError, match=r"precision must be one of \['bf16', 'fp16', 'fp32'\]"):
        get_strategy("hybrid", compression=None, precision="fp8", grad_clip=None)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['stages'\]"):
        get_strategy("hybrid", compression=None, precision="fp32", grad_clip=None, stages=2)
    with pytest.raises(ConfigError, match=r"grad_clip must be a positive number"):
        get_strategy("hybrid", compression=None, precision="fp32", grad_clip=-1.0)


# -- through the Trainer: hybrid (2 replicas x 2 stages) == allreduce (2 replicas) -------------

def _trainer_dataset():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(3)
    x = torch.randn(44, 7, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 4, (44,), generator=g))


def _trainer(mode: str, options: dict):
    import parlay

    t = parlay.Trainer(build_training_func, _trainer_dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 0.01}, batch_size=6, num_epochs=2, mode=mode,
                       progress=False, validation_dataset=_trainer_dataset(),
                       strategy_options=options)
    metrics = t.train_and_validate_to_end()
    s = t.strategy
    state = s.pipe.state_dict() if mode == "hybrid" else t.model.state_dict()
    return metrics, {k: v.clone() for k, v in state.items()}, s.reports_loss


def test_trainer_hybrid_equals_trainer_allreduce_with_the_same_replicas():
    # Same replicas (2), same shards, same LR scaling and warm-up: only the pipeline differs.
    # Batches of 6 per replica with chunks=4 run as 3 micro-batches of 2; the epoch's last
    # batch (4 samples) as 4 micro-batches of 1 (a new schedule for the new shape).
    hybrid = run_world(_trainer, 4, "hybrid", {"pp": 2, "chunks": 4})
    ref = run_world(_trainer, 2, "allreduce", {})
    ref_metrics, ref_state, _ = ref[0]
    state = {}
    for rank, (metrics, sd, reports) in enumerate(hybrid):
        assert reports == (rank % 2 == 1)
        # every stage returns the metrics (the first stages get them from the last)
        assert metrics.keys() == ref_metrics.keys()
        for k in ref_metrics:
            torch.testing.assert_close(metrics[k], ref_metrics[k], **TOL)
        state.update(sd)
    assert sorted(state) == sorted(ref_state)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], **TOL, msg=k)


def _summed(mode: str, options: dict):
    import parlay

    def build():
        model, _ = build_training_func()
        return model, nn.CrossEntropyLoss(reduction="sum")

    t = parlay.Trainer(build, _trainer_dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.01}, batch_size=6, max_iteration=3, mode=mode,
                       progress=False, shuffle=False, strategy_options=options)
    losses = [t.train_on_batch() for _ in range(3)]
    state = t.strategy.pipe.state_dict() if mode == "hybrid" else t.model.state_dict()
    return losses, {k: v.clone() for k, v in state.items()}


def test_trainer_hybrid_with_a_sum_loss_equals_trainer_allreduce():
    # loss_reduction="sum": micro-batch losses add up; they were scaled by 1/chunks, dividing
    # the reported loss and every gradient by 3
    ref_losses, ref_state = run_world(_summed, 1, "allreduce", {})[0]
    state = {}
    for rank, (losses, sd) in enumerate(run_world(
            _summed, 2, "hybrid", {"pp": 2, "chunks": 3, "loss_reduction": "sum"})):
        if rank == 1:  # allreduce reports its loss through float32
            torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
        state.update(sd)
    assert sorted(state) == sorted(ref_state)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], **TOL, msg=k)


def _sampled(options: dict):
    import parlay

    torch.manual_seed(100 + parlay.rank())  # each rank draws its own example input
    return _trainer("hybrid", {**options, "sample": torch.randn(3, 7, dtype=torch.float64)})


def test_ranks_may_time_the_stages_on_example_inputs_of_their_own():
    # sample= is an example input: its values differ per rank here, which the start check
    # (same settings on every rank) must not refuse; the split is agreed, training is the same
    options = {"pp": 2, "chunks": 4, "by": "time"}
    timed = run_world(_sampled, 2, options)
    plain = run_world(_trainer, 2, "hybrid", {"pp": 2, "chunks": 4})
    for (m, _, _), (ref, _, _) in zip(timed, plain):
        for k in ref:
            torch.testing.assert_close(m[k], ref[k], **TOL)


# -- mixed precision through the Trainer ---------------------------------------------------------

def _blobs(n: int = 192):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 16, generator=g) * 3
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y)


def _precision_run(precision: str, options: dict):
    import parlay

    def build():
        return (nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 4)), nn.CrossEntropyLoss())

    t = parlay.Trainer(build, _blobs(), optimizer_args={"lr": 1e-2}, batch_size=16,
                       num_epochs=4, precision=precision, mode="hybrid", progress=False,
                       validation_dataset=_blobs(), strategy_options={"pp": 2, **options})
    skipped, losses = [], []
    while not t.should_stop():
        losses.append(t.train_on_batch())
        skipped.append(t.last_step.skipped)
    return losses, skipped, t.validate(), t.strategy.pipe.state_dict(), t.strategy.reports_loss


@pytest.mark.parametrize("precision, options", [("bf16", {}), ("fp16", {"loss_scale": 2.0 ** 24})])
def test_hybrid_mixed_precision_converges_and_skips_agree(precision, options):
    import math

    out = run_world(_precision_run, 4, precision, options)
    for losses, _skipped, metrics, _, reports in out:
        if reports:
            finite = [v for v in losses if math.isfinite(v)]
            assert sum(finite[-3:]) / 3 < 0.3 * sum(finite[:3]) / 3
            assert metrics["accuracy"] > 0.9
    # Every stage of every replica skips exactly the same steps; replicas stay identical.
    assert all(o[1] == out[0][1] for o in out)
    if precision == "fp16":
        assert any(out[0][1]), "a 2**24 loss scale must overflow fp16 (and be skipped) at first"
        assert not all(out[0][1])
    for stage in (0, 1):
        a, b = out[stage][3], out[stage + 2][3]
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


# -- BatchNorm's running statistics: shape probes must not move them ----------------------------

class _T(nn.Module):
    """A transposed view: stage 0 ends in one (not contiguous), stage 1 undoes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t()


def _batchnorm(mode: str, options: dict):
    import parlay

    def build():
        torch.manual_seed(0)
        return (nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                              _T(), _T(), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                              nn.ReLU(), nn.Linear(16, 4)).double(), nn.CrossEntropyLoss())

    t = parlay.Trainer(build, _trainer_dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=6, mode=mode, progress=False,
                       validation_dataset=_trainer_dataset(), strategy_options=options)
    metrics = t.train_and_validate_to_end()
    state = t.strategy.pipe.state_dict() if mode == "hybrid" else t.model.state_dict()
    return metrics, {k: v.clone() for k, v in state.items() if "running" in k or "tracked" in k}


def test_hybrid_keeps_batchnorm_statistics_as_allreduce_does():
    # One micro-batch a step (BatchNorm over the whole batch): the boundary check and torch's
    # shape inference ran extra training forwards, moving the statistics (with garbage inputs).
    # A BatchNorm inside stage 1 too (restoring its statistics after the shape inference must
    # not bump their autograd version), and stage 0 ends in a non-contiguous view. Two
    # replicas: every stage takes its first replica's statistics after each step, as allreduce
    # takes rank 0's (each replica kept its own: validation averaged two models).
    ref_metrics, ref = run_world(_batchnorm, 2, "allreduce", {})[0]
    for metrics, stats in run_world(_batchnorm, 4, "hybrid",
                                    {"pp": 2, "chunks": 1, "balance": [5, 6]}):
        for k, v in stats.items():
            torch.testing.assert_close(v, ref[k], **TOL, msg=k)
        assert metrics.keys() == ref_metrics.keys()
        for k in ref_metrics:
            torch.testing.assert_close(metrics[k], ref_metrics[k], **TOL)


def _refused(kind):
    import parlay

    def build():
        torch.manual_seed(0)
        if kind == "empty":
            return nn.Sequential(nn.Linear(7, 4), nn.ReLU()).double(), nn.CrossEntropyLoss()
        first, last = nn.Linear(7, 7), nn.Linear(7, 7)
        last.weight = first.weight  # tied
        return (nn.Sequential(first, nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), last,
                              nn.Linear(7, 4)).double(), nn.CrossEntropyLoss())

    try:
        parlay.Trainer(build, _trainer_dataset(), batch_size=6, mode="hybrid", progress=False,
                       strategy_options={"pp": 2, "balance": [1, 1] if kind == "empty"
                                         else [3, 3]})
    except ConfigError as e:
        return str(e)
    return None


def test_a_parameter_shared_across_stages_or_a_stage_without_parameters_is_refused():
    # each stage would train its own copy: the tie would break silently
    for msg in run_world(_refused, 2, "tied"):
        assert msg is not None and "shared by stage 0 and stage 1" in msg and "Hint" in msg
    # a stage of a ReLU only has nothing to step: refused on every rank, not only on its own
    # (whose optimizer could not be built while the other stage waited out the timeout)
    for msg in run_world(_refused, 2, "empty", timeout=40, comm_timeout=20):
        assert msg is not None and msg.startswith("stage 1 (1: ReLU) holds no parameters"), msg


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _custom(mode: str, options: dict):
    import parlay

    def build():
        torch.manual_seed(0)
        return _Custom().double(), nn.CrossEntropyLoss()

    t = parlay.Trainer(build, _trainer_dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=6, mode=mode, progress=False,
                       validation_dataset=_trainer_dataset(), strategy_options=options)
    return t.train_and_validate_to_end()


def test_a_model_that_is_not_sequential_trains_split_at_its_split_points():
    sample = torch.randn(3, 7, dtype=torch.float64)  # one micro-batch: batch 6 / chunks 2
    ref = run_world(_custom, 1, "allreduce", {})[0]
    for metrics in run_world(_custom, 2, "hybrid", {"pp": 2, "chunks": 2, "split_points": ["c"],
                                                    "sample": sample}):
        for k in ref:
            torch.testing.assert_close(metrics[k], ref[k], **TOL)
