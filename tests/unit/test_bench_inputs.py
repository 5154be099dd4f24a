"""``parlay bench`` refuses what it cannot run in one line naming the input and the fix (exit
status 2), before anything is measured or written: never a traceback, never minutes of waiting.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from parlay import cli

pytestmark = pytest.mark.timeout(60)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", (e.value.code, out)
    assert err.count("\n") == 1 and err.startswith("parlay bench: "), err
    return err


@pytest.mark.parametrize("argv, words", [
    (["--net", "0mbit"], ["--net 0mbit", "10mbit to 100gbit", "Hint: --net 100mbit"]),
    (["--net", "1gbit,-5mbit"], ["--net takes loopback", "'-5mbit'"]),
    (["--net", "1tbit"], ["--net takes loopback", "100mbit or 1gbit"]),
    (["--net", ","], ["--net needs at least one link", "Hint: --net loopback"]),
    (["--steps", "0"], ["--steps must be a number >= 1, got 0", "Hint"]),
    (["--steps", "many"], ["argument --steps", "'many'", "parlay bench --help"]),
    (["--budget", "-1"], ["--budget must be a number >= 0.001", "Hint"]),
    (["--budget", "nan"], ["--budget must be a number", "got nan"]),
    (["--accuracy-samples", "0"], ["--accuracy-samples must be a number >= 1"]),
    (["--compressors", "zip"], ["--compressors", "unknown compression 'zip'"]),
    (["--data", "{tmp}"], ["--data", "lacks train-images-idx3-ubyte.gz", "--no-accuracy"]),
])
def test_suite_refuses_bad_options(argv, words, tmp_path, capsys) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    err = _refused([*argv, "--out", str(tmp_path / "out")], capsys)
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_out_and_from_refused_in_one_line(tmp_path, capsys) -> None:
    a_file = tmp_path / "results.json"
    a_file.write_text("{")
    not_results = tmp_path / "other.json"
    not_results.write_text(json.dumps({"benchmark": "compression", "results": []}))
    out = str(tmp_path / "o")
    for argv, words in [
        (["--out", str(a_file)], ["--out", "is a file; it must be a folder", "Hint"]),
        (["--out", str(a_file / "sub")], ["--out", "cannot be written", "Hint"]),
        (["--from", str(tmp_path / "missing.json"), "--out", out],
         ["--from", "cannot be read as JSON (No such file or directory)", "Hint"]),
        (["--from", str(a_file), "--out", out], ["--from", "cannot be read as JSON", "Hint"]),
        (["--from", str(not_results), "--out", out],
         ["--from", "is not a parlay bench results.json", "Hint"]),
        (["--from", str(tmp_path), "--out", out], ["--from", "cannot be read as JSON"]),
        (["--quick"], ["the following arguments are required: --out", "parlay bench --help"]),
    ]:
        err = _refused(argv, capsys)
        for word in words:
            assert word in err, (word, err)


def test_unknown_benchmark_is_one_line_listing_the_known_ones(capsys) -> None:
    assert cli.main(["bench", "no_such_benchmark"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no benchmark benchmarks/no_such_benchmark.py" in err
    assert "compression" in err and "convergence" in err


def test_zero_rate_from_the_shell_is_one_line_at_once(tmp_path) -> None:
    """The issue's case: ``parlay bench --net 0mbit`` ran for minutes; now it is refused."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "parlay.cli", "bench", "--net", "0mbit",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - t0 < 30
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["parlay bench: --net 0mbit: a simulated link runs at "
                                        "10mbit to 100gbit. Hint: --net 100mbit"]
