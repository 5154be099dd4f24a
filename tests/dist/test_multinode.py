"""Real multi-node runs: 2 simulated hosts x 2 local ranks, launched with ``parlay run --nnodes``.

Each host is a network namespace of :class:`tools.cluster.Cluster`; each runs
``parlay run -n 2 --nnodes 2 --node-rank K --rdzv-endpoint <host 0>:PORT`` exactly as a user
would on two machines, and the ranks talk over the bridge (gloo on the hosts' ``eth0``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.cluster import Cluster, unavailable_reason

from tests.dist import multinode_train as script

_WHY = unavailable_reason()
pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(_WHY is not None, reason=f"simulated cluster: {_WHY}")]
ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-10, atol=1e-10)


def launch(cluster: Cluster, target: list[str], flags: tuple[str, ...] = (),
           timeout: float = 75) -> list[str]:
    """``parlay run`` on every host of ``cluster``; returns each host's stdout."""
    procs = cluster.parlay_run(target, nproc_per_host=2, flags=flags,
                               env={"PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=-1, stderr=-1,
                               text=True)
    outs = []
    for k, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"host {k} failed ({p.returncode}):\n{out}\n{err[-4000:]}"
        outs.append(out + err)
    return outs


def _ranks(out: Path) -> dict[int, dict]:
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}


def _assert_equal(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(params) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(params[name], ref[name], **TOL, msg=name)


def test_parlay_env_on_each_host_names_rank_local_rank_and_node():
    with Cluster(hosts=2) as c:
        outs = launch(c, ["-m", "parlay.cli", "env", "--json"])
    for host, out in enumerate(outs):
        infos = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")),
                       key=lambda i: i["rank"])
        got = [(i["rank"], i["local_rank"], i["node_rank"], i["world_size"], i["num_nodes"],
                i["local_world_size"]) for i in infos]
        assert got == [(2 * host + lr, lr, host, 4, 2, 2) for lr in (0, 1)], out


@pytest.mark.parametrize("hierarchical", [pytest.param("false", marks=pytest.mark.slow), "true"])
def test_allreduce_across_hosts_equals_one_process(tmp_path, hierarchical):
    with Cluster(hosts=2, rate="1gbit") as c:
        launch(c, ["tests/dist/multinode_train.py", "--mode", "allreduce", "--out", str(tmp_path),
                   "--hierarchical", hierarchical])
    ranks = _ranks(tmp_path)
    assert {r: (i["host"], i["node_rank"], i["local_rank"]) for r, i in ranks.items()} == {
        0: (0, 0, 0), 1: (0, 0, 1), 2: (1, 1, 0), 3: (1, 1, 1)}
    if hierarchical == "true":
        assert all(i["hierarchical"] for i in ranks.values())
    _assert_equal(torch.load(tmp_path / "params-0.pt"), script.oracle(4))


def test_parameter_server_on_host0_serves_workers_on_both_hosts(tmp_path):
    with Cluster(hosts=2, rate="1gbit") as c:
        launch(c, ["tests/dist/multinode_train.py", "--mode", "ps", "--out", str(tmp_path)],
               flags=("--ps", "1"))
    ranks = _ranks(tmp_path)
    assert ranks[0]["is_ps"] and ranks[0]["host"] == 0 and ranks[0]["role"] == "ps"
    assert [ranks[r]["host"] for r in (1, 2, 3)] == [0, 1, 1]
    # Synchronous PS applies the mean of the 3 workers' gradients: one process on 3 batches.
    _assert_equal(torch.load(tmp_path / "params-0.pt"), script.oracle(3))


def test_hybrid_places_a_replicas_stages_on_one_host(tmp_path):
    with Cluster(hosts=2, rate="1gbit") as c:
        outs = launch(c, ["tests/dist/multinode_train.py", "--mode", "hybrid",
                          "--out", str(tmp_path)], flags=("--pp", "2"))
    ranks = _ranks(tmp_path)
    for replica in (0, 1):
        hosts = {i["host"] for i in ranks.values() if i["dp_rank"] == replica}
        assert len(hosts) == 1, f"replica {replica}'s stages span hosts {hosts}"
    assert "pipeline stages of a replica share a host" in outs[0]
    params: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, value in torch.load(tmp_path / f"params-{r}.pt").items():
            if name in params:      # the other replica's copy of the stage: identical
                torch.testing.assert_close(value, params[name], rtol=0, atol=0)
            params[name] = value
    _assert_equal(params, script.oracle(2))
