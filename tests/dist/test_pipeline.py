"""Pipelines on real gloo ranks against the unpartitioned model in one process.

Everything is float64, so the only difference from the oracle is summation order (micro-batch
gradients are added one by one): equality is asserted to 1e-10. Each world runs several
configurations to keep process start-up off the clock.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import parlay
from parlay.errors import ConfigError
from parlay.pipeline import Pipeline
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)
BATCH = 12


def _model(width: int = 6, blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, width), nn.Tanh()]
    for _ in range(blocks - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers).double()


def _batch(n: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# Configurations: (label, Pipeline kwargs, batch size). Batch 12 with chunks=5 runs as 4
# micro-batches of 3 (largest divisor); chunks=1 makes 1F1B fall back to GPipe.
CONFIGS = {
    2: [("gpipe/m4", dict(schedule="gpipe", chunks=4), 12),
        ("1f1b/m4", dict(schedule="1f1b", chunks=4), 12),
        ("1f1b/m5->4", dict(schedule="1f1b", chunks=5), 12),
        ("1f1b/m1->gpipe", dict(schedule="1f1b", chunks=1), 12),
        ("1f1b/balance", dict(schedule="1f1b", chunks=3, balance=[7, 2]), 12),
        # Balanced by profiled time (rank 0's profile, broadcast) and checked on a sample.
        ("1f1b/by-time", dict(schedule="1f1b", chunks=4, sample="micro-batch"), 12),
        ("interleaved/v2", dict(schedule="interleaved", chunks=4), 12),
        # A target that is not one tensor (multi-task losses): split per micro-batch too.
        ("1f1b/tuple-target", dict(schedule="1f1b", chunks=3), 12)],
    4: [("gpipe/m4", dict(schedule="gpipe", chunks=4), 12),
        ("1f1b/m4", dict(schedule="1f1b", chunks=4), 12),
        ("1f1b/m6", dict(schedule="1f1b", chunks=6), 12),
        ("interleaved/v2", dict(schedule="interleaved", chunks=4), 12)],
}


def _run_configs(world: int):
    results = []
    for label, kw, n in CONFIGS[world]:
        x, y = _batch(n)
        if kw.get("sample") == "micro-batch":
            kw = {**kw, "sample": x[:3]}
        loss_fn, target = nn.functional.mse_loss, y
        if label.endswith("tuple-target"):  # the same loss, its target split in two
            def loss_fn(o, t):
                return (nn.functional.mse_loss(o, t[0]) + nn.functional.mse_loss(o, t[1]["b"])) / 2
            target = (y, {"b": y.clone()})
        pipe = Pipeline(_model(), loss_fn, stages=world, **kw)
        if "sample" in kw:
            assert pipe.partition.method == "time"
        out = pipe.step(x, target, return_outputs=True)
        fwd = pipe.forward(x)  # inference leaves the step's gradients as they are
        grads = {k: p.grad.clone() for k, p in pipe.named_parameters()}
        results.append((label, pipe.stage_ids, out.loss, out.output, fwd, grads, out.chunks,
                        out.schedule))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_outputs_loss_and_gradients_equal_the_unpartitioned_model(world):
    per_rank = run_world(_run_configs, world, world)
    ref_out, ref_loss, ref_grads = _reference(_model(), *_batch())
    for k, label in enumerate(c[0] for c in CONFIGS[world]):
        grads, last = {}, None
        for rank_results in per_rank:
            lab, stages, loss, out, fwd, g, chunks, sched = rank_results[k]
            assert lab == label
            grads.update(g)
            if loss is not None:
                assert last is None, f"{label}: two ranks report a loss"
                last = (loss, out, fwd, chunks, sched)
            else:
                assert out is None and fwd is None
        assert last is not None, f"{label}: no rank reported the loss"
        loss, out, fwd, chunks, sched = last
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{label}: loss")
        torch.testing.assert_close(out, ref_out, **TOL, msg=f"{label}: output")
        torch.testing.assert_close(fwd, ref_out, **TOL, msg=f"{label}: forward()")
        assert sorted(grads) == sorted(ref_grads), label
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **TOL,
                                       msg=f"{label}: grad of {name}")
        if label == "1f1b/m5->4":
            assert chunks == 4 and sched == "1f1b"
        if label == "1f1b/m1->gpipe":
            assert chunks == 1 and sched == "gpipe"


def _shared_model(block: bool) -> nn.Sequential:
    """One module at positions 1 and 3: an activation, or (``block``) a Linear whose weights
    the two positions share."""
    torch.manual_seed(0)
    again = nn.Linear(6, 6) if block else nn.Tanh()
    return nn.Sequential(nn.Linear(5, 6), again, nn.Tanh() if block else nn.Linear(6, 6), again,
                         nn.Linear(6, 3)).double()


def _shared_modules():
    pipe = Pipeline(_shared_model(False), nn.functional.mse_loss, stages=2, chunks=2)
    out = pipe.step(*_batch())
    grads = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    try:
        Pipeline(_shared_model(True), nn.functional.mse_loss, stages=2, balance=[2, 3])
    except ConfigError as e:
        return out.loss, grads, pipe.partition.balance, str(e)
    return None


def test_a_module_used_twice_is_a_layer_at_both_positions():
    # named_children() lists a module once: the second Tanh was dropped from the pipeline
    ranks = run_world(_shared_modules, 2, comm_timeout=10, timeout=60)
    _, ref_loss, ref_grads = _reference(_shared_model(False), *_batch())
    torch.testing.assert_close(ranks[1][0], ref_loss, **TOL)
    grads = {**ranks[0][1], **ranks[1][1]}
    assert sorted(grads) == sorted(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)
    assert ranks[0][2] == (2, 3)  # the Tanh runs in both stages (positions 1 and 3)
    # a shared block with parameters in two stages: each would train its own copy
    for *_, msg in ranks:
        assert "parameter 1.weight is shared by stage 0 and stage 1 (3.weight)" in msg, msg


def _apart(case: str):
    rank = parlay.rank()
    kw = {"balance": dict(stages=2, balance=[2, 7] if rank == 0 else [4, 5]),
          "chunks": dict(stages=2, chunks=2 if rank == 0 else 4),
          "stages": dict(stages=1 if rank == 0 else 2)}[case]
    try:
        Pipeline(_model(), nn.functional.mse_loss, **kw)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, rank0, rank1", [
    ("balance", "balance=(2, 7)", "balance=(4, 5)"), ("chunks", "chunks=2", "chunks=4"),
    ("stages", "stages=1", "stages=2")])
def test_pipeline_options_apart_between_ranks_are_refused_on_every_rank(case, rank0, rank1):
    # balance apart trained layers owned by no rank; chunks apart failed in torch on one rank
    # and timed out on the other; stages apart built mismatched mesh groups
    msgs = run_world(_apart, 2, case, comm_timeout=5, timeout=60)
    assert msgs[0] is not None and msgs[1] == msgs[0], msgs  # the same error on every rank
    assert msgs[0].startswith("the ranks build their Pipeline with different settings: "), msgs
    assert f"{rank0} on rank 0 but {rank1} on rank 1" in msgs[0] and "Hint" in msgs[0]


# -- hybrid dp x pp ----------------------------------------------------------------------------

STEPS, PER_REPLICA = 4, 8


def _make_opt(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _data(dp: int):
    xs, ys = zip(*(_batch(dp * PER_REPLICA, seed=10 + s) for s in range(STEPS)))
    return xs, ys


def _hybrid(opt_name: str, schedule: str, compression=None):
    pipe = Pipeline(_model(), nn.functional.mse_loss, stages=2, chunks=4, schedule=schedule)
    opt = pipe.distributed_optimizer(_make_opt(opt_name, pipe.parameters()),
                                     compression=compression, bucket_cap_mb=0.0005)
    xs, ys = _data(pipe.mesh.dp)
    sl = slice(pipe.mesh.dp_rank * PER_REPLICA, (pipe.mesh.dp_rank + 1) * PER_REPLICA)
    losses, launched_in_backward = [], []
    for s in range(STEPS):
        opt.zero_grad()
        before = opt.comm_stats()["reductions"]
        out = pipe.step(xs[s][sl], ys[s][sl])
        # The data-parallel reduction started during the pipeline's last backward, not in step().
        launched_in_backward.append(opt.comm_stats()["reductions"] - before)
        opt.step()
        if out.loss is not None:
            losses.append(pipe.mean_over_replicas(out.loss))
    return ({n: p.detach().clone() for n, p in pipe.named_parameters()}, losses,
            launched_in_backward, len(opt.plan.buckets), pipe.mesh.dp_rank, pipe.mesh.pp_rank,
            opt.comm_stats())


def _single_process(opt_name: str, dp: int):
    model = _model()
    opt = _make_opt(opt_name, model.parameters())
    xs, ys = _data(dp)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs[s]), ys[s])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {n: p.detach() for n, p in model.named_parameters()}, losses


@pytest.mark.parametrize("opt_name, schedule", [("sgd", "1f1b"), ("adam", "gpipe")])
def test_hybrid_2x2_equals_single_process_training(opt_name, schedule):
    out = run_world(_hybrid, 4, opt_name, schedule)
    ref_params, ref_losses = _single_process(opt_name, dp=2)
    params = {}
    for rank, (p, losses, launched, buckets, dp_rank, pp_rank, _) in enumerate(out):
        assert (dp_rank, pp_rank) == (rank // 2, rank % 2)
        assert launched == [buckets] * STEPS        # every bucket, once, during backward
        for name, value in p.items():
            if name in params:                      # the other replica holds the same stage
                torch.testing.assert_close(value, params[name], rtol=0, atol=0)
            params[name] = value
        if pp_rank == 1:                            # last stage: dp-averaged batch losses
            torch.testing.assert_close(losses, ref_losses, **TOL)
        else:
            assert losses == []
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], **TOL, msg=name)


def test_hybrid_gradient_compression_applies():
    # fp16 gradient compression over each stage's dp group: close to, not equal to, exact.
    out = run_world(_hybrid, 4, "sgd", "1f1b", "fp16")
    ref_params, _ = _single_process("sgd", dp=2)
    for p, *_, stats in out:
        assert stats["wire_bytes"] * 4 == stats["dense_bytes"] > 0   # float64 sent as fp16
        differs = False
        for name, value in p.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-3, atol=1e-3)
            differs |= not torch.equal(value, ref_params[name])
        assert differs, "fp16 rounding should be visible against the float64 oracle"


# -- inter-stage wire dtype --------------------------------------------------------------------

def _wire(dtype):
    pipe = Pipeline(_model(), nn.functional.mse_loss, stages=2, chunks=4, activation_dtype=dtype)
    x, y = _batch()
    out = pipe.step(x, y, return_outputs=True)
    return (pipe.stage_ids, out.loss, out.output, out.fwd_bytes, out.bwd_bytes,
            out.fwd_dense_bytes, out.bwd_dense_bytes, out.messages,
            {k: p.grad.clone() for k, p in pipe.named_parameters()})


@pytest.mark.parametrize("dtype, size", [(None, 8), ("bf16", 2), ("fp16", 2)])
def test_activation_dtype_and_bytes_between_stages(dtype, size):
    ranks = run_world(_wire, 2, dtype)
    ref_out, ref_loss, ref_grads = _reference(_model(), *_batch())
    pipe_stages = [r[0] for r in ranks]
    assert pipe_stages == [[0], [1]]
    # Balanced by parameter count, the boundary is one (12 x 6) activation per batch.
    boundary = BATCH * 6
    first, last = ranks
    assert first[3] == boundary * size and first[4] == 0          # stage 0 sends activations
    assert last[3] == 0 and last[4] == boundary * size            # stage 1 sends gradients
    assert first[5] == last[6] == boundary * 8                    # as float64 without the cast
    assert first[7] == last[7] == 4                               # one message per micro-batch
    tol = TOL if dtype is None else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(last[1], ref_loss, **tol)
    torch.testing.assert_close(last[2], ref_out, **tol)
    grads = {**first[8], **last[8]}
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol)
    if dtype is not None:  # the cast is real: results differ from the float64 oracle
        assert not torch.equal(last[1], ref_loss)


class _Emit(nn.Module):  # an (int64 mask, float32 activation) boundary
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, x):
        return (x[:, 0] > 0).long(), torch.tanh(self.lin(x))


class _Use(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, xs):
        mask, h = xs
        return self.lin(h) * (1 + mask.unsqueeze(1).float())


def _mixed_boundary():
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(_Emit(), _Use()), nn.functional.mse_loss, stages=2, chunks=2,
                    activation_dtype="bf16")
    x, y = (t.float() for t in _batch(8))
    out = pipe.step(x, y)
    return out.bwd_bytes, out.bwd_dense_bytes


def test_gradient_dense_bytes_count_the_float_input_of_a_tuple_boundary():
    # only the float32 element gets a gradient back; it was counted at the int64 mask's size
    _, (wire, dense) = run_world(_mixed_boundary, 2)
    assert (wire, dense) == (8 * 6 * 2, 8 * 6 * 4)


# -- errors on real ranks ----------------------------------------------------------------------

def _errors():
    found = {}
    for key, kw in {"world": dict(stages=3), "chunks": dict(stages=2, chunks=0),
                    "schedule": dict(stages=2, schedule="zero-bubble"),
                    "virtual": dict(stages=2, schedule="1f1b", virtual_stages=2),
                    "wire": dict(stages=2, activation_dtype="int8"),
                    "too_many": dict(stages=2, schedule="interleaved", virtual_stages=6),
                    "by": dict(stages=2, by="tme")}.items():
        try:
            Pipeline(_model(), nn.functional.mse_loss, **kw)
        except ConfigError as e:
            found[key] = str(e)
    pipe = Pipeline(_model(), nn.functional.mse_loss, stages=2)
    x, _ = _batch()
    if pipe.is_last:
        try:
            pipe.step(x, None)
        except ConfigError as e:
            found["target"] = str(e)
    return found


def test_bad_pipeline_arguments_raise_documented_errors():
    for found in run_world(_errors, 2):
        assert "world_size % stages == 0" in found["world"] and "Hint" in found["world"]
        assert "chunks (micro-batches per batch) must be an int >= 1" in found["chunks"]
        assert "unknown pipeline schedule 'zero-bubble'" in found["schedule"]
        assert "virtual_stages=2 needs schedule='interleaved'" in found["virtual"]
        assert "activation_dtype must be one of" in found["wire"]
        assert "cannot split a model of 9 layer(s) into 12 stages" in found["too_many"]
        assert "by must be one of ('auto', 'time', 'params'), got 'tme'" in found["by"]
    assert "needs the target" in run_world(_errors, 2)[1]["target"]


class _Boom(nn.Module):
    armed = False

    def forward(self, x):
        if self.armed:
            raise ValueError("boom in the last stage")
        return x


def _raising_stage():
    pipe = Pipeline(nn.Sequential(nn.Linear(5, 3), _Boom()).double(), nn.functional.mse_loss,
                    stages=2, chunks=2)
    pipe.step(*_batch())
    for m in pipe.modules:  # armed after a first step (the boundary check runs every layer)
        for layer in m.modules():
            if isinstance(layer, _Boom):
                layer.armed = True
    try:
        pipe.step(*_batch())
    except Exception as e:  # noqa: BLE001 - the test looks at what each stage got
        return type(e).__name__, str(e), getattr(e, "peer", None)
    return None


def test_an_error_in_a_stage_is_raised_as_the_model_raised_it():
    # torch wraps it in a RuntimeError whose first line is empty (parlay run printed
    # "RuntimeError: "); the neighbour stage gets a CommError within the timeout, naming it
    first, last = run_world(_raising_stage, 2, comm_timeout=3, timeout=60)
    assert last == ("ValueError", "boom in the last stage", None)
    assert first[0] == "CommError" and first[2] == 1, first


def test_pipeline_needs_a_process_group():
    with pytest.raises(ConfigError, match="parlay.init"):
        Pipeline(_model(), nn.functional.mse_loss, stages=1)
    assert not parlay.is_initialized()


# -- a non-Sequential model cut at named submodules (traced) ------------------------------------

class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.relu(self.b(h)) + h)


def _traced():
    x, y = _batch()
    model = Residual().double()
    pipe = Pipeline(model, nn.functional.mse_loss, stages=2, chunks=3, split_points=["b"],
                    sample=x[:4])
    out = pipe.step(x, y)
    return out.loss, {k: p.grad.clone() for k, p in pipe.named_parameters()}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_traced_model_with_split_points_equals_the_model():
    ranks = run_world(_traced, 2)
    model = Residual().double()
    x, y = _batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert ranks[0][0] is None
    torch.testing.assert_close(ranks[1][0], loss.detach(), **TOL)
    grads = {**ranks[0][1], **ranks[1][1]}
    assert sorted(grads) == ["a.bias", "a.weight", "b.bias", "b.weight", "c.bias", "c.weight"]
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


class _BnDrop(nn.Module):  # BatchNorm and Dropout: a trace bakes their training mode in
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.drop = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)
        self.c = nn.Linear(8, 3)

    def forward(self, x):
        return self.c(self.drop(torch.relu(self.bn(self.a(x)))))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_traced_model_evaluates_in_eval_mode_on_the_trained_tensors():
    import copy

    from parlay.pipeline.trace import trace_to_sequential

    x, _ = _batch()
    model = _BnDrop().double()
    ref = copy.deepcopy(model)
    seq = trace_to_sequential(model, ["c"], x[:4])
    torch.manual_seed(3)
    out = seq(x)  # training: batch statistics and dropout, as the model does
    torch.manual_seed(3)
    torch.testing.assert_close(out, ref(x), **TOL)
    # the eval pieces follow a conversion of the training pieces (buffers are replaced)
    seq.float().eval()
    ref.float().eval()
    with torch.no_grad():
        first, second, want = seq(x.float()), seq(x.float()), ref(x.float())
    torch.testing.assert_close(first, want)
    assert torch.equal(first, second)
    assert seq.state_dict()["stage0.gm.bn.num_batches_tracked"].item() == 1


class _Viewed(nn.Module):  # input [B, 2, 5]
    def __init__(self, flatten: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.flatten, self.a, self.b = flatten, nn.Linear(5, 4), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))  # a view with the row count is frozen by the trace
        return self.b(h.flatten(1) if self.flatten else h.view(h.size(0), -1))


def _traced_one_rank():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 5, generator=g, dtype=torch.float64)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64)
    out: dict = {}
    try:  # two pieces, one stage: no longer regrouped silently
        Pipeline(_Viewed(True).double(), nn.functional.mse_loss, stages=1,
                 split_points=["b"], sample=x[:3])
    except ConfigError as e:
        out["count"] = str(e)
    for flatten in (True, False):
        pipe = Pipeline(_Viewed(flatten).double(), nn.functional.mse_loss, stages=1, chunks=2,
                        split_points=[], sample=x[:3])
        for n in (6, 4):  # micro-batches of 3 (the sample's), then of 2
            try:
                out[flatten, n] = pipe.step(x[:n], y[:n]).loss
            except ConfigError as e:
                out[flatten, n] = str(e)
    return out


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_traced_model_refuses_a_stage_count_or_batch_its_trace_cannot_run():
    out = run_world(_traced_one_rank, 1)[0]
    assert out["count"].startswith("1 split point(s) make 2 stages, but stages=1"), out
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 5, generator=g, dtype=torch.float64)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64)
    for n in (6, 4):  # x.flatten(1) traces for any batch
        want = nn.functional.mse_loss(_Viewed(True).double()(x[:n]), y[:n])
        torch.testing.assert_close(out[True, n], want.detach(), **TOL)
    torch.testing.assert_close(out[False, 6], out[True, 6], **TOL)
    assert "takes only micro-batches of 3 rows" in out[False, 4], out[False, 4]


def _on_meta():
    import parlay.runtime as rt

    rt.device = lambda: torch.device("meta")  # as on a GPU: only this rank's stage is moved
    pipe = Pipeline(_model(), nn.functional.mse_loss, stages=2, chunks=2, sample=_batch()[0][:6])
    return {p.device.type for p in pipe.parameters()}


def test_the_boundary_check_runs_before_the_stages_move_to_the_device():
    assert run_world(_on_meta, 2) == [{"meta"}, {"meta"}]


def _stalled_stage():
    import time

    from parlay.pipeline.hybrid import build_mesh

    mesh = build_mesh(2, 2)  # two stages, two replicas: each group a true subgroup
    if parlay.rank() != 0:
        time.sleep(5.0 if parlay.rank() == 1 else 0)  # a stage that stalls (not dead)
        return None
    t0 = time.monotonic()
    try:
        parlay.comm.allreduce(torch.ones(2), "sum", group=mesh.pp_group)
    except parlay.CommError:
        return time.monotonic() - t0
    return None


def test_the_mesh_groups_time_out_within_the_configured_timeout():
    # init_device_mesh gave its groups torch's 30-minute default: a stalled stage hung the
    # others past PARLAY_TIMEOUT
    elapsed = run_world(_stalled_stage, 4, comm_timeout=2.0, timeout=60)[0]
    assert elapsed is not None and elapsed < 2.0 + 4.0, elapsed
