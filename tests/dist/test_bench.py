"""``parlay bench``: a tiny loopback run writes results.json, report.md and the plots; every
measured point carries what the cost model needs and its prediction; links that cannot be
simulated are skipped with one line; without matplotlib the command says how to install it."""
from __future__ import annotations

import json
import os

import pytest

import tools.cluster as cluster_mod
from parlay import cli
from tools.bench import plots, runner

pytestmark = pytest.mark.timeout(180)

_POINT_KEYS = ("params", "batch", "world", "workers", "hosts", "ranks_per_host", "link_bps",
               "compute_step_s", "mode", "compressor", "step_s", "samples_s", "of_limit",
               "predicted_step_s", "rel_err")
_PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run for the whole module: loopback, plus a link this machine 'cannot' build."""
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setattr(cluster_mod, "unavailable_reason", lambda: "needs root (test)")
    lines: list[str] = []
    try:
        doc = runner.run_suite(str(out), ["loopback", "100mbit"], model="tiny", steps=1,
                               budget=0.5, compressors=["fp16", "topk:0.01"],
                               accuracy_samples=256, log=lines.append)
    finally:
        mp.undo()
    return out, doc, lines


def test_writes_results_and_report(tiny_run):
    out, doc, lines = tiny_run
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["nets"] == ["loopback"]
    names = {(p["launch"], p["contestant"]) for p in on_disk["points"]}
    for want in ("compute", "ddp", "none", "fp16", "topk:0.01", "pipe:gpipe", "pipe:1f1b"):
        assert ("dp", want) in names
    for want in ("ps:sync", "ps:stale:2", "ps:async"):
        assert ("ps", want) in names
    for p in on_disk["points"]:
        assert p["net"] == "loopback" and p["link_bps"] is None
        assert p["step_s"] > 0 and p["samples_s"] > 0 and p["compute_step_s"] > 0
        assert p["of_limit"] == pytest.approx(p["samples_s"] / p["limit_samples_s"])
        assert all(k in p for k in _POINT_KEYS), sorted(set(_POINT_KEYS) - set(p))
    predicted = [p for p in on_disk["points"] if p["mode"] != "compute"]
    for p in predicted:  # the cost model's prediction next to every measured point
        assert p["predicted_step_s"] > 0
        assert p["rel_err"] == pytest.approx((p["predicted_step_s"] - p["step_s"]) / p["step_s"])
    s = on_disk["summary"]
    assert s["predicted_points"] == len(predicted)
    errs = sorted(abs(p["rel_err"]) for p in predicted)
    assert s["max_rel_err"] == pytest.approx(errs[-1])
    assert 0 <= s["order_pairs_right"] <= 1 and 0 <= s["fastest_first_right"] <= 1
    assert [r["net"] for r in s["recommendations"]] == ["loopback"]
    acc = {r["compressor"]: r for r in on_disk["accuracy"]}
    assert set(acc) == {"none", "fp16", "topk:0.01"}
    assert acc["topk:0.01"]["wire_bytes_per_step"] < acc["none"]["wire_bytes_per_step"] / 10
    stages = on_disk["timelines"]["loopback"]["1f1b"]
    assert [st["stage"] for st in stages] == [0, 1]
    assert all({e[0] for e in st["events"]} >= {"F", "B"} for st in stages)
    md = (out / "report.md").read_text()
    assert "| launch: contestant | loopback |" in md
    assert "| dp | fp16 |" in md and "predicted ms" in md and "MNIST accuracy" in md


def test_unavailable_link_skipped_with_one_line(tiny_run):
    _, doc, lines = tiny_run
    skipped = [ln for ln in lines if "skipped 100mbit" in ln]
    assert len(skipped) == 1 and "needs root (test)" in skipped[0]
    assert any("skipped 100mbit" in n for n in doc["notes"])


def test_plots_written(tiny_run):
    pytest.importorskip("matplotlib")
    out, doc, _ = tiny_run
    assert doc["plots"] == ["samples_per_s.png", "accuracy_vs_bytes.png",
                            "pipeline_timeline.png", "predicted_vs_measured.png"]
    for name in doc["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == _PNG and len(data) > 10_000, name
        assert f"]({name})" in (out / "report.md").read_text()


def test_without_matplotlib_says_how_to_install(tiny_run, tmp_path, monkeypatch):
    _, doc, _ = tiny_run
    monkeypatch.setattr(plots, "_plt", lambda: None)
    written, note = plots.write_all(doc, str(tmp_path))
    assert written == [] and os.listdir(tmp_path) == []
    assert 'pip install "parlay[bench]"' in note and "pip install matplotlib" in note


def test_cli_routes_suite_and_named_benchmarks(tmp_path, monkeypatch, capsys):
    for args in (["--net", "loopback,fast"], ["suite", "--net", "slow"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", *args, "--out", str(tmp_path)])
        assert e.value.code == 2 and "--net takes loopback" in capsys.readouterr().err
    # A NAME still runs benchmarks/NAME.py with the rest of the arguments, as before.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "echo.py").write_text(
        "import sys, pathlib\npathlib.Path('argv.txt').write_text(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr("sys.argv", ["parlay"])
    assert cli.main(["bench", "echo", "--quick", "--json", "x.json"]) == 0
    assert (tmp_path / "argv.txt").read_text() == "--quick --json x.json"
    parser = runner.build_parser()
    assert "benchmarks/NAME.py" in parser.format_help()


def test_from_results_predicts_again_without_measuring(tiny_run, tmp_path):
    doc = json.loads(json.dumps(tiny_run[1], default=str))  # a copy: the fixture is shared
    for p in doc["points"]:
        p["predicted_step_s"] = p["rel_err"] = None
    src = tmp_path / "old.json"
    src.write_text(json.dumps(doc, default=str))
    assert cli.main(["bench", "--from", str(src), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert [p["step_s"] for p in again["points"]] == [p["step_s"] for p in doc["points"]]
    assert all(p["predicted_step_s"] > 0 for p in again["points"] if p["mode"] != "compute")
    assert (tmp_path / "again" / "report.md").exists()


def test_outside_a_checkout_says_how_to_get_the_suite(monkeypatch, tmp_path, capsys):
    # An installed wheel has no tools/: the command says where the suite lives, not a traceback.
    monkeypatch.setattr(cli, "_checkout", lambda: None)
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tools/ of parlay's source checkout" in err
