"""Trainer(shard=...) on real gloo ranks: training as the replicated run does, checkpoints that
resume bit for bit, clear errors."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.errors import CheckpointError, ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(180)

N, BATCH, TOTAL, CUT = 48, 4, 12, 7


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def _build():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double(),
            nn.CrossEntropyLoss())


def _train(shard, ckpt=None, max_iteration=TOTAL, grad_clip=None):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard=shard,
                       max_iteration=max_iteration, checkpoint_dir=ckpt, checkpoint_every=3,
                       grad_clip=grad_clip, progress=False)
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    state = t.strategy.state_dict()
    model = {k: v.clone() for k, v in state["model"].items()}
    opt = t.strategy.optimizer
    chunks = [s.detach().clone() for g in opt.param_groups for s in g["params"]]
    return losses, model, chunks, t.state.step


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_sharded_trainer_trains_as_the_replicated_one_and_resumes_bit_for_bit(tmp_path, shard):
    plain = run_world(_train, 2, None, None, TOTAL, 0.5)
    full = run_world(_train, 2, shard, None, TOTAL, 0.5)
    for (lp, _, _, _), (ls, _, _, _) in zip(plain, full):
        torch.testing.assert_close(torch.tensor(ls), torch.tensor(lp), rtol=1e-10, atol=1e-10)
    first = run_world(_train, 2, shard, str(tmp_path), CUT, 0.5)
    second = run_world(_train, 2, shard, str(tmp_path), TOTAL, 0.5)
    for r in range(2):
        assert first[r][0] + second[r][0] == full[r][0]          # exactly
        assert all(torch.equal(a, b) for a, b in zip(full[r][2], second[r][2]))
    assert sorted(p.name for p in tmp_path.glob("ckpt-0000000012.rank*.pt")) == \
        ["ckpt-0000000012.rank0.pt", "ckpt-0000000012.rank1.pt"]


def _bad(shard, mode="allreduce", **kw):
    try:
        parlay.Trainer(_build, _dataset(), batch_size=BATCH, shard=shard, mode=mode,
                       progress=False, **kw)
    except ConfigError as e:
        return str(e)
    return None


def test_bad_shard_arguments_are_refused_clearly():
    assert "shard must be one of" in _bad("zero3")
    msg = run_world(_bad, 2, "gradients", "allreduce", compression="topk:0.1")[0]
    assert msg is not None and "compression" in msg


def _build_deep():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2)).double(), nn.CrossEntropyLoss())


def _hybrid(shard, schedule):
    t = parlay.Trainer(_build_deep, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard=shard, mode="hybrid",
                       strategy_options={"pp": 2, "chunks": 2, "schedule": schedule},
                       max_iteration=6, grad_clip=0.5, progress=False)
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    return losses


@pytest.mark.parametrize("shard, schedule", [("optimizer", "1f1b"), ("gradients", "gpipe"),
                                             ("parameters", "1f1b")])
def test_hybrid_shards_each_stage_over_its_replicas(shard, schedule):
    plain = run_world(_hybrid, 4, None, schedule)
    sharded = run_world(_hybrid, 4, shard, schedule)
    for lp, ls in zip(plain, sharded):
        if lp[0] is None:  # ranks of the first stage report no loss
            assert ls == lp
            continue
        torch.testing.assert_close(torch.tensor(ls), torch.tensor(lp), rtol=1e-10, atol=1e-10)


def _state_at(shard, ckpt, max_iteration, reshard=False):
    """Train (or only resume) to ``max_iteration``; this rank's shard of the state."""
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard=shard,
                       max_iteration=max_iteration, checkpoint_dir=ckpt, reshard=reshard,
                       progress=False)
    while not t.should_stop():
        t.train_on_batch()
    opt = t.strategy.optimizer.state_dict()
    return t.state.step, opt, t.strategy.state_dict()["model"]


def _whole(per_rank):
    """Each unit's parameters and optimizer state, joined over the ranks (world 1)."""
    def rechunk(parts, numel, *_):
        return torch.cat(parts)[:numel]
    opts = sorted((opt for _, opt, _ in per_rank), key=lambda o: o["parlay_shard"]["rank"])
    lay = opts[0]["parlay_shard"]
    out = {}
    for k, entry in opts[0]["state"].items():
        numel = lay["units"][lay["order"][k]]
        for key, v in entry.items():
            parts = [o["state"][k][key] for o in opts]
            out[(k, key)] = rechunk(parts, numel, 1, 0) if v.dim() else v
    for u, numel in enumerate(lay["units"]):
        if "params" in lay:
            out[("param", u)] = rechunk([o["parlay_shard"]["params"][u] for o in opts],
                                        numel, 1, 0)
    return out


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_reshard_2_to_4_to_3_reloads_the_state_exactly_and_trains_on(tmp_path, shard):
    two = run_world(_state_at, 2, shard, str(tmp_path), 5)
    with pytest.raises(Exception, match="layout|ranks"):  # not asked: refused as before
        run_world(_state_at, 4, shard, str(tmp_path), 5)
    four = run_world(_state_at, 4, shard, str(tmp_path), 5, True)
    assert all(step == 5 for step, _, _ in four)
    a, b = _whole(two), _whole(four)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if shard != "parameters":
        assert all(torch.equal(two[0][2][k], four[3][2][k]) for k in two[0][2])
    run_world(_state_at, 4, shard, str(tmp_path), 8, True)        # trains on at 4 ranks
    three = run_world(_state_at, 3, shard, str(tmp_path), 8, True)
    four_again = run_world(_state_at, 4, shard, str(tmp_path), 8)
    c, d = _whole(three), _whole(four_again)
    assert all(torch.equal(c[k], d[k]) for k in c)
    assert run_world(_state_at, 3, shard, str(tmp_path), 10, True)[0][0] == 10


def _precision(shard, precision):
    torch.manual_seed(0)
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)),
                                nn.CrossEntropyLoss()),
                       TensorDataset(*(v.float() if v.is_floating_point() else v
                                       for v in _dataset().tensors)),
                       optimizer=torch.optim.Adam, optimizer_args={"lr": 1e-2},
                       batch_size=BATCH, shard=shard, precision=precision, max_iteration=8,
                       progress=False)
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    return losses, t.skipped_steps


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_sharded_as_replicated(precision):
    for (lp, sp), (ls, ss) in zip(run_world(_precision, 2, None, precision),
                                  run_world(_precision, 2, "parameters", precision)):
        assert ss == sp  # the same overflow skips (agreed over the chunks)
        torch.testing.assert_close(torch.tensor(ls), torch.tensor(lp), rtol=1e-3, atol=1e-4)


def _state_host_first(ckpt, max_iteration, reshard=False):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard="gradients",
                       strategy_options={"hierarchical": True}, max_iteration=max_iteration,
                       checkpoint_dir=ckpt, reshard=reshard, progress=False)
    while not t.should_stop():
        t.train_on_batch()
    return t.state.step, t.strategy.optimizer.state_dict(), None


def test_reshard_from_and_into_a_host_first_layout(tmp_path):
    # 2 simulated hosts x 2: a rank holds chunk local_rank * hosts + host, not its rank.
    four = run_world(_state_host_first, 4, str(tmp_path), 4, local_world_size=2)
    assert [o["parlay_shard"]["rank"] for _, o, _ in four] == [0, 2, 1, 3]
    two = run_world(_state_host_first, 2, str(tmp_path), 4, True, local_world_size=1)
    a, b = _whole(four), _whole(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
    back = run_world(_state_host_first, 4, str(tmp_path), 4, True, local_world_size=2)
    c = _whole(back)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_another_host_layout_at_the_same_world_is_refused_on_every_rank(tmp_path):
    # 2 hosts x 2 -> 1 host x 4: ranks 1 and 2 hold other chunks now; all four must refuse
    # together (the other two waited in the shards' load until the collective timeout)
    run_world(_state_host_first, 4, str(tmp_path), 4, local_world_size=2)
    out = run_world(_state_host_first, 4, str(tmp_path), 6, local_world_size=4,
                    return_exceptions=True, comm_timeout=60)
    assert all(isinstance(e, CheckpointError) for e in out), out
    assert "ranks per host change" in str(out[1]) and "another rank" in str(out[0])


def _validate(shard, n, mode):
    hybrid = {"pp": 2, "chunks": 2} if mode == "hybrid" else None
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard=shard, mode=mode,
                       strategy_options=hybrid, max_iteration=3, progress=False,
                       validation_dataset=TensorDataset(*_dataset()[:n]),
                       validation_batch_size=5)
    while not t.should_stop():
        t.train_on_batch()
    return t.validate()


@pytest.mark.parametrize("mode, world, n", [("allreduce", 3, 46), ("allreduce", 3, 2),
                                            ("hybrid", 4, 41)])
def test_sharded_parameters_validate_uneven_shares_as_the_replicated_run(mode, world, n):
    # Every forward gathers parameters over the replicas. allreduce: 46 samples on 3 ranks in
    # batches of 5 are 4, 3 and 3 batches (2 samples: a rank holds none). hybrid (2 stages x 2
    # replicas): 21 and 20 samples, and a last batch of 1 row makes fewer micro-batches.
    plain = run_world(_validate, world, None, n, mode)
    sharded = run_world(_validate, world, "parameters", n, mode)
    for a, b in zip(plain, sharded):
        assert a.get("samples", n) == b.get("samples", n) == n
        assert a == pytest.approx(b, rel=1e-12)


def _dcp_run(ckpt, max_iteration, reshard=False):
    """Train (checkpoints every 2 steps, 2 kept); the resumed step, this rank's chunks and the
    warnings given while resuming."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                           optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard="gradients",
                           max_iteration=max_iteration, checkpoint_dir=ckpt, checkpoint_every=2,
                           keep_last=2, reshard=reshard, progress=False)
    resumed = t.state.step
    while not t.should_stop():
        t.train_on_batch()
    return resumed, t.strategy.optimizer.state_dict(), [str(w.message) for w in caught]


def test_sharded_checkpoints_are_dcp_shards_verified_pruned_and_fall_back(tmp_path):
    from parlay.checkpoint import load
    first = run_world(_dcp_run, 2, str(tmp_path), 6)
    # each rank's file holds no chunk; the shards sit in one DCP folder per kept step
    assert sorted(p.name for p in tmp_path.glob("*.dcp")) == \
        ["ckpt-0000000004.dcp", "ckpt-0000000006.dcp"]
    assert sorted(p.name for p in (tmp_path / "ckpt-0000000006.dcp").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = load(tmp_path / "ckpt-0000000006.rank1.pt")
    assert sorted(state["dcp"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    opt = state["strategy"]["optimizer"]
    assert not any(isinstance(v, torch.Tensor) for e in opt["state"].values() for v in e.values())
    assert "params" not in opt["parlay_shard"]
    # a flipped byte in a shard file: both ranks fall back to step 4, saying which file
    bad = tmp_path / "ckpt-0000000006.dcp" / "__1_0.distcp"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    again = run_world(_dcp_run, 2, str(tmp_path), 6)
    assert [r[0] for r in again] == [4, 4]
    assert any(str(bad) in w and "rank 0" in w for w in again[0][2]), again[0][2]
    assert all(any("falling back" in w for w in r[2]) for r in again)
    for r in range(2):  # trained on from step 4 to the same state, bit for bit
        a, b = first[r][1], again[r][1]
        assert all(torch.equal(v, b["state"][k][n]) for k in a["state"]
                   for n, v in a["state"][k].items())
    # resharded onto 3 ranks: the same check, the same fallback
    bad = tmp_path / "ckpt-0000000006.dcp" / "__0_0.distcp"
    bad.write_bytes(bad.read_bytes()[:-7])
    three = run_world(_dcp_run, 3, str(tmp_path), 6, True)
    assert [r[0] for r in three] == [4, 4, 4]
    assert any(str(bad) in w for r in three for w in r[2])
    assert sorted(p.name for p in (tmp_path / "ckpt-0000000006.dcp").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def _hybrid_ckpt(shard, ckpt, max_iteration):
    t = parlay.Trainer(_build_deep, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=BATCH, shard=shard, mode="hybrid",
                       strategy_options={"pp": 2, "chunks": 2}, max_iteration=max_iteration,
                       checkpoint_dir=ckpt, checkpoint_every=3, progress=False)
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    opt = t.strategy.optimizer
    return losses, [s.detach().clone() for g in opt.param_groups for s in g["params"]]


@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_hybrid_sharded_checkpoints_are_dcp_per_stage_and_resume_bit_for_bit(tmp_path, shard):
    full = run_world(_hybrid_ckpt, 4, shard, None, TOTAL)
    first = run_world(_hybrid_ckpt, 4, shard, str(tmp_path), CUT)
    # each stage's replicas write their chunks into the step's DCP folder (one a stage; 7: the end)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*.dcp/*/*")) == \
        [f"ckpt-00000000{s:02d}.dcp/stage{k}/{f}" for s in (3, 6, 7) for k in (0, 1)
         for f in (".metadata", "__0_0.distcp", "__1_0.distcp")]
    from parlay.checkpoint import load
    state = load(tmp_path / "ckpt-0000000007.rank3.pt")["strategy"]
    assert not any(k.endswith(("weight", "bias")) for k in state["model"])  # all in the chunks
    assert not any(isinstance(v, torch.Tensor) for e in state["optimizer"]["state"].values()
                   for v in e.values())
    # a flipped byte in one stage's shard file: every rank falls back to step 6 together
    bad = tmp_path / "ckpt-0000000007.dcp" / "stage1" / "__1_0.distcp"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    second = run_world(_hybrid_ckpt, 4, shard, str(tmp_path), TOTAL)
    for r in range(4):
        assert first[r][0][:6] + second[r][0] == full[r][0]
        assert all(torch.equal(a, b) for a, b in zip(full[r][1], second[r][1]))


def _build_frozen(value):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 2)).double()
    m[2].requires_grad_(False)
    with torch.no_grad():  # a frozen layer a rebuild does not reproduce (an EMA, a teacher)
        m[2].weight.fill_(value)
    return m, nn.CrossEntropyLoss()


def _frozen_adagrad(shard, ckpt, max_iteration, value):
    t = parlay.Trainer(functools.partial(_build_frozen, value), _dataset(),
                       optimizer=torch.optim.Adagrad, optimizer_args={"lr": 0.05},
                       batch_size=BATCH, shard=shard, max_iteration=max_iteration,
                       checkpoint_dir=ckpt, checkpoint_every=3, progress=False)
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    opt = t.strategy.optimizer
    return (losses, t.strategy.model[2].weight.detach().clone(),
            [s.detach().clone() for g in opt.param_groups for s in g["params"]])


@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_sharded_resume_keeps_frozen_parameters_and_adagrad_state(tmp_path, shard):
    # Adagrad's state is all tensors (in the DCP shards), which left its entries in the rank's
    # file empty, and Adagrad's load reads "step" from any entry; frozen parameters are in no
    # chunk, so they belong in the rank's file
    full = run_world(_frozen_adagrad, 2, shard, None, TOTAL, 0.25)
    first = run_world(_frozen_adagrad, 2, shard, str(tmp_path), CUT, 0.25)
    second = run_world(_frozen_adagrad, 2, shard, str(tmp_path), TOTAL, -1.0)
    for r in range(2):
        assert first[r][0] + second[r][0] == full[r][0]
        assert torch.equal(second[r][1], full[r][1])  # the checkpoint's value, not the build's
        assert all(torch.equal(a, b) for a, b in zip(full[r][2], second[r][2]))
