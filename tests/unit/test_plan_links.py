"""The cost model's links: token-bucket shapers (a burst after a rest), the parameter servers'
pipelined chunks on a network link but not on one machine, and the in-run exchange probe."""
from __future__ import annotations

import dataclasses

import pytest

from parlay.errors import ConfigError
from parlay.plan import ClusterSpec, Costs, Link, Workload, predict, wire_rounds
from parlay.plan.insitu import exchange_link
from parlay.plan.model import rounds_s
from parlay.plan.pipesim import pipeline_s
from tools.cluster import tbf_burst

pytestmark = pytest.mark.timeout(60)

FREE = Costs(**{f.name: 0.0 for f in dataclasses.fields(Costs)})
FREE = dataclasses.replace(FREE, incast_efficiency=1.0, duplex_efficiency=1.0)


@pytest.mark.parametrize("burst", [-1.0, float("inf"), float("nan"), "64k"])
def test_a_burst_must_be_a_finite_number_of_bytes(burst) -> None:
    with pytest.raises(ConfigError, match="burst"):
        Link(1e9, 0.0, burst_bytes=burst)


def test_harness_bursts_are_what_tbf_is_given() -> None:
    assert tbf_burst(100_000_000) == 125_000  # a 10 ms tick of tokens
    assert tbf_burst(1_000_000_000) == 1_250_000
    assert tbf_burst(10_000_000) == 64 * 1024  # never under one GSO segment


def test_a_rested_burst_sends_its_bytes_at_once_and_no_more() -> None:
    link = Link(100e6, 0.0, 1.0, burst_bytes=125_000)
    plain = Link(100e6, 0.0, 1.0)
    big = wire_rounds("none", 1e6, 2, None, 4)      # 4 MB: the burst is a small part of it
    small = wire_rounds("powersgd:4", 1e6, 2, [(1000, 1000)], 4)  # a few kB a step
    full = rounds_s(big, 2, plain, FREE)
    # a rested link saves exactly the burst's time; a link that never rests saves nothing
    assert rounds_s(big, 2, link, FREE, rested_s=1.0) == pytest.approx(
        full - 125_000 * plain.beta)
    assert rounds_s(big, 2, link, FREE, rested_s=0.0) == pytest.approx(full)
    # the refill is the rate times the rest, up to the burst
    assert rounds_s(big, 2, link, FREE, rested_s=1e-3) == pytest.approx(
        full - 12_500 * plain.beta)
    # a message within the burst costs only its per-message parts, never less
    costs = dataclasses.replace(FREE, alpha_s=1e-4)
    assert rounds_s(small, 2, link, costs, rested_s=1.0) == pytest.approx(
        rounds_s(small, 2, Link(float("inf"), 0.0, 1.0), costs))


def test_a_shaper_paces_back_to_back_transfers_and_refills_in_gaps() -> None:
    fwd, bwd = [1.0, 1.0], [2.0, 2.0]
    free = pipeline_s(fwd, bwd, 4, 0.0, "gpipe")
    for sched in ("gpipe", "1f1b"):
        # a burst as big as everything: no wait; no burst: each transfer waits for its bytes
        # at the rate (10 s a message), as on a plain link
        assert pipeline_s(fwd, bwd, 4, 0.0, sched, (10.0, 1.0, 1e9)) == pytest.approx(free)
        plain = pipeline_s(fwd, bwd, 4, 10.0, sched)
        assert pipeline_s(fwd, bwd, 4, 0.0, sched, (10.0, 1.0, 1e-12)) == pytest.approx(plain)
        # a burst of one message: the first goes at once, the gaps refill part of the next
        assert free < pipeline_s(fwd, bwd, 4, 0.0, sched, (10.0, 1.0, 10.0)) < plain - 9.0
    # slower rate, longer step; the per-message cost still counts on top
    paced = pipeline_s(fwd, bwd, 4, 0.0, "1f1b", (10.0, 2.0, 10.0))
    assert free < paced < pipeline_s(fwd, bwd, 4, 0.0, "1f1b", (10.0, 1.0, 10.0))
    assert pipeline_s(fwd, bwd, 4, 0.5, "1f1b", (10.0, 2.0, 10.0)) > paced
    # a fast enough refill between 1F1B's transfers: the shaper costs nothing
    assert pipeline_s(fwd, bwd, 4, 0.0, "1f1b", (10.0, 5.0, 10.0)) == pytest.approx(free)


def test_hybrid_on_a_shaped_link_sits_between_a_free_and_a_plain_link() -> None:
    w = Workload(4e6, 64, 1e-3, layers=4, activation_numel=1024)
    plain = predict(w, ClusterSpec(2, 1, Link(100e6, 50e-6)), "hybrid", costs=FREE, stages=2,
                    chunks=4)
    shaped = predict(w, ClusterSpec(2, 1, Link(100e6, 50e-6, burst_bytes=125_000)), "hybrid",
                     costs=FREE, stages=2, chunks=4)
    free = predict(w, ClusterSpec(2, 1, Link(float("inf"))), "hybrid", costs=FREE, stages=2,
                   chunks=4)
    assert free.step_s < shaped.step_s < plain.step_s


def test_ps_chunks_overlap_the_two_directions_only_on_a_network_link() -> None:
    w = Workload(5.8e6, 8, 1e-3)
    net = ClusterSpec(4, 1, Link(100e6), overlap=0.0)
    piped = predict(w, net, "ps", costs=FREE, servers=4, chunk_bytes=256 * 1024)
    whole = predict(w, net, "ps", costs=FREE, servers=4)
    assert piped.step_s < whole.step_s
    # one machine: push and pull are copies on the same cores, chunked or not
    local = ClusterSpec(1, 4, Link(3e9, 0.0, 1.0), overlap=0.0)
    assert predict(w, local, "ps", costs=FREE, servers=2, chunk_bytes=256 * 1024).step_s == \
        pytest.approx(predict(w, local, "ps", costs=FREE, servers=2).step_s)


def test_sync_pushes_that_together_overrun_a_servers_queue_pay_incast() -> None:
    # 2 workers push 11.7 MB each over 2 servers: 5.8 MB from each into a server, under a
    # 1 Gbit/s link's 6.25 MB queue (50 ms) alone, over it together, and sync workers push at once
    link = Link(1e9)
    w = Workload(2.92e6, 64, 1e-4)
    c = ClusterSpec(2, 1, link, overlap=0.0)
    costs = dataclasses.replace(FREE, incast_efficiency=0.8, queue_s=0.05)
    into_server = 2 * w.grad_bytes / 2 * link.beta  # seconds, at the link's goodput
    sync = predict(w, c, "ps", costs=costs, servers=2, server_link=link)
    assert sync.terms["push"] == pytest.approx(into_server / 0.8)
    deep = dataclasses.replace(costs, queue_s=0.1)  # a queue that holds both pushes
    assert predict(w, c, "ps", costs=deep, servers=2, server_link=link).terms["push"] == \
        pytest.approx(into_server)
    # async workers drift apart: a worker's own push pays none of it
    asyn = predict(w, c, "ps", costs=costs, servers=2, server_link=link, consistency="async")
    assert asyn.terms["push"] == pytest.approx(w.grad_bytes * link.beta)


def test_exchange_probe_gives_the_link_that_repeats_it() -> None:
    params = 2.9e6
    link = exchange_link(0.02, 4 * params)
    w = Workload(params, 64, 1e-4)
    c = ClusterSpec(1, 4, link, overlap=0.0)
    asyn = predict(w, c, "ps", costs=FREE, servers=2, server_link=link, consistency="async")
    assert asyn.terms["push"] + asyn.terms["pull"] == pytest.approx(0.02)
    for bad in ((0.0, 1e6), (0.01, 0.0), (-1.0, 1e6)):
        with pytest.raises(ConfigError, match="exchange probe"):
            exchange_link(*bad)


def _plan_json(capsys, *extra: str, rc: int = 0) -> dict:
    import json

    from parlay.cli import main

    argv = ["plan", "--model-params", "3e6", "--batch", "64", "--nodes", "2", "--compute-ms",
            "25", "--layers", "4", "--activation-numel", "1024", "--modes", "allreduce,hybrid",
            "--no-calibrate", "--json", *extra]
    assert main(argv) == rc
    if rc:  # refused: one line naming the input and the fix
        return {"err": capsys.readouterr().err}
    return {(p["mode"], p["compressor"]): p["step_s"]
            for p in json.loads(capsys.readouterr().out)["predictions"]}


def test_plan_burst_speeds_up_what_fits_in_it_and_refuses_nonsense(capsys) -> None:
    plain = _plan_json(capsys, "--bandwidth", "100mbit")
    shaped = _plan_json(capsys, "--bandwidth", "100mbit", "--burst", "125k")
    assert shaped.keys() == plain.keys()
    for key in plain:
        assert shaped[key] <= plain[key] + 1e-12
    # a small payload (top-k: 1% of 3M values and their indices) goes out within the burst
    assert shaped[("allreduce", "topk:0.01")] < plain[("allreduce", "topk:0.01")]
    for bad, words in ((["--bandwidth", "100mbit", "--burst", "-5"], "--burst"),
                       (["--bandwidth", "100mbit", "--burst", "lots"], "--burst"),
                       (["--burst", "125k"], "--bandwidth 100mbit --burst 125k")):
        assert words in _plan_json(capsys, *bad, rc=2)["err"]
