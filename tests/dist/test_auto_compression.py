"""compression="auto" on real gloo ranks: agreement, its one short trial, exact error feedback
across switches, dense on loopback for a small model, and its spec parsing and errors."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import parlay
from parlay import comm
from tools.bench.harness import mlp as _mlp
from parlay.compress import AutoCompressor, get_compressor, reduce_async
from parlay.compress import auto as auto_module
from parlay.compress.auto import switch_margin
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
    probes take 1000x longer), rank 0 a free top-k and rank 1 a free PowerSGD."""
    def hook(kind: str, name: str, seconds: float) -> float:
        if kind == "link" and rank == 1 and name != "small":
            return seconds * 1000
        if kind == "codec" and name.startswith("topk" if rank == 0 else "powersgd"):
            return seconds * 0.01
        return seconds
    return hook


def _agree() -> dict:
    model = _mlp([784, 64, 32, 10])
    auto = AutoCompressor(trial=0)
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
                buckets=len(opt.plan.buckets),
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
    auto = AutoCompressor(["none", "topk:0.05", "powersgd:2", "fp16"])
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
                state=sorted(opt.state_dict()["parlay_compression"]),
                described=opt.compression.describe())


def _trial(seen_by_rank: list[dict], resume_after: int = 0) -> dict:
    """Stay dense by prediction (margin 0.99), then measure dense and fp16 for 2 steps each,
    each rank seeing the step times ``seen_by_rank`` gives it; ``resume_after`` steps, the
    optimizer's state goes to a new model, compressor and optimizer that go on."""
    auto_module.TRIAL_WITHIN = 1e3  # fp16 is a contender whatever it was predicted
    seen = seen_by_rank[parlay.rank()]

    def build(state: dict | None = None):
        model = _mlp([784, 64, 32, 10])
        auto = AutoCompressor(["none", "fp16"], margin=0.99, trial=2)
        auto.timing_hook = lambda kind, name, seconds: seconds if kind != "trial" else \
            seen[next(iter(set(auto.trialing.options[int(name)].values())))]
        opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                          named_parameters=model.named_parameters(),
                                          compression=auto, bucket_cap_mb=0.005)
        if state is not None:
            opt.load_state_dict(state)
        return model, auto, opt
    model, auto, opt = build()
    if resume_after:
        _train(opt, model, resume_after)
        model, auto, opt = build(opt.state_dict())
    _train(opt, model, 8 - resume_after)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return dict(choices=dict(auto.choices), history=[h[:4] for h in auto.history],
                reasons=[h[4] for h in auto.history], params=params,
                trialing=auto.trialing)


def _noisy_fp32_probe() -> dict:
    """The link probe on a machine where noise hit the fp32 allreduce only (100x: past gloo's
    software fp16 sums, which make the same bytes in fp16 a few times slower here)."""
    def hook(kind: str, name: str, seconds: float) -> float:
        return seconds * 1e3 * (100.0 if name == "large" else 1.0)
    fit = auto_module.probe_link(None, [4 << 20], hook)
    return dict(beta=fit.beta_s, beta_half=fit.beta_half_s)


def _all() -> dict:
    # rank 1 alone would take fp16, but the MAX over ranks makes dense the faster
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("parlay.compress")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    kept = _trial([{"none": 0.5, "fp16": 1.0}, {"none": 0.7, "fp16": 0.6}])
    logger.removeHandler(handler)
    kept["logged"] = lines
    # fp16 measures 20% faster on the slowest rank: it replaces the decision
    replaced = _trial([{"none": 1.0, "fp16": 0.5}, {"none": 0.9, "fp16": 0.8}])
    # saved while the trial runs fp16: the resumed one finishes the trial and keeps dense
    resumed = _trial([{"none": 0.5, "fp16": 1.0}, {"none": 0.7, "fp16": 0.6}], resume_after=5)
    return dict(trial_resumed=resumed, agree=_agree(), switches=_switches(),
                small=_small_model(), trial=kept, trial_replaced=replaced,
                noisy=_noisy_fp32_probe())


@pytest.fixture(scope="module")
def per_rank():
    return run_world(_all, 2, timeout=110)


def test_ranks_agree_despite_different_local_timings(per_rank):
    a, b = per_rank[0]["agree"], per_rank[1]["agree"]
    assert a["buckets"] >= 2
    assert a["choices"] == b["choices"] and a["history"] == b["history"]
    # rank 1's slow link reached rank 0 through the reduction: nothing stayed dense
    assert all(v != "none" for v in a["choices"].values()), a["choices"]
    assert a["same_params"] and b["same_params"]


def test_trial_keeps_the_fastest_measured_and_ranks_agree(per_rank):
    a, b = per_rank[0]["trial"], per_rank[1]["trial"]
    assert a["history"] == b["history"] and a["choices"] == b["choices"]
    assert set(a["choices"].values()) == {"none"}, a["history"]
    # every bucket: dense by prediction (step 1), fp16 from step 4, dense again at 6 (kept)
    steps = sorted({(h[0], h[3]) for h in a["history"]})
    assert steps == [(1, "none"), (4, "fp16"), (6, "none")], steps
    assert a["reasons"][-1] == "trial: none 700.00ms, fp16 1000.00ms", a["reasons"][-1]
    assert a["trialing"] is None  # one trial, then the choice stands
    # the first decision and the trial's verdict were not logged when nothing changed
    assert any(" starts with none (predicted" in line for line in a["logged"]), a["logged"]
    assert any("the trial keeps none (trial: none 700.00ms" in line for line in a["logged"])
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    a, b = per_rank[0]["trial_replaced"], per_rank[1]["trial_replaced"]
    assert a["history"] == b["history"] and a["trialing"] is None
    assert sorted({(h[0], h[3]) for h in a["history"]}) == [(1, "none"), (4, "fp16")]
    assert set(a["choices"].values()) == {"fp16"}


def test_a_trial_saved_midway_goes_on_after_the_resume(per_rank):
    a, b = per_rank[0]["trial_resumed"], per_rank[1]["trial_resumed"]
    assert a["history"] == b["history"] and a["trialing"] is None
    # the history is resumed too; the step spanning the restart is not timed: the trial ends
    # at step 7, not 6
    assert sorted({(h[0], h[3]) for h in a["history"]}) == [(1, "none"), (4, "fp16"),
                                                            (7, "none")], a["history"]
    assert a["reasons"][-1] == "trial: none 700.00ms, fp16 1000.00ms", a["reasons"][-1]
    assert set(a["choices"].values()) == {"none"}


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
        assert r["small"]["state"] == ["cands", "carry", "choices", "history", "prediction",
                                         "step", "trial"]
        assert r["small"]["described"] == " ".join(f"{k}=none" for k in r["small"]["choices"])


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
    b = get_compressor("auto:candidates=none+topk:0.05+bf16,margin=0.3,trial=2")
    assert b.specs == ["none", "topk:0.05", "bf16"] and b.margin == 0.3 and b.trial == 2
    # a candidate's own options follow it after commas; auto's own options may come after
    c = get_compressor("auto:candidates=none+topk:0.01,compact=1+fp16,trial=0")
    assert c.specs == ["none", "topk:0.01,compact=1", "fp16"] and c.trial == 0
    assert get_compressor("auto:candidates=" + "+".join(a.specs)).specs == a.specs
    with pytest.raises(ConfigError, match="'topk'.*unknown option 'compakt'"):
        get_compressor("auto:candidates=none+topk:0.01,compakt=1")
    assert isinstance(parlay.Compression.auto(), AutoCompressor)
    for bad in ("auto:candidates=ef", "auto:candidates=none+auto", "auto:trial=-1",
                "auto:bogus=1", "auto:candidates=fp16+fp16", "auto:margin=1.5"):
        with pytest.raises(ConfigError):
            get_compressor(bad)
    with pytest.raises(ConfigError, match="none of"):
        AutoCompressor(["powersgd:4", "topk:0.01"]).bind(None, collective=False,
                                                         summable_only=True)
    with pytest.raises(ConfigError, match="not a candidate"):
        AutoCompressor().force("bucket0", "topk:0.5")
    assert AutoCompressor().describe() == "undecided"
    from parlay.plan import ClusterSpec, Link, Workload, predict

    with pytest.raises(ConfigError, match="prices its candidates"):  # no dense price in disguise
        predict(Workload(1e6, 8, 1e-3), ClusterSpec(2, 1, Link(1e9)), "allreduce", "auto")
