"""A compressor registered only here trains in every mode and is priced by ``parlay plan``.

The toy sends each rank's bucket as bfloat16 and is *not* summable (its payloads are gathered
and summed after decoding), so it takes the allgather path of the data-parallel reduction, a
parameter-server push with its context carried as plain values, and hybrid mode's data-parallel
groups; it describes its own wire and codec cost, so the cost model prices it with no other
file knowing its name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.compress import Compressor, Round, register
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

NAME = "toy-gather16"
CALLS = {"compress": 0, "decode": 0}


@dataclass(frozen=True)
class _Ctx:
    dtype: torch.dtype


class Toy(Compressor):
    """Each rank's bucket as bfloat16, gathered and summed after decoding."""

    name = NAME
    summable = False
    cost_fields = ("cast_s_per_elem",)

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        CALLS["compress"] += 1
        return [flat.to(torch.bfloat16)], _Ctx(flat.dtype)

    def decompress(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor:
        CALLS["decode"] += 1
        return payload[0].to(ctx.dtype)

    def wire_rounds(self, numel, shapes=None, bytes_per_element=4):
        return [Round("allgather", numel * 2)]

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        return numel * costs.cast_s_per_elem * world


@dataclass(frozen=True)
class _Scaled:
    dtype: torch.dtype
    scale: float


class ScaledToy(Toy):
    """Each rank's bucket divided by its own largest magnitude, in float16: the scale, which
    differs per rank, lives in the context (as the protocol allows)."""

    name = NAME + "-scaled"

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        scale = float(flat.abs().max()) or 1.0
        return [(flat / scale).half()], _Scaled(flat.dtype, scale)

    def decompress(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor:
        return payload[0].to(ctx.dtype) * ctx.scale


def _register() -> None:
    register(NAME, Toy)
    register(ScaledToy.name, ScaledToy)


def _build():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3)), nn.MSELoss())


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 3, generator=g))


def _train(mode: str, options: dict, name: str = NAME) -> dict:
    _register()
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=4, num_epochs=2, mode=mode,
                       progress=False, compression=name, strategy_options=options)
    while not t.should_stop():
        t.train_on_batch()
    state = t.strategy.pipe.state_dict() if mode == "hybrid" else t.model.state_dict()
    return dict(role=parlay.role(), calls=dict(CALLS),
                state={k: v.detach().clone() for k, v in state.items()})


def _check_trained(state: dict) -> None:
    torch.manual_seed(0)
    start = _build()[0].state_dict()
    for k, v in state.items():
        assert torch.isfinite(v).all(), k
    assert any(not torch.equal(v, start[k]) for k, v in state.items() if k in start)


def test_toy_trains_in_allreduce_mode():
    a, b = run_world(_train, 2, "allreduce", {})
    assert a["calls"]["compress"] > 0 and a["calls"]["decode"] >= 2 * a["calls"]["compress"]
    for k in a["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], rtol=0, atol=0)
    _check_trained(a["state"])


def _scaled_and_dense() -> tuple[dict, dict]:
    return _train("allreduce", {}, ScaledToy.name), _train("allreduce", {}, "none")


def test_a_context_that_differs_per_rank_decodes_each_rank_s_payload():
    # each rank's payload is decoded with its sender's scale: the replicas agree and follow
    # dense training (decoded with the local scale, they parted and drifted)
    (a, dense), (b, _) = run_world(_scaled_and_dense, 2)
    for k in a["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], rtol=0, atol=0)
        torch.testing.assert_close(a["state"][k], dense["state"][k], rtol=0, atol=2e-3)


def test_toy_trains_in_ps_mode():
    server, w1, w2 = run_world(_train, 3, "ps", {"consistency": "sync"},
                               env={"PARLAY_NUM_PS": "1"})
    assert server["role"] == "ps" and server["calls"]["decode"] > 0  # decoded on the server
    assert w1["calls"]["compress"] > 0 and w2["calls"]["compress"] > 0
    for k in server["state"]:
        torch.testing.assert_close(w1["state"][k], server["state"][k], rtol=0, atol=0)
        torch.testing.assert_close(w2["state"][k], server["state"][k], rtol=0, atol=0)
    _check_trained(server["state"])


def test_toy_trains_in_hybrid_mode():
    out = run_world(_train, 4, "hybrid", {"pp": 2, "chunks": 2})
    assert all(r["calls"]["compress"] > 0 for r in out)
    by_stage: dict[tuple, list[dict]] = {}
    for r in out:
        by_stage.setdefault(tuple(sorted(r["state"])), []).append(r["state"])
    assert len(by_stage) == 2 and all(len(v) == 2 for v in by_stage.values())
    for a, b in by_stage.values():  # the two replicas of each stage agree
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    merged = {k: v for states in by_stage.values() for k, v in states[0].items()}
    _check_trained(merged)


def test_parlay_plan_prices_the_toy(capsys):
    from parlay.cli import main
    from parlay.plan import ClusterSpec, Costs, Link, Workload, predict

    _register()
    w = Workload(params=10e6, batch=32, compute_s_per_sample=1e-3)
    c = ClusterSpec(nodes=2, ranks_per_node=1, inter=Link(1e9))
    costs = Costs()
    p = predict(w, c, "allreduce", NAME, costs)
    assert p.terms["codec"] == pytest.approx(10e6 * costs.cast_s_per_elem * 2)
    # half the bytes of dense, gathered: one allgather of 20 MB per rank over 2 ranks
    dense = predict(w, c, "allreduce", "none", costs)
    assert p.terms["comm"] < dense.terms["comm"]
    assert predict(w, c, "ps", NAME, costs).terms["push"] < predict(w, c, "ps", "none",
                                                                   costs).terms["push"]
    with pytest.raises(parlay.errors.ConfigError, match="summable"):
        predict(w, ClusterSpec(2, 2, Link(1e9)), "hierarchical", NAME, costs)
    assert main(["plan", "--model-params", "10e6", "--batch", "32", "--compute-ms", "32",
                 "--nodes", "2", "--bandwidth", "1gbit", "--modes", "allreduce,ps",
                 "--compressors", f"none,{NAME}", "--no-calibrate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    mine = [r for r in doc["predictions"] if r["compressor"] == NAME]
    assert {r["mode"] for r in mine} == {"allreduce", "ps"}, doc
    assert all(r["terms"]["codec"] > 0 for r in mine)
