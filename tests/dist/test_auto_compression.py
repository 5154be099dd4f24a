"""compression="auto" on real gloo ranks: agreement, exact error feedback across switches,
dense on loopback for a small model, and its spec parsing and errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import parlay
from parlay import comm
from tools.bench.harness import mlp as _mlp
from parlay.compress import AutoCompressor, get_compressor, reduce_async
from parlay.compress.autocost import switch_margin
from parlay.errors import ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _train(opt: parlay.DistributedOptimizer, model: nn.Module, steps: int) -> None:
    g = torch.Generator().manual_seed(parlay.rank())
    for _ in range(steps):
        x, y = torch.randn(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _skewed_hook(rank: int):
    """Each rank sees a different world: rank 1 a link of 1000x less bandwidth (its larger
    probes take 1000x longer), rank 0 a free top-k and
    rank 1 a free PowerSGD, and rank 1's step time jumps after its first check."""
    checks = [0]

    def hook(kind: str, name: str, seconds: float) -> float:
        if kind == "link" and rank == 1 and name != "small":
            return seconds * 1000
        if kind == "codec" and name.startswith("topk" if rank == 0 else "powersgd"):
            return seconds * 0.01
        if kind == "step":
            checks[0] += 1
            return seconds * (10 if rank == 1 and checks[0] > 1 else 1)
        return seconds
    return hook


def _agree() -> dict:
    model = _mlp([784, 64, 32, 10])
    # measure again whenever the step moves (no trial: its steps would hold the checks off)
    auto = AutoCompressor(every=2, budget=1.0, trial=0)
    auto.timing_hook = _skewed_hook(parlay.rank())
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=auto, bucket_cap_mb=0.005)
    _train(opt, model, 9)
    hier_only = AutoCompressor()
    hier_only.bind(None, summable_only=True)
    ps_only = AutoCompressor()
    ps_only.bind(None, collective=False)
    six = AutoCompressor(margin=0.6)
    six.bind(None)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = comm.allgather(params.unsqueeze(0))
    return dict(choices=dict(auto.choices), history=[h[:4] for h in auto.history],
                calibrations=list(auto.calibrations), buckets=len(opt.plan.buckets),
                same_params=bool(torch.equal(every[0], every[1])),
                hier=list(hier_only._eligible), ps=list(ps_only._eligible),
                margins=(auto._margin, six._margin))


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-512, 512, (n,), generator=g).double() / 64  # sums stay exact


def _switches() -> list[dict]:
    """Reduce one bucket through forced switches; after each step compare the running sums
    with the oracle: sum of inputs == sum of outputs + what every rank still owes."""
    n, rank = 64 * 64, parlay.rank()
    auto = AutoCompressor(["none", "topk:0.05", "powersgd:2", "fp16"], every=1000)
    auto.bind(None)
    # (fp16 is a lossy cast without a residual of its own, so it has no place in this ledger)
    plan = ["topk:0.05"] * 3 + ["powersgd:2"] * 2 + ["topk:0.05", "none", "topk:0.05", "none"]
    fed = torch.zeros(n, dtype=torch.float64)
    got = torch.zeros(n, dtype=torch.float64)
    rows = []
    for step, spec in enumerate(plan):
        if auto.choices.get("b0") != spec:
            auto.force("b0", spec)
        x = _grad(rank, step, n)
        fed += comm.allreduce(x.clone(), "sum")
        got += reduce_async(x, auto, "b0").wait()
        owed = auto.residual("b0")
        owed = torch.zeros(n, dtype=torch.float64) if owed is None else owed.clone()
        comm.allreduce(owed, "sum")
        rows.append(dict(spec=auto.choices["b0"], gap=float((fed - got - owed).abs().max()),
                         owed=float(owed.abs().max())))
    return rows


def _small_model() -> dict:
    model = _mlp([784, 128, 10])
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression="auto")
    _train(opt, model, 3)
    return dict(choices=dict(opt.compression.choices), pred=opt.compression.last_prediction,
                state=sorted(opt.state_dict()["parlay_compression"]))


def _trial() -> dict:
    """Stay dense by prediction (margin 0.99), then measure every candidate for 2 steps: each
    rank sees other medians, and the MAX over ranks makes fp16 the fastest."""
    model = _mlp([784, 64, 32, 10])
    auto = AutoCompressor(["none", "fp16", "topk:0.05"], every=1000, margin=0.99, trial=2)
    auto.trial_within = 1e3  # every candidate is a contender
    seen = [{"none": 1.0, "fp16": 0.5, "topk:0.05": 0.9},
            {"none": 1.0, "fp16": 0.8, "topk:0.05": 0.3}][parlay.rank()]

    def hook(kind: str, name: str, seconds: float) -> float:
        if kind != "trial":
            return seconds
        return seen[next(iter(set(auto.trialing.options[int(name)].values())))]
    auto.timing_hook = hook
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=auto, bucket_cap_mb=0.005)
    _train(opt, model, 10)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return dict(choices=dict(auto.choices), history=[h[:4] for h in auto.history],
                reasons=[h[4] for h in auto.history], params=params)


def _noisy_fp32_probe() -> dict:
    """The link probe on a machine where noise hit the fp32 allreduce only (100x: past gloo's
    software fp16 sums, which make the same bytes in fp16 a few times slower here)."""
    from parlay.compress import autocost

    def hook(kind: str, name: str, seconds: float) -> float:
        return seconds * 1e3 * (100.0 if name == "large" else 1.0)
    fit = autocost.probe_link(None, parlay.size(), [4 << 20], hook)
    return dict(beta=fit.beta_s, beta_half=fit.beta_half_s)


def _all() -> dict:
    return dict(agree=_agree(), switches=_switches(), small=_small_model(), trial=_trial(),
                noisy=_noisy_fp32_probe())


@pytest.fixture(scope="module")
def per_rank():
    return run_world(_all, 2, timeout=110)


def test_ranks_agree_despite_different_local_timings(per_rank):
    a, b = per_rank[0]["agree"], per_rank[1]["agree"]
    assert a["buckets"] >= 2
    assert a["choices"] == b["choices"] and a["history"] == b["history"]
    assert a["calibrations"] == b["calibrations"]
    # rank 1's slow link reached rank 0 through the reduction: nothing stayed dense
    assert all(v != "none" for v in a["choices"].values()), a["choices"]
    # rank 1's step-time jump made both ranks measure and decide again at the same step
    assert len(a["calibrations"]) >= 2, a["calibrations"]
    assert a["same_params"] and b["same_params"]


def test_trial_keeps_the_fastest_measured_and_ranks_agree(per_rank):
    a, b = per_rank[0]["trial"], per_rank[1]["trial"]
    assert a["history"] == b["history"] and a["choices"] == b["choices"]
    assert set(a["choices"].values()) == {"fp16"}, a["history"]
    # every bucket: dense by prediction (step 1), fp16 at step 4, top-k at 6, fp16 at 8 (kept)
    steps = sorted({(h[0], h[3]) for h in a["history"]})
    assert steps == [(1, "none"), (4, "fp16"), (6, "topk:0.05"), (8, "fp16")], steps
    assert a["reasons"][-1].startswith("trial: ") and "fp16 800.00ms" in a["reasons"][-1]
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)


def test_bind_restricts_candidates(per_rank):
    r = per_rank[0]["agree"]
    # every rank on this host: leaving the current choice needs a predicted 2x (ONE_HOST_MARGIN)
    assert r["margins"] == (0.5, 0.6)
    assert switch_margin(0.25) == 0.25  # this test process: no parlay world, the margin as given
    assert r["hier"] == ["none", "fp16", "powersgd:4"]   # hierarchical: summable payloads only
    assert r["ps"] == ["none", "fp16", "topk:0.01", "topk:0.01,compact=1"]  # one round only


def test_forced_switches_keep_error_feedback_exact(per_rank):
    for rank, rows in enumerate(per_rank):
        for s, row in enumerate(rows["switches"]):
            # top-k and casts are exact; PowerSGD's residual has one rounding of a subtraction
            tol = 1e-9 if any(r["spec"].startswith("powersgd") for r in rows["switches"][:s + 1]) \
                else 0.0
            assert row["gap"] <= tol, f"rank {rank} step {s} ({row['spec']}): {row}"
        assert rows["switches"][2]["owed"] > 0  # top-k really held something back
        assert rows["switches"][-1]["owed"] == 0  # the dense step paid every debt


def test_fp16_never_costs_less_per_byte_than_fp32(per_rank):
    # The same bytes in fp16 ride the same wire and sum no faster: a probe that reads fp16
    # cheaper is noise, and fp16 then looked 4x faster than dense on a loaded loopback.
    for r in per_rank:
        assert r["noisy"]["beta_half"] >= r["noisy"]["beta"] > 0


def test_loopback_small_model_stays_dense(per_rank):
    for rank, r in enumerate(per_rank):
        assert set(r["small"]["choices"].values()) == {"none"}, (rank, r["small"]["pred"])
        assert r["small"]["state"] == ["cands", "carry", "choices", "step"]


def _ps_auto() -> dict:
    from parlay.ps import DistributedSession

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3))
    auto = AutoCompressor(["none", "topk:0.1"])
    # a slow link, seen by the workers' probe: pushes must go compressed, and the server must
    # decode them from the context values alone
    auto.timing_hook = lambda kind, name, s: s * 1e4 if kind == "link" and name != "small" else s
    g = torch.Generator().manual_seed(parlay.rank())
    with DistributedSession(task_spec=parlay.TaskSpec.from_env(), model=model,
                            optimizer=torch.optim.SGD, optimizer_args={"lr": 0.1},
                            consistency="sync", compression=auto, max_steps=4) as sess:
        while not sess.should_stop():
            sess.train_step((torch.randn(8, 20, generator=g), torch.randn(8, 3, generator=g)),
                            nn.functional.mse_loss)
    return dict(choices=dict(auto.choices), worker=sess.is_worker,
                params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_ps_pushes_choose_agree_and_decode_on_the_server():
    out = run_world(_ps_auto, 3, env={"PARLAY_NUM_PS": "1"}, timeout=100)
    server, w1, w2 = out
    assert not server["worker"] and w1["choices"] == w2["choices"] == {"ps0": "topk:0.1"}
    assert torch.isfinite(server["params"]).all()
    torch.testing.assert_close(w1["params"], server["params"], rtol=0, atol=0)
    torch.testing.assert_close(w2["params"], server["params"], rtol=0, atol=0)


def _hierarchical() -> dict:
    model = _mlp([784, 64, 10])
    auto = AutoCompressor()
    # every rank sees a slow link, so the buckets compress: with summable payloads only
    auto.timing_hook = lambda kind, name, s: s * 1e4 if kind == "link" and name != "small" else s
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=auto, hierarchical=True)
    _train(opt, model, 3)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return dict(hier=opt.hierarchical, choices=dict(auto.choices), params=params)


def test_hierarchical_reduction_keeps_to_summable_choices():
    out = run_world(_hierarchical, 4, local_world_size=2, timeout=100)
    for r in out:
        assert r["hier"] and r["choices"] == out[0]["choices"]
        assert set(r["choices"].values()) <= {"fp16", "powersgd:4"}, r["choices"]
        torch.testing.assert_close(r["params"], out[0]["params"], rtol=0, atol=0)


def test_spec_parsing_and_errors():
    a = get_compressor("auto")
    assert isinstance(a, AutoCompressor) and a.specs == ["none", "fp16", "powersgd:4",
                                                         "topk:0.01", "topk:0.01,compact=1"]
    b = get_compressor("auto:candidates=none+topk:0.05+bf16,every=5,margin=0.3")
    assert b.specs == ["none", "topk:0.05", "bf16"] and b.every == 5 and b.margin == 0.3
    assert isinstance(parlay.Compression.auto(), AutoCompressor)
    assert get_compressor("auto:budget=0.05").budget == 0.05
    for bad in ("auto:candidates=ef", "auto:candidates=none+auto", "auto:every=0", "auto:budget=2",
                "auto:bogus=1", "auto:candidates=fp16+fp16", "auto:margin=1.5"):
        with pytest.raises(ConfigError):
            get_compressor(bad)
    with pytest.raises(ConfigError, match="none of"):
        AutoCompressor(["powersgd:4", "topk:0.01"]).bind(None, collective=False,
                                                         summable_only=True)
    with pytest.raises(ConfigError, match="not a candidate"):
        AutoCompressor().force("bucket0", "topk:0.5")
