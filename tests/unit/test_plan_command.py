"""``parlay plan``: the command, its refusals, calibration caching and profiling the user's
own model or script."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

from parlay.cli import main
from parlay.plan.units import format_count

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
    monkeypatch.setenv("PARLAY_CACHE_DIR", str(path))  # a file: the cache cannot be written
    with pytest.warns(UserWarning, match="cannot cache the calibration"):
        assert cal.calibrate(budget_s=0.05, links=False, numel=1 << 14).flops > 0


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
    # the ReLUs hold no parameters: a stage of one alone is refused by the Trainer, so they
    # were counted as layers and plan recommended stages the Trainer refuses
    assert prof.batch == 16 and prof.layers == 3 and prof.compute_s_per_sample > 0
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
    # the shapes profiled here, the step a GPU takes: --compute-ms was silently ignored
    argv = ["plan", "--script", str(script), "--nodes", "2", "--bandwidth", "1gbit",
            "--no-calibrate", "--compute-ms", "500", "--modes", "allreduce"]
    assert main(argv) == 0 and "compute 500 ms per step" in capsys.readouterr().out
    assert main([*argv, "--model-params", "7e9"]) == 2
    assert "--script counts the model's parameters itself" in capsys.readouterr().err
    assert main(["plan", "--script", "/no/such/train.py", "--bandwidth", "1gbit",
                 "--no-calibrate"]) == 2
    err = capsys.readouterr().err
    assert "--script: no file" in err and "Hint" in err


def test_plan_script_runs_as_python_would_and_shows_its_own_failure(tmp_path, capsys) -> None:
    # Its folder on sys.path (a sibling module), and a failing exit with the script's message.
    (tmp_path / "netdef.py").write_text("import torch.nn as nn\n"
                                        "def net(): return nn.Linear(20, 10)\n")
    script = tmp_path / "train.py"
    script.write_text("import argparse\nfrom netdef import net\n"
                      "ap = argparse.ArgumentParser(); ap.add_argument('--lr', required=True)\n"
                      "ap.parse_args()\n" + SCRIPT.replace(
                          "nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))",
                          "net()"))
    argv = ["plan", "--script", str(script), "--bandwidth", "1gbit", "--no-calibrate"]
    assert main([*argv, "--", "--lr", "0.1"]) == 0
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "failed (exit 2)" in err and "the following arguments are required: --lr" in err


def test_plan_script_that_never_steps_is_explained(tmp_path, capsys) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("print('no training here')\n")
    assert main(["plan", "--script", str(script), "--bandwidth", "1gbit", "--no-calibrate"]) == 2
    assert "optimizer step" in capsys.readouterr().err


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


def test_plan_compressor_options_after_a_comma_stay_with_their_spec(capsys) -> None:
    argv = [*ISSUE, "--no-calibrate", "--json", "--compressors", "none,topk:0.01,compact=1"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {p["compressor"] for p in doc["predictions"]} >= {"none", "topk:0.01,compact=1"}


def test_plan_json_is_ranked(capsys) -> None:
    assert main([*ISSUE, "--no-calibrate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # ranked by time to accuracy (step x convergence factor); no factor: last, by step
    ranked = [p for p in doc["predictions"] if p["to_accuracy_s"] is not None]
    rest = doc["predictions"][len(ranked):]
    assert ranked and all(p["to_accuracy_s"] == pytest.approx(p["step_s"] * p["factor"])
                          for p in ranked)
    assert [p["to_accuracy_s"] for p in ranked] == sorted(p["to_accuracy_s"] for p in ranked)
    assert all(p["to_accuracy_s"] is None for p in rest)
    assert [p["step_s"] for p in rest] == sorted(p["step_s"] for p in rest)
    assert doc["recommendation"]["mode"] in ("allreduce", "hierarchical", "ps", "hybrid")
    assert doc["recommendation"]["factor"] >= 1.0
    assert main([*ISSUE, "--no-calibrate", "--json", "--top", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"] == doc["predictions"][:2]


@pytest.mark.parametrize("change, words", [
    ({"--bandwidth": "0"}, ["--bandwidth must be > 0", "Hint"]),
    ({"--bandwidth": "0mbit"}, ["--bandwidth must be > 0", "Hint: --bandwidth 10gbit"]),
    ({"--bandwidth": "1e30gbit"}, ["--bandwidth must be from 1kbit to 1000tbit", "10gbit"]),
    ({"--bandwidth": "10 parsecs"}, ["unknown unit", "10gbit"]),
    ({"--intra-bandwidth": "0"}, ["--intra-bandwidth must be > 0"]),
    ({"--latency": "fast"}, ["latency", "50us"]),
    ({"--latency": "1e9s"}, ["--latency must be from 0 to 10 s", "50us"]),
    ({"--nodes": "0"}, ["--nodes", ">= 1"]),
    ({"--nodes": "100e6"}, ["--nodes", "at most 1,000,000", "'100e6'", "Hint: --nodes 1000000"]),
    ({"--gpus-per-node": "1e5"}, ["--nodes 16 x --gpus-per-node 100000", "1,600,000 ranks",
                                   "Hint: --nodes 10 or fewer"]),
    ({"--batch": "0"}, ["--batch", ">= 1"]),
    ({"--batch": "1e12"}, ["--batch", "at most 100,000,000"]),
    ({"--model-params": "lots"}, ["--model-params", "25e6"]),
    ({"--model-params": "1e30"}, ["--model-params must be from 1 to 1e13", "'1e30'", "25e6"]),
    ({"--compute-ms": "1e30"}, ["--compute-ms must be from 0 to one hour", "--compute-ms 120"]),
    ({"--overlap": "2"}, ["--overlap must be a number from 0 to 1", "--overlap 1"]),
    ({"--burst": "1e20"}, ["--burst must be from 1 byte to 1 TB", "125k"]),
    ({"--burst": "125 parsecs"}, ["--burst: unknown unit", "KiB"]),
    ({"--modes": "allreduce", "--stages": "4", "--chunks": "8"}, [  # both were ignored
        "--stages, --chunks price mode hybrid, which --modes allreduce leaves out"]),
    ({"--modes": "allreduce,hybrid", "--servers": "2"}, ["--servers prices mode ps"]),
    ({"--modes": "hierarchical", "--gpus-per-node": "1"}, [  # the reason was empty
        "no combination of --modes hierarchical", "several ranks each", "Hint"]),
    ({"--top": "-1"}, ["--top must be an integer >= 0", "Hint: --top 0"]),
    ({"--compressors": "zip"}, ["unknown compression 'zip'", "topk:0.01"]),
    ({"--compressors": ","}, ["--compressors each need at least one name", "Hint"]),
    ({"--compressors": "none,auto"}, ["--compressors 'auto'", "prices its candidates"]),
    ({"--modes": "bogus"}, ["mode must be one of allreduce", "'bogus'"]),
    ({"--stages": "8", "--layers": "4"}, ["--stages 8", "4 layers", "Hint"]),
    ({"--stages": "3"}, ["--stages 3", "divide"]),
    ({"--stages": "1e9"}, ["--stages", "at most 1,024"]),
    ({"--chunks": "1e9"}, ["--chunks", "at most 4,096"]),
    ({"--batch": "1", "--chunks": "16"}, ["16 micro-batches", "Hint: --chunks"]),
])
def test_plan_refuses_impossible_inputs(change: dict, words: list, capsys) -> None:
    argv = list(ISSUE) + ["--no-calibrate"]
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("parlay plan: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_plan_global_batch_smaller_than_replicas(capsys) -> None:
    argv = [a for a in ISSUE if a not in ("--batch", "64")]
    assert main([*argv, "--global-batch", "64", "--no-calibrate"]) == 2
    assert "smaller than the 128 replicas" in capsys.readouterr().err


def test_plan_refusal_from_the_shell_is_one_line_exit_2() -> None:
    """The console script itself: one line on stderr, exit status 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "parlay.cli", *ISSUE, "--model-params",
                           "1e30", "--no-calibrate"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "--model-params" in proc.stderr


@pytest.mark.parametrize("extra", [
    ["--model-params", "1e13", "--bandwidth", "1kbit", "--latency", "10s"],  # the largest model
    ["--nodes", "1000", "--gpus-per-node", "1000"],                        # the largest cluster
    ["--compute-ms", "3600000", "--batch", "100e6"],                        # the slowest step
])
def test_plan_never_answers_zero_samples_per_s_in_range(extra: list, capsys) -> None:
    assert main([*ISSUE, *extra, "--no-calibrate", "--modes", "allreduce,ps", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(0 < p["samples_per_s"] < math.inf and 0 < p["step_s"] < math.inf
               for p in doc["predictions"])
    assert main([*ISSUE, *extra, "--no-calibrate", "--modes", "allreduce,ps"]) == 0
    table = capsys.readouterr().out
    for p in doc["predictions"]:  # each rate shown with its significant digits, never "0"
        shown = format_count(p["samples_per_s"])
        assert float(shown.replace(",", "")) > 0 and f"  {shown}  " in table, shown


def test_plan_reads_compute_ms_and_burst_in_every_spelling(capsys) -> None:
    # --compute-ms 1.2e2 was read as 120 *seconds*; --burst 125KiB was refused
    for ms in ("120", "1.2e2", "0.12s"):
        assert main([*ISSUE, "--compute-ms", ms, "--burst", "125KiB", "--no-calibrate"]) == 0
        assert "compute 120 ms per step" in capsys.readouterr().out, ms


def test_plan_json_stays_json_when_the_step_takes_no_time(capsys) -> None:
    argv = ["plan", "--model-params", "25e6", "--batch", "64", "--bandwidth", "10gbit",
            "--compute-ms", "0", "--no-calibrate", "--json"]
    assert main(argv) == 0  # one process: a step of 0 s printed samples/s as Infinity
    doc = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c))
    assert all(p["samples_per_s"] is None for p in doc["predictions"] if not p["step_s"])


def test_plan_into_a_closed_pipe_exits_quietly() -> None:
    # `parlay plan ... | head` printed a BrokenPipeError traceback (the reader here has left
    # before the plan is printed)
    proc = subprocess.run(f"{sys.executable} -m parlay {' '.join(ISSUE)} --no-calibrate | true",
                          shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
