"""``parlay plan`` prices the shard levels (issue 26): wire bytes, memory per rank, the
recommendation under ``--memory-per-rank``, size parsing and the command end to end."""
from __future__ import annotations

import dataclasses
import json

import pytest

from parlay.cli import main
from parlay.errors import ConfigError
from parlay.plan.model import ClusterSpec, Link, Workload
from parlay.plan.shard import recommend_shard, shard_levels, state_per_param
from parlay.plan.units import parse_size

pytestmark = pytest.mark.timeout(60)

W = Workload(params=1e9, batch=8, compute_s_per_sample=0.05, layers=100)
C4 = ClusterSpec(nodes=4, ranks_per_node=1, inter=Link(10e9))


@pytest.mark.parametrize("spec, k", [("sgd", 0), ("sgd:momentum=0.9", 1), ("adam", 2),
                                     ("AdamW", 2), ("adam:amsgrad=True", 3), ("adagrad", 1)])
def test_optimizer_state_is_measured(spec: str, k: int) -> None:
    assert state_per_param(spec) == k


def test_wire_bytes_follow_the_ring() -> None:
    by = {lv.level: lv for lv in shard_levels(W, C4, 2.0)}
    ddp = by["none"].wire_bytes
    assert ddp == pytest.approx(2 * 3 / 4 * 4e9)
    assert by["optimizer"].wire_bytes / ddp == pytest.approx(1.0)
    assert by["gradients"].wire_bytes / ddp == pytest.approx(1.0)
    # backward re-gathers all but the two units still held from forward (100 layers)
    assert by["parameters"].wire_bytes / ddp == pytest.approx(1 + 0.5 * 98 / 100)
    four = {lv.level: lv.wire_bytes
            for lv in shard_levels(dataclasses.replace(W, layers=4), C4, 2.0)}
    assert four["parameters"] / four["none"] == pytest.approx(1.25)  # measured 1.270 (4 hosts)
    # a 16-bit compressor halves the reduce-scatter (the gradients) only
    half = {lv.level: lv.wire_bytes for lv in shard_levels(W, C4, 2.0, "bf16")}
    assert half["none"] == pytest.approx(ddp / 2)
    assert half["optimizer"] == pytest.approx(ddp / 4 + ddp / 2)
    assert half["parameters"] == pytest.approx(ddp / 4 + ddp / 2 * (1 + 98 / 100))
    assert by["optimizer"].step_s == pytest.approx(by["none"].step_s)
    assert by["parameters"].step_s >= by["gradients"].step_s


def test_memory_per_level_for_adam() -> None:
    p = 4e9  # 1e9 fp32 parameters
    mem = {lv.level: lv.memory_bytes for lv in shard_levels(W, C4, state_per_param("adam"))}
    assert mem["none"] == pytest.approx(4 * p)            # P + G + 2P
    # P + G + (G + 2P)/4: the reduce-scatter's gradient chunk too (as the engine holds it)
    assert mem["optimizer"] == pytest.approx(2 * p + 3 * p / 4)
    assert mem["gradients"] == pytest.approx(p + 3 * p / 4)
    unit = p / 100  # one layer: gathered or prefetched, or a gradient bucket: 4 at the peak
    assert mem["parameters"] == pytest.approx(p + 4 * unit)


@pytest.mark.parametrize("gib, level", [(17, "none"), (11, "optimizer"), (8, "gradients"),
                                        (4, "parameters")])
def test_recommends_the_lowest_level_that_fits(gib: float, level: str) -> None:
    line = recommend_shard(shard_levels(W, C4, 2.0), gib * 2 ** 30, 4)
    assert (f"'{level}'" in line) if level != "none" else "DDP fits" in line


def test_nothing_fits_names_the_memory_and_ranks_needed() -> None:
    line = recommend_shard(shard_levels(W, C4, 2.0), 2 * 2 ** 30, 4)
    assert "error: nothing fits 2 GiB" in line and "'parameters' needs 3.87 GiB" in line
    assert "Hint: 9 ranks or more" in line


@pytest.mark.parametrize("text, n", [("8GiB", 8 * 2 ** 30), ("512MB", 512e6), ("16e9", 16e9),
                                     ("1.5 Gi", 1.5 * 2 ** 30), ("2048", 2048.0)])
def test_parse_size(text: str, n: float) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text, words", [("lots", "could not read"), ("8 parsecs", "unknown unit"),
                                         ("0GiB", "must be > 0")])
def test_bad_size_is_refused_with_a_hint(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as e:
        parse_size(text)
    assert "Hint: --memory-per-rank 8GiB" in str(e.value)


PLAN = ["plan", "--model-params", "1e9", "--batch", "8", "--nodes", "4", "--bandwidth",
        "10gbit", "--compute-ms", "400", "--layers", "100", "--no-calibrate", "--top", "1"]


def test_plan_recommends_a_shard_level(capsys) -> None:
    assert main([*PLAN, "--memory-per-rank", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "shard levels on 4 data-parallel ranks" in out and "1.49x" in out  # 1 + 0.5 * 98/100
    assert "shard: 'gradients'" in out and "shard='gradients'" in out
    # nothing fits: the table and the hint print, and the exit status says so (scripts)
    assert main([*PLAN, "--memory-per-rank", "1GiB", "--optimizer", "sgd"]) == 1
    assert "error: nothing fits 1 GiB" in capsys.readouterr().out
    assert main([*PLAN, "--json", "--memory-per-rank", "1GiB", "--optimizer", "sgd"]) == 1
    assert json.loads(capsys.readouterr().out)["shard"]["recommendation"] is None
    assert main(PLAN) == 0
    assert "shard" not in capsys.readouterr().out  # the default output is unchanged
    assert main([*PLAN, "--memory-per-rank", "lots"]) == 2
    assert "--memory-per-rank: could not read 'lots'" in capsys.readouterr().err


def test_plan_json_has_the_shard_levels(capsys) -> None:
    # SGD with momentum: P + G + P = 12e9 bytes (11.2 GiB); "optimizer": 9e9 (8.38 GiB)
    assert main([*PLAN, "--json", "--memory-per-rank", "10GiB", "--optimizer",
                 "sgd:momentum=0.9"]) == 0
    doc = json.loads(capsys.readouterr().out)["shard"]
    assert doc["ranks"] == 4 and doc["state_per_param"] == 1
    assert doc["recommendation"] == "optimizer"
    assert [lv["level"] for lv in doc["levels"]] == ["none", "optimizer", "gradients",
                                                     "parameters"]
    assert [lv["fits"] for lv in doc["levels"]] == [False, True, True, True]
