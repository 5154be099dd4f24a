"""benchmarks/: shard_memory counts the unit
shard="parameters" holds gathered after a step; bad --rounds/--steps/--models/--stages are
refused in one line at once; the docs name parlay bench's real --budget floor."""
from __future__ import annotations

import os
import sys

import pytest

from parlay.testing import run_world

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
import dp_throughput  # noqa: E402
import pipeline  # noqa: E402
import shard_memory  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _refused(parse, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("argv, words", [
    (["--models", "tiny", "--rounds", "0"], ["--rounds/--steps must be at least 1, got 0"]),
    (["--steps", "-3"], ["--rounds/--steps must be at least 1, got -3", "Hint"]),
    (["--models", "small,foo"], ["--models: unknown 'foo'", "tiny"]),
    (["--rows", "shard", "--worlds", "1"], ["--worlds", "at least 2", "Hint: --worlds 2,4"]),
])
def test_dp_throughput_refuses_bad_options(argv, words, capsys) -> None:
    err = _refused(dp_throughput.parse_args, argv, capsys)
    for word in words:
        assert word in err, (word, err)


def test_dp_throughput_has_rounds_for_every_model() -> None:
    assert dp_throughput.parse_args(["--models", "tiny"]).rounds is None  # then the default
    assert dp_throughput.parse_args(["--steps", "7"]).rounds == 7
    assert [dp_throughput.default_rounds(m, False) for m in ("small", "big")] == [120, 48]
    assert [dp_throughput.default_rounds(m, True) for m in ("small", "big")] == [24, 12]
    assert all(dp_throughput.default_rounds(m, q) >= 1
               for m in dp_throughput.MODELS for q in (False, True))


def test_pipeline_refuses_one_stage(capsys) -> None:
    err = _refused(pipeline.parse_args, ["--stages", "2,1"], capsys)
    assert "--stages" in err and "at least 2" in err and "Hint: --stages 2,4" in err
    assert pipeline.parse_args(["--stages", "2,4"]).stages == "2,4"


def test_shard_parameters_counts_the_unit_gathered_for_the_next_forward() -> None:
    widths = shard_memory.MODELS["tiny"][0]
    units = [a * b + b for a, b in zip(widths[:-1], widths[1:])]  # one per Linear
    chunks = sum(-(-n // 2) for n in units) * 4  # this rank's fp32 chunk of each unit
    first = -(-units[0] // 2) * 2 * 4  # the first Linear's whole unit, padded to 2 chunks
    for r in run_world(shard_memory._count_rank, 2, "parameters", "tiny", timeout=100):
        assert r["params"] == chunks + first, r


def test_budget_floor_in_the_docs_is_the_one_checked(tmp_path, capsys) -> None:
    """A sub-second budget is a valid quick run (a point whose first step outlasts it is
    measured by that step): the checks and docs/benchmarks.md both put the floor at 0.001 s."""
    from tools.bench.inputs import check_inputs
    from tools.bench.runner import build_parser

    ap = build_parser()
    check_inputs(ap, ap.parse_args(["--budget", "0.5", "--no-accuracy", "--out", str(tmp_path)]))
    ns = ap.parse_args(["--budget", "0.0005", "--no-accuracy", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        check_inputs(ap, ns)
    assert "--budget must be a number >= 0.001" in capsys.readouterr().err
    with open(os.path.join(_ROOT, "docs", "benchmarks.md")) as f:
        doc = " ".join(f.read().split())
    assert "a `--budget` below 0.001 s" in doc and "`--steps`/`--budget`/" not in doc
