"""Compressor maths without a process group: casts, sparsifiers, error feedback, registry.

``simulate`` plays reduce_async's protocol for W in-process "ranks" (sum payloads, run the extra
rounds, decode), so the maths is checked here and the wire in tests/dist/test_compression.py.
"""
from __future__ import annotations

import io

import pytest
import torch

import parlay
from parlay.compress import (BF16, FP16, ErrorFeedback, PowerSGD, RandomK, TopK, available,
                             get_compressor)
from parlay.compress.reduce import local_round_trip
from parlay.compress.feedback import warmup_density
from parlay.compress.sparse import exact_topk, random_indices
from parlay.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def simulate(comps, flats, key="bucket0"):
    """What reduce_async computes on each of len(comps) ranks (rank r holds comps[r])."""
    outs = [c.compress(f, key) for c, f in zip(comps, flats)]
    ctxs = [ctx for _, ctx in outs]
    if not comps[0].summable:
        payloads = [p for p, _ in outs]
        return [c.aggregate(payloads, ctx) for c, ctx in zip(comps, ctxs)]
    payloads = [p for p, _ in outs]
    while True:
        summed = [torch.stack([p[i] for p in payloads]).sum(0) for i in range(len(payloads[0]))]
        mine = [[t.clone() for t in summed] for _ in comps]
        nxt = [c.next_round(m, ctx) for c, m, ctx in zip(comps, mine, ctxs)]
        if all(n is None for n in nxt):
            return [c.decompress(m, ctx) for c, m, ctx in zip(comps, mine, ctxs)]
        assert all(n is not None for n in nxt), "ranks disagree on the number of rounds"
        payloads = nxt


def dyadic(n, seed, scale=64):
    """float64 values k/1024 with |k| < scale*1024: every sum below is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-scale * 1024, scale * 1024, (n,), generator=g).double() / 1024


@pytest.mark.parametrize("spec,world", [("none", 1), ("fp16", 1), ("bf16", 1), ("topk:0.1", 3),
                                         ("powersgd:2", 1)])
def test_local_round_trip_is_one_rank_of_the_protocol(spec, world):
    # What codec timing runs: one rank's encode, further rounds and decode (for allgather
    # compressors, world copies of its payload) must be what reduce_async decodes for a world
    # of identical ranks. The 1e6 entry overflows fp16, so fp16 needs its fp32 retry round.
    flat = dyadic(600, 7).index_put_((torch.tensor([3]),), torch.tensor(1e6, dtype=torch.float64))
    mine = get_compressor(spec)
    comps = [get_compressor(spec) for _ in range(world)]
    for c in [mine, *comps]:
        c.set_layout("b", [(20, 30)])
    want = simulate(comps, [flat] * world, "b")[0]
    got = local_round_trip(mine, flat, "b", world)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if spec == "fp16":
        assert got[3] == 1e6


# ------------------------------------------------------------------------ casts
def test_fp16_relative_error_bound_and_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * torch.logspace(-3, 3, 4000)
    c = FP16()
    for _ in range(2):  # step 1 plain cast (scale 1), step 2 with the adapted scale
        scale = c.scale("bucket0")
        out = simulate([c], [x])[0]
        assert out.dtype == torch.float32
        # fp16 keeps 11 significant bits (round to nearest: 2**-11 relative) down to its
        # smallest normal 2**-14; below that the absolute spacing is 2**-24 (half: 2**-25).
        assert torch.all((out - x).abs() <= x.abs() * 2.0 ** -11 + 2.0 ** -25 / scale)
    assert c.scale("bucket0") == 2.0 ** (10 - 12)  # 2**11 <= max |x| ~ 2360 < 2**12


def test_fp16_overflow_falls_back_exactly_then_scales_down():
    x = torch.tensor([1e6, -3e5, 1.0, 1e-3])
    comps = [FP16(), FP16()]
    out = simulate(comps, [x, x])  # 2e6 would be inf in fp16
    for o in out:
        torch.testing.assert_close(o, 2 * x, rtol=0, atol=0)  # full-precision retry: exact
    assert comps[0].retries == 1 and comps[0].scale("bucket0") == comps[1].scale("bucket0") < 1
    scale = comps[0].scale("bucket0")
    out2 = simulate(comps, [x, x])
    assert comps[0].retries == 1  # the adapted scale avoids the overflow
    # two casts and one fp16 sum; below fp16's normal range the spacing is 2**-24 / scale
    assert torch.all((out2[0] - 2 * x).abs() <= 2 * x.abs() * 2.0 ** -10 + 2.0 ** -23 / scale)


def test_fp16_scale_rescues_tiny_gradients():
    x = torch.full((8,), 3e-8)  # below fp16's smallest subnormal * 0.5: a plain cast gives 0
    c = FP16()
    assert simulate([c], [x])[0].abs().max() < 1e-7
    out = simulate([c], [x])[0]  # second step: scale derived from the first result
    torch.testing.assert_close(out, x, rtol=2.0 ** -11, atol=0)


def test_fp16_scale_climbs_when_every_gradient_underflowed():
    # 2e-8 rounds to 0 in fp16 (3e-8 rounds up to the smallest subnormal): the first result
    # is all zero, and the scale used to stay at 1 forever, sending zeros every step
    x = torch.full((8,), 2e-8)
    c = FP16()
    assert simulate([c], [x])[0].abs().max() == 0
    torch.testing.assert_close(simulate([c], [x])[0], x, rtol=2.0 ** -11, atol=0)


@pytest.mark.parametrize("make", [lambda: TopK(0.01), lambda: RandomK(0.01)],
                         ids=["topk", "randomk"])
def test_a_nan_the_selection_passes_over_still_reaches_the_sum(make):
    # A large bucket's top-k selects by a threshold, which drops NaN, and random-k may not draw
    # it: the NaN stayed behind (its residual reverted) and the sum came out finite
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    x[12_345] = float("nan")
    c = make()
    assert torch.isnan(simulate([c], [x])[0]).any()


def test_bf16_relative_error_bound():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g) * torch.logspace(-20, 20, 4000)
    out = simulate([BF16()], [x])[0]
    assert out.dtype == torch.float32
    assert torch.all((out - x).abs() <= x.abs() * 2.0 ** -8)


# ------------------------------------------------------------------------ sparsifiers
def test_topk_selects_exactly_the_k_largest_magnitudes():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1000, generator=g)
    c = TopK(0.05, error_feedback=False)
    (values, idx), ctx = c.compress(x, "b")
    assert values.numel() == idx.numel() == 50 and idx.dtype == torch.int32
    expect = x.abs().sort(descending=True).values[:50]
    torch.testing.assert_close(values.abs().sort(descending=True).values, expect, rtol=0, atol=0)
    torch.testing.assert_close(values, x[idx.long()], rtol=0, atol=0)
    dense = c.decompress([values, idx], ctx)
    assert int((dense != 0).sum()) == 50 and torch.equal(dense[idx.long()], values)


@pytest.mark.parametrize("k", [1, 300, 3000])
def test_exact_topk_on_large_buckets_matches_torch_topk(k):
    g = torch.Generator().manual_seed(k)
    a = (torch.randn(200_000, generator=g) * torch.rand(200_000, generator=g) ** 4).abs()
    a[:5000] = a[5000:10000]  # ties
    expect = torch.topk(a, k).values
    got = a[exact_topk(a, k)]
    assert got.numel() == k and exact_topk(a, k).unique().numel() == k
    torch.testing.assert_close(got.sort(descending=True).values, expect, rtol=0, atol=0)
    flat = torch.ones(200_000)  # all equal: every entry is a candidate
    assert exact_topk(flat, k).unique().numel() == k


def test_topk_uses_int64_indices_only_beyond_int32():
    c = TopK(0.5)
    idx = torch.tensor([0, 3])
    assert c._payload(torch.ones(2), idx, 2 ** 31 - 1)[1].dtype == torch.int32
    assert c._payload(torch.ones(2), idx, 2 ** 31)[1].dtype == torch.int64


def test_randomk_indices_agree_across_ranks_and_change_per_step():
    a, b = RandomK(0.1, seed=7), RandomK(0.1, seed=7)
    x = torch.randn(500)
    seen = []
    for _ in range(3):
        (_, ctx_a), (_, ctx_b) = a.compress(x, "bucket0"), b.compress(-x, "bucket0")
        ia, ib = a.indices(500, ctx_a.k, ctx_a.seed), b.indices(500, ctx_b.k, ctx_b.seed)
        assert torch.equal(ia, ib) and ia.numel() == 50 and ia.unique().numel() == 50
        seen.append(ia)
    assert not torch.equal(seen[0], seen[1])
    other = RandomK(0.1, seed=7).compress(x, "bucket1")[1]
    assert other.seed != RandomK(0.1, seed=7).compress(x, "bucket0")[1].seed


def test_random_indices_are_uniform_and_distinct():
    counts = torch.zeros(200)
    for s in range(600):
        idx = random_indices(200, 10, s)
        assert idx.unique().numel() == 10 and 0 <= int(idx.min()) and int(idx.max()) < 200
        counts[idx] += 1
    # 600 draws x 10 / 200 = 30 expected per index; binomial sd ~5.3, so 6 sd bounds.
    assert counts.min() > 30 - 32 and counts.max() < 30 + 32 and counts.std() < 10


@pytest.mark.parametrize("make", [lambda: TopK(0.05), lambda: RandomK(0.05),
                                  lambda: TopK(0.05, momentum=0.875),  # dyadic: exact
                                  lambda: ErrorFeedback(FP16()),
                                  lambda: ErrorFeedback(TopK(0.02, error_feedback=False))],
                         ids=["topk", "randomk", "topk-dgc", "ef-fp16", "ef-topk"])
def test_error_feedback_conserves_exactly_in_float64(make):
    c = make()
    mem = c.memory
    produced = torch.zeros(400, dtype=torch.float64)
    sent = torch.zeros_like(produced)
    for step in range(6):
        g = dyadic(400, step)
        if mem.momentum:  # DGC: the velocity is what is produced
            before = mem.velocity.get("k", torch.zeros_like(g)).clone()
            produced += before * mem.momentum + g
        else:
            produced += g
        sent += simulate([c], [g], key="k")[0]
        torch.testing.assert_close(sent + mem.residual["k"], produced, rtol=0, atol=0)
    if mem.momentum:  # momentum factor masking: no velocity left where something was sent
        out = simulate([c], [dyadic(400, 9)], "k")[0]  # (the velocity is a new tensor)
        assert torch.all(mem.velocity["k"][out != 0] == 0)


def test_no_error_feedback_drops_the_rest():
    c = TopK(0.1, error_feedback=False)
    assert c.memory is None and "error_feedback=False" in repr(c)
    with pytest.raises(ConfigError, match="needs error feedback"):
        TopK(0.1, error_feedback=False, momentum=0.9)


def test_density_warmup_decays_geometrically_to_ratio():
    assert warmup_density(0, 0.001, 100, 0.25) == pytest.approx(0.25)
    assert warmup_density(50, 0.001, 100, 0.25) == pytest.approx((0.25 * 0.001) ** 0.5)
    assert warmup_density(100, 0.001, 100, 0.25) == 0.001
    c = TopK(0.01, warmup_steps=4, warmup_start=0.5)
    ks = [c.compress(torch.randn(1000), "b")[1].k for _ in range(6)]
    assert ks[0] == 500 and ks[-1] == ks[-2] == 10 and ks == sorted(ks, reverse=True)


# ------------------------------------------------------------------------ state
def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # checkpoints load with weights_only


@pytest.mark.parametrize("name", sorted(set(available()) | {"topk:0.05,momentum=0.9",
                                                            "randomk:0.05,warmup=3"}))
def test_state_dict_round_trip_continues_identically(name):
    a = get_compressor(name)
    a.set_layout("b0", [(20, 30), (30,)])
    for s in range(3):
        simulate([a], [torch.randn(630, generator=torch.Generator().manual_seed(s))], "b0")
    b = get_compressor(name)
    b.set_layout("b0", [(20, 30), (30,)])
    b.load_state_dict(_roundtrip(a.state_dict()))
    x = torch.randn(630)
    torch.testing.assert_close(simulate([b], [x], "b0")[0], simulate([a], [x], "b0")[0],
                               rtol=0, atol=0)
    if getattr(a, "memory", None) is not None:
        torch.testing.assert_close(b.memory.residual["b0"], a.memory.residual["b0"])


def test_residual_from_another_model_is_rejected():
    a = TopK(0.1)
    a.compress(torch.randn(100), "bucket0")
    b = TopK(0.1)
    b.load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="has 100 elements but the bucket has 50"):
        b.compress(torch.randn(50), "bucket0")
    with pytest.raises(ConfigError, match="should map bucket keys to tensors"):
        TopK(0.1).load_state_dict({"residual": [1, 2]})


# ------------------------------------------------------------------------ registry / facade
def test_registry_names_options_and_errors():
    assert {"none", "fp16", "bf16", "topk", "randomk", "powersgd", "int8"} <= set(available())
    t = get_compressor("topk:0.001,momentum=0.9,warmup=200")
    assert isinstance(t, TopK) and t.ratio == 0.001 and t.memory.momentum == 0.9
    assert t.warmup_steps == 200
    assert get_compressor("powersgd:2").rank == 2 and get_compressor("randomk").ratio == 0.01
    assert get_compressor("topk:0.1,ef=0").memory is None
    with pytest.raises(ConfigError, match="valid names: (auto, )?bf16, fp16, int8, none, powersgd"):
        get_compressor("gzip")
    with pytest.raises(ConfigError, match=r"ratio must be in \(0, 1\]"):
        get_compressor("topk:0")
    with pytest.raises(ConfigError, match="unknown option 'rank'"):
        get_compressor("topk:0.1,rank=2")
    with pytest.raises(ConfigError, match="not a valid float"):
        get_compressor("randomk:abc")
    with pytest.raises(ConfigError, match="'ratio' is given twice"):
        get_compressor("topk:0.1,ratio=0.2")


@pytest.mark.parametrize("a,b", [
    ("randomk:0.05", "randomk:0.05,seed=1"), ("topk:0.05,warmup=3", "topk:0.05,warmup=3,"
                                              "warmup_start=0.5"),
    ("topk:0.1,momentum=0.9", "topk:0.1,momentum=0.9,masking=0"),
    ("powersgd:2", "powersgd:2,min_compression=20"), ("powersgd:2", "powersgd:2,seed=1"),
    ("powersgd:2", "powersgd:2,warm_start=0"), ("auto", "auto:margin=0.5"),
    ("auto", "auto:trial=0")])
def test_every_option_off_its_default_shows_in_the_repr_ranks_compare(a, b):
    assert repr(get_compressor(a)) != repr(get_compressor(b))
    assert repr(ErrorFeedback("fp16", 0.9)) != repr(ErrorFeedback("fp16", 0.9, masking=False))


def test_auto_state_keeps_history_copies_its_trial_and_redecides_ineligible_choices():
    from parlay.compress.auto import AutoCompressor, _Trial

    flat = AutoCompressor()
    flat.bind(None)
    flat._switch("bucket0", "topk:0.01", "forced")
    x = torch.arange(1.0, 301.0)
    flat.compress(x, "bucket0")  # top-k keeps all but 3 coordinates owed
    flat.trialing = _Trial([{"bucket0": "topk:0.01"}, {"bucket0": "fp16"}], 3)
    flat.trialing.times.append(0.1)
    state = flat.state_dict()
    flat.trialing.times.append(0.2)  # a later (say undone) step leaves the saved state alone
    assert state["trial"]["times"] == [0.1]
    owed = flat.residual("bucket0")
    again = AutoCompressor()
    again.load_state_dict(state)
    assert again.history == flat.history == [(0, "bucket0", None, "topk:0.01", "forced")]
    assert again.choices == {"bucket0": "topk:0.01"}
    host_first = AutoCompressor()  # a host-first reducer sums payloads: top-k cannot go there
    host_first.bind(None, summable_only=True)
    with pytest.warns(UserWarning, match="not eligible here"):
        host_first.load_state_dict(state)
    assert "bucket0" not in host_first.choices and host_first.trialing is None
    assert torch.equal(host_first.residual("bucket0"), owed)  # carried, not lost
    payload, ctx = host_first.compress(torch.zeros(300), "bucket0")
    assert host_first.choices == {"bucket0": "none"}
    assert torch.equal(host_first.decompress(payload, ctx), owed)


def test_facade_and_horovod_namespace():
    comp = parlay.compression
    assert isinstance(comp.TopK(ratio=0.01), TopK) and comp.TopK(ratio=0.01).memory is not None
    a, b = get_compressor(parlay.Compression.fp16), get_compressor(parlay.Compression.fp16)
    assert isinstance(a, FP16) and a is not b  # a class: fresh per-bucket state per optimizer
    assert type(get_compressor(parlay.Compression.none)).__name__ == "NoneCompressor"
    with pytest.raises(ConfigError, match="already keeps its own residuals"):
        comp.ErrorFeedback(PowerSGD(2))
    ef = comp.ErrorFeedback(TopK(0.1))
    assert ef.inner.memory is None and ef.memory is not None and not ef.summable


def test_fp16_keeps_its_scale_when_the_gradients_themselves_are_not_finite():
    # A loss-scale overflow (inf gradients) divided the scale by 256 each time and nothing
    # restored it: after a few such steps it sat at 2**-24 and small sums went to exactly 0.
    c = FP16(init_scale=4.0)
    bad = torch.tensor([float("inf"), 1.0, 2.0])
    for _ in range(4):
        simulate([c], [bad])
    assert c.retries == 4 and c.scale("bucket0") == 4.0


def test_an_overflowed_step_leaves_the_residual_owed_before_it():
    # DistributedOptimizer with torch's GradScaler recipe: the overflow's inf went into the
    # top-k residual and every later step overflowed again (12 of 12 skipped, against 7)
    c = TopK(0.25)
    simulate([c], [torch.tensor([4.0, 3.0, 2.0, 1.0])])
    owed = c.state_dict()["residual"]["bucket0"].clone()
    simulate([c], [torch.tensor([float("inf"), -float("inf"), 1.0, 1.0])])  # more than k
    assert torch.equal(c.state_dict()["residual"]["bucket0"], owed)
    fresh = TopK(0.25)
    simulate([fresh], [torch.tensor([float("nan"), float("nan"), 1.0, 1.0])])
    assert torch.equal(fresh.state_dict()["residual"]["bucket0"], torch.zeros(4))


def test_finite_sees_nan_and_infinities_of_any_sign_and_kind():
    from parlay.compress.feedback import finite

    assert bool(finite(torch.randn(100))) and bool(finite(torch.zeros(0)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for t in (torch.zeros(5), torch.zeros(5, dtype=torch.bfloat16),
                  torch.zeros(5, dtype=torch.complex64)):
            t[3] = bad
            assert not bool(finite(t)), (bad, t.dtype)


@pytest.mark.parametrize("make", [lambda: TopK(0.25, momentum=0.9, masking=False),  # inf sent
                                  lambda: RandomK(0.25, momentum=0.9),  # inf mostly kept
                                  lambda: ErrorFeedback(FP16(), momentum=0.9, masking=False)])
def test_an_overflowed_step_leaves_the_dgc_velocity_as_before_it(make):
    # The velocity u = m*u + g took the inf in place and only the residual was rolled back:
    # with momentum correction every step after one overflow was non-finite.
    c = make()
    simulate([c], [torch.tensor([4.0, 3.0, 2.0, 1.0])])
    before = {k: v["bucket0"].clone() for k, v in c.state_dict().get("memory", c.state_dict())
              .items() if k in ("residual", "velocity")}
    simulate([c], [torch.tensor([float("inf"), 1.0, 1.0, 1.0])])
    after = c.state_dict().get("memory", c.state_dict())
    for k, v in before.items():
        assert torch.equal(after[k]["bucket0"], v), k
    assert all(bool(torch.isfinite(o).all()) for o in simulate([c], [torch.ones(4)]))
