"""The pipeline stage count travels explicitly: ``parlay run --pp`` exports ``PARLAY_PP``, read
once by the env layer into ``ClusterEnv.pipeline_stages``; mode="hybrid" takes its default from
the runtime's cluster, and the demo gets ``--pp`` as an explicit option."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import parlay
import parlay.launch
from parlay.cli import main
from parlay.env import ClusterEnv, detect, pipeline_stages
from parlay.errors import ConfigError

SRC = Path(parlay.__file__).resolve().parent


def test_detect_reads_parlay_pp_into_the_cluster_env():
    assert detect({}).pipeline_stages is None and pipeline_stages({}) is None
    assert detect({"PARLAY_PP": "4"}).pipeline_stages == 4
    assert pipeline_stages({"PARLAY_PP": " 2 "}) == 2
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                "MASTER_PORT": "29400", "PARLAY_PP": "2"}
    assert detect(torchrun).pipeline_stages == 2


@pytest.mark.parametrize("raw, match", [("two", "PARLAY_PP: expected an integer"),
                                        ("0", "PARLAY_PP: expected an integer >= 1")])
def test_a_bad_parlay_pp_is_a_config_error(raw, match):
    with pytest.raises(ConfigError, match=match):
        detect({"PARLAY_PP": raw})


def test_cluster_env_checks_pipeline_stages():
    with pytest.raises(ConfigError, match="pipeline_stages: expected None or an int >= 1"):
        ClusterEnv(0, 1, 0, 1, "127.0.0.1", None, "single", pipeline_stages=0)
    with pytest.raises(ConfigError, match="pipeline_stages: expected an int"):
        ClusterEnv(0, 1, 0, 1, "127.0.0.1", None, "single", pipeline_stages=2.0)  # type: ignore


def test_only_the_env_layer_reads_parlay_pp():
    reads = re.compile(r"environ(\.get\(|\[)\s*\"PARLAY_PP\"")
    readers = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               if reads.search(p.read_text(encoding="utf-8")) or
               ('"PARLAY_PP"' in p.read_text(encoding="utf-8") and p.name not in ("cli.py",))]
    assert readers == ["discovery.py"], readers


def test_hybrid_takes_the_launch_stage_count_unless_given():
    from parlay.strategies import get_strategy

    parlay.init(backend="gloo", environ={"PARLAY_PP": "3"})
    try:
        assert parlay.cluster().pipeline_stages == 3
        assert get_strategy("hybrid", compression=None, precision="fp32", grad_clip=None).pp == 3
        given = get_strategy("hybrid", compression=None, precision="fp32", grad_clip=None, pp=1)
        assert given.pp == 1
    finally:
        parlay.shutdown()
    plain = get_strategy("hybrid", compression=None, precision="fp32", grad_clip=None)
    assert plain.pp == 2                         # no launch information: the default


@pytest.fixture
def launches(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(parlay.launch, "run_torchrun",
                        lambda argv, run_dir, own_id=None: calls.append(argv) or 0)
    return calls


def test_demo_gets_pp_as_an_explicit_option(launches):
    assert main(["demo", "mnist", "-n", "4", "--pp", "2", "--mode", "hybrid"]) == 0
    assert main(["demo", "mnist", "-n", "4", "--pp", "2", "--mode", "hybrid",
                 "--option", "pp=2"]) == 0
    first, second = launches
    assert first[-2:] == ["--option", "pp=2"]
    assert second.count("--option") == 1          # an explicit option is not repeated


def test_parlay_env_shows_the_launch_stage_count(monkeypatch, capsys):
    import json

    monkeypatch.setenv("PARLAY_PP", "2")
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline_stages"] == 2
