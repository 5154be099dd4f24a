"""``parlay plan`` prices ``mode="diloco"``: per inner step, one fragment's exchange every
``H/P`` steps (``wire(model) / H`` bytes a step), hidden behind ``tau`` inner steps; the
smallest ``H`` reaching 90% of the compute; when to prefer it over data parallel."""
from __future__ import annotations

import json

import pytest

from parlay.cli import main
from parlay.errors import ConfigError
from parlay.plan import ClusterSpec, Costs, Link, Workload, link_bytes, predict, rank_configs
from parlay.plan.advise import ALL_MODES, diloco_advice
from parlay.plan.model import rounds_s
from parlay.plan.modes import (DILOCO_H, allreduce_terms, diloco_h, diloco_link_bytes,
                               diloco_terms)

pytestmark = pytest.mark.timeout(60)

W = Workload(params=1.3e6, batch=128, compute_s_per_sample=0.5e-3)  # 64 ms a step
SLOW = ClusterSpec(4, 1, Link(100e6), overlap=0.0)  # 4 hosts at 100 Mbit/s
C = Costs()


def _util(terms: dict[str, float]) -> float:
    return terms["compute"] / sum(terms.values())


def _exchange(numel: float, every: float) -> float:
    """One exchange of ``numel`` dense fp32 elements over the slow ring (the link rested for
    ``every`` inner steps)."""
    from parlay.plan.model import compressor_of

    rounds = compressor_of("none").wire_rounds(int(numel), None, 4)
    return rounds_s(rounds, 4, SLOW.inter, C, rested_s=W.compute_s * every)


def test_one_inner_step_per_round_is_data_parallel() -> None:
    dl = diloco_terms(W, SLOW, "none", C, sync_every=1)
    dp = allreduce_terms(W, SLOW, "none", C, bucket_bytes=1e12)  # one bucket, no overlap
    assert dl == pytest.approx(dp, rel=1e-12)


@pytest.mark.parametrize("h", [10, 50, 500])
def test_comm_per_step_is_one_exchange_over_h(h: int) -> None:
    terms = diloco_terms(W, SLOW, "none", C, sync_every=h)
    assert terms["comm"] == pytest.approx(_exchange(W.params, h) / h, rel=1e-12)
    assert terms["copies"] == pytest.approx(2 * W.grad_bytes * C.copy_s_per_byte / h)
    assert diloco_link_bytes(W, SLOW, "none", h) == link_bytes("none", W.params, 4) / h
    assert diloco_link_bytes(W, SLOW, "fp16", h) == pytest.approx(
        link_bytes("none", W.params, 4) / h / 2)


def test_fragments_and_overlap() -> None:
    h, p = 100, 4
    every = h / p
    one = _exchange(W.params / p, every)
    # no overlap: a fragment's exchange exposed once every H/P steps (as much as unstreamed)
    streamed = diloco_terms(W, SLOW, "none", C, sync_every=h, fragments=p)
    assert streamed["comm"] == pytest.approx(one / every, rel=1e-12)
    assert streamed["comm"] == pytest.approx(
        diloco_terms(W, SLOW, "none", C, sync_every=h)["comm"], rel=0.05)
    # tau inner steps hide tau x compute of it
    tau = 2
    hidden = diloco_terms(W, SLOW, "none", C, sync_every=h, fragments=p, overlap=tau)
    assert hidden["comm"] == pytest.approx(max(0.0, one - tau * W.compute_s) / every, rel=1e-12)
    assert hidden["comm"] < streamed["comm"]
    # hidden entirely: nothing exposed, utilisation 1 less the codec and copies
    full = diloco_terms(W, SLOW, "none", C, sync_every=h, fragments=p, overlap=every - 1)
    assert one < (every - 1) * W.compute_s and "comm" not in full
    # a slow link: the step is compute plus what tau steps do not hide, which keeps the
    # link's pace (one fragment per H/P steps) since tau < H/P
    tiny = ClusterSpec(4, 1, Link(1e6))
    paced = diloco_terms(W, tiny, "none", C, sync_every=40, fragments=4, overlap=9)
    assert paced["comm"] > 10 * paced["compute"]


def test_one_rank_has_no_communication() -> None:
    assert diloco_terms(W, ClusterSpec(1, 1, Link(1e6)), "none", C, sync_every=10) == \
        {"compute": W.compute_s}


def test_bounds_of_the_optimizer_are_refused() -> None:
    with pytest.raises(ConfigError, match="fragments <= sync_every"):
        diloco_terms(W, SLOW, "none", C, sync_every=4, fragments=8)
    with pytest.raises(ConfigError, match="overlap must be in"):
        diloco_terms(W, SLOW, "none", C, sync_every=10, fragments=2, overlap=5)
    # tau < H/P, as DiLoCoOptimizer takes it: 2 < 5/2 is priced (it was refused as >= 5 // 2)
    assert diloco_terms(W, SLOW, "none", C, sync_every=5, fragments=2, overlap=2)
    assert diloco_h(W, SLOW, "none", C, fragments=2, overlap=2, choices=(5,)) == 5
    with pytest.raises(ConfigError, match="no sync_every"):
        diloco_h(W, SLOW, "none", C, fragments=600)


def test_h_is_the_smallest_reaching_ninety_percent() -> None:
    h = diloco_h(W, SLOW, "none", C)
    assert _util(diloco_terms(W, SLOW, "none", C, h)) >= 0.9
    smaller = [x for x in DILOCO_H if x < h]
    assert smaller and all(_util(diloco_terms(W, SLOW, "none", C, x)) < 0.9 for x in smaller)
    # a compressor sends less: it gets there at a smaller (or equal) H
    assert diloco_h(W, SLOW, "fp16", C) <= h
    # a fast link: the smallest; a hopeless one: the largest
    assert diloco_h(W, ClusterSpec(4, 1, Link(100e9)), "none", C) == DILOCO_H[0]
    assert diloco_h(W, ClusterSpec(4, 1, Link(1e4)), "none", C) == DILOCO_H[-1]
    p = predict(W, SLOW, "diloco", "none", C)
    assert p.options == {"sync_every": h} and not p.exact and p.utilisation >= 0.9
    assert predict(W, SLOW, "diloco", "none", C, sync_every=50, fragments=5).label == \
        "diloco(50 sync_every, 5 fragments)"


def test_advice_prefers_diloco_only_when_communication_bounds_data_parallel() -> None:
    comps = ("none", "fp16")
    slow = rank_configs(W, SLOW, ALL_MODES, comps, C)
    assert all(p.exact or p.options.get("consistency") == "async"
               for p in slow if p.mode != "diloco")
    a = diloco_advice(slow, W, SLOW)
    assert a is not None and a["advised"] and a["utilisation"] >= 0.9
    assert a["data_parallel_utilisation"] < 0.9 and a["sync_every"] in DILOCO_H
    assert a["bytes_per_step"] * a["sync_every"] <= a["ddp_bytes_per_step"]
    assert "prefer diloco" in a["why"] and f"'sync_every': {a['sync_every']}" in a["why"]
    fast = ClusterSpec(4, 1, Link(400e9, efficiency=1.0))
    b = diloco_advice(rank_configs(W, fast, ALL_MODES, comps, C), W, fast)
    assert b is not None and not b["advised"] and b["why"].startswith("keep data parallel")
    assert diloco_advice(rank_configs(W, SLOW, ("allreduce",), comps, C), W, SLOW) is None


def test_command_end_to_end(capsys) -> None:
    base = ["plan", "--model-params", "1.3M", "--batch", "128", "--nodes", "4",
            "--bandwidth", "100mbit", "--compute-ms", "64", "--no-calibrate",
            "--compressors", "none,fp16"]
    assert main(base + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = [p for p in doc["predictions"] if p["mode"] == "diloco"]
    assert {p["compressor"] for p in rows} == {"none", "fp16"}
    assert all(0 < p["utilisation"] <= 1 for p in doc["predictions"])
    assert doc["diloco"]["advised"] and doc["diloco"]["sync_every"] in DILOCO_H
    assert doc["recommendation"]["mode"] != "diloco"  # the exact modes' best, as before
    assert main(base + ["--json", "--diloco-h", "50", "--diloco-fragments", "5",
                        "--diloco-overlap", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {json.dumps(p["options"]) for p in doc["predictions"] if p["mode"] == "diloco"} == \
        {json.dumps({"sync_every": 50, "fragments": 5, "overlap": 2})}
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "diloco(" in out and "\ndiloco: prefer diloco" in out
    assert main(base + ["--diloco-h", "50", "--diloco-fragments", "5",
                        "--diloco-overlap", "10"]) == 2
    assert "= [0, 10), got 10" in capsys.readouterr().err
    assert main(base + ["--modes", "allreduce", "--diloco-h", "50"]) == 2
    assert "which --modes allreduce leaves out" in capsys.readouterr().err


def test_diloco_at_one_inner_step_is_never_advised() -> None:
    # as much communication as data parallel: any predicted gain is noise, not a reason to
    # change the optimisation
    w, c = Workload(params=25e6, batch=64, compute_s_per_sample=0.5e-3), \
        ClusterSpec(4, 8, Link(100e6), overlap=0.0)
    rows = sorted((predict(w, c, m, comp, C, **({"sync_every": 1} if m == "diloco" else {}))
                   for m in ("allreduce", "diloco") for comp in ("none", "powersgd:4")),
                  key=lambda p: p.to_accuracy_s)
    assert rows[0].mode == "diloco"  # a hair ahead of powersgd data parallel, by the model
    a = diloco_advice(rows, w, c)
    assert a is not None and not a["advised"], a["why"]


def test_diloco_fragments_beyond_the_models_tensors_are_refused_as_the_optimizer_does() -> None:
    w = Workload(1e6, 64, 1e-3, shapes=((100, 100), (100,)) * 3)
    c = ClusterSpec(4, 1, Link(10e6))
    assert predict(w, c, "diloco", sync_every=60, fragments=6).step_s > 0
    with pytest.raises(ConfigError, match="fragments=10 needs at least as many parameter "
                                          "tensors; the model has 6"):
        predict(w, c, "diloco", sync_every=100, fragments=10)  # advised, then refused
