"""``parlay plan``: the command, its refusals, calibration caching and profiling the user's
own model or script."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn as nn

from parlay.cli import main
from parlay.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ calibration
def test_calibration_is_cached_per_machine(tmp_path, monkeypatch) -> None:
    from parlay.plan import calibrate as cal

    monkeypatch.setenv("PARLAY_CACHE_DIR", str(tmp_path))
    assert cal.load_costs(calibrate_if_missing=False) is None
    t0 = time.perf_counter()
    first = cal.calibrate(budget_s=0.05, links=False, numel=1 << 14)
    assert time.perf_counter() - t0 < 10
    path = cal.cache_path()
    assert path.parent == tmp_path and path.name.startswith("plan-") and path.exists()
    again = cal.load_costs(calibrate_if_missing=False)
    assert again is not None and again.costs == first.costs and again.flops == first.flops
    assert all(v >= 0 for v in json.loads(path.read_text())["costs"].values())
    monkeypatch.setattr(cal.socket, "gethostname", lambda: "another-host")
    assert cal.cache_path() != path  # another machine never reuses these numbers
    monkeypatch.undo()
    monkeypatch.setenv("PARLAY_CACHE_DIR", str(tmp_path))
    path.write_text("{not json")
    assert cal.load_costs(calibrate_if_missing=False) is None


# ------------------------------------------------------------------ profiling
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def test_profile_model_reads_size_batch_and_layers() -> None:
    from parlay.plan.profile import profile_model

    model = _mlp()
    prof = profile_model(model, (torch.randn(16, 20), torch.randint(0, 10, (16,))),
                         nn.functional.cross_entropy)
    assert prof.params == sum(p.numel() for p in model.parameters())
    assert prof.batch == 16 and prof.layers == 5 and prof.compute_s_per_sample > 0
    assert prof.activation_numel == 32  # median of 64, 64, 32, 32, 10
    assert prof.workload().shapes == tuple(tuple(p.shape) for p in model.parameters())


SCRIPT = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000):
    x, y = torch.randn(8, 20), torch.randint(0, 10, (8,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
raise SystemExit("ran to the end: parlay plan should have stopped it")
"""


def test_plan_script_profiles_the_users_own_training_script(tmp_path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rc = main(["plan", "--script", str(script), "--nodes", "2", "--bandwidth", "1gbit",
               "--no-calibrate", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert any("1,994 parameters, batch 8" in n for n in doc["notes"])
    assert doc["predictions"] and doc["recommendation"]["step_s"] > 0


def test_plan_script_that_never_steps_is_explained(tmp_path) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("print('no training here')\n")
    with pytest.raises(ConfigError, match="optimizer step"):
        main(["plan", "--script", str(script), "--bandwidth", "1gbit", "--no-calibrate"])


# ------------------------------------------------------------------ the command
ISSUE = ["plan", "--model-params", "25e6", "--batch", "64", "--nodes", "16", "--gpus-per-node",
         "8", "--bandwidth", "10gbit", "--latency", "50us", "--compute-ms", "120"]


def test_plan_prints_every_mode_and_a_recommendation_fast(capsys) -> None:
    t0 = time.perf_counter()
    assert main([*ISSUE, "--no-calibrate"]) == 0
    assert time.perf_counter() - t0 < 5
    out = capsys.readouterr().out
    for word in ("allreduce", "hierarchical", "ps(sync", "hybrid(", "topk:0.01", "powersgd:4",
                 "fp16", "samples/s", "recommended:", "dominant"):
        assert word in out, word
    assert "is " in out.split("recommended:")[1] and "% of its step" in out


def test_plan_json_is_ranked(capsys) -> None:
    assert main([*ISSUE, "--no-calibrate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    steps = [p["step_s"] for p in doc["predictions"]]
    assert steps == sorted(steps)
    assert doc["recommendation"]["mode"] in ("allreduce", "hierarchical", "ps", "hybrid")


@pytest.mark.parametrize("change, words", [
    ({"--bandwidth": "0"}, ["bandwidth must be > 0", "Hint"]),
    ({"--bandwidth": "0mbit"}, ["bandwidth must be > 0"]),
    ({"--bandwidth": "10 parsecs"}, ["unknown unit", "10gbit"]),
    ({"--latency": "fast"}, ["latency", "50us"]),
    ({"--nodes": "0"}, ["--nodes", ">= 1"]),
    ({"--batch": "0"}, ["--batch", ">= 1"]),
    ({"--model-params": "lots"}, ["--model-params", "25e6"]),
    ({"--stages": "8", "--layers": "4"}, ["--stages 8", "4 layers", "Hint"]),
    ({"--stages": "3"}, ["--stages 3", "divide"]),
    ({"--batch": "1", "--chunks": "16"}, ["16 micro-batches", "Hint: --chunks"]),
])
def test_plan_refuses_impossible_inputs(change: dict, words: list) -> None:
    argv = list(ISSUE) + ["--no-calibrate"]
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    with pytest.raises(ConfigError) as e:
        main(argv)
    assert isinstance(e.value, SystemExit) and str(e.value.code).startswith("parlay plan: ")
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_plan_global_batch_smaller_than_replicas() -> None:
    argv = [a for a in ISSUE if a not in ("--batch", "64")]
    with pytest.raises(ConfigError, match="smaller than the 128 replicas"):
        main([*argv, "--global-batch", "64", "--no-calibrate"])
