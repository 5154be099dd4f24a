"""``parlay plan`` prices what is sent (review 46): int8 above 128 ranks, top-k's index width
per 25 MiB bucket and per DiLoCo fragment, the ranks ``--memory-per-rank`` needs from 1 rank,
and the caveat on built-in constants."""
from __future__ import annotations

import pytest
import torch

from parlay.cli import main
from parlay.compress import Round, get_compressor
from parlay.compress.reduce import payload_bytes
from parlay.plan.model import (DEFAULT_BUCKET_BYTES, ClusterSpec, Costs, Link, Workload,
                               link_bytes, rounds_s, wire_bytes, wire_rounds)
from parlay.plan.modes import FORWARD_SHARE, allreduce_terms, diloco_link_bytes, exposed
from parlay.plan.shard import recommend_shard, shard_levels

pytestmark = pytest.mark.timeout(120)


def _int8_sent(numel: int, world: int) -> int:
    """Bytes int8 sends for a bucket when the scale round's sums come from ``world`` ranks."""
    c = get_compressor("int8")
    payload, ctx = c.compress(torch.randn(numel), "b0")
    reduced = [torch.tensor([float(payload[0][0]) * world, float(world)], dtype=torch.float64)]
    return payload_bytes(payload) + payload_bytes(c.next_round(reduced, ctx) or [])


@pytest.mark.parametrize("world", [2, 128, 129, 256])
def test_int8_priced_as_sent_at_any_world(world: int) -> None:
    assert wire_bytes("int8", 10_000, world) == _int8_sent(10_000, world)


def test_int8_above_128_ranks_is_no_cheaper_than_dense() -> None:
    w, c = Workload(25e6, 64, 0.1 / 64), ClusterSpec(17, 8, Link(1e9))
    dense = allreduce_terms(w, c, "none", Costs())["comm"]
    assert allreduce_terms(w, c, "int8", Costs())["comm"] >= dense
    assert diloco_link_bytes(w, c, "int8", 100) > 0.9 * diloco_link_bytes(w, c, "none", 100)


def test_topk_priced_per_bucket_with_int32_indices() -> None:
    per = DEFAULT_BUCKET_BYTES // 4
    full, rest = divmod(int(7e9), per)
    topk = get_compressor("topk:0.01")
    # what one rank gives per step: a bucket's k values and int32 indices, bucket by bucket
    sent = 8 * (full * topk.k_for(per, 0.01) + topk.k_for(rest, 0.01))
    w, c = Workload(7e9, 8, 1 / 8), ClusterSpec(16, 8, Link(10e9))
    nb = -(-int(w.grad_bytes) // DEFAULT_BUCKET_BYTES)
    comm = rounds_s([Round("allgather", sent)], 128, c.inter, Costs(), messages=nb,
                    rested_s=w.compute_s)
    left = exposed(comm, w.compute_s * (1 - FORWARD_SHARE), nb, c.overlap)
    assert allreduce_terms(w, c, "topk:0.01", Costs())["comm"] == pytest.approx(left)
    for w in (Workload(7e9, 8, 1 / 8), Workload(7e9, 8, 1 / 8, layers=4)):
        rounds = wire_rounds("topk:0.01", w.params, 128, w.layout, 4, DEFAULT_BUCKET_BYTES)
        assert sum(r.nbytes for r in rounds) == pytest.approx(sent, rel=1e-6)


def test_diloco_bytes_per_fragment() -> None:
    w, c = Workload(7e9, 8, 1 / 8), ClusterSpec(16, 8, Link(10e9))
    # each fragment of 1.75e9 elements is reduced in one piece: int32 indices
    assert diloco_link_bytes(w, c, "topk:0.01", 100, 4) == pytest.approx(
        4 * link_bytes("topk:0.01", 7e9 / 4, 128) / 100)
    assert diloco_link_bytes(w, c, "topk:0.01", 100, 4) < diloco_link_bytes(w, c, "topk:0.01",
                                                                           100)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_ranks_needed_is_the_true_minimum(ranks: int) -> None:
    w, limit = Workload(25e6, 64, 0.1 / 64), 150e6

    def fits(n: int) -> bool:
        c = ClusterSpec(n, 1, Link(10e9))
        return any(lv.memory_bytes <= limit for lv in shard_levels(w, c, 2.0))

    need = next(n for n in range(2, 64) if fits(n))
    assert need == 6 and not fits(ranks)
    line = recommend_shard(shard_levels(w, ClusterSpec(ranks, 1, Link(10e9)), 2.0), limit, ranks)
    assert f"Hint: {need} ranks or more" in line


def test_uncalibrated_plan_says_its_constants_are_cpu_ones(capsys) -> None:
    main(["plan", "--model-params", "25e6", "--batch", "64", "--nodes", "2",
          "--gpus-per-node", "8", "--bandwidth", "10gbit", "--compute-ms", "120",
          "--no-calibrate", "--modes", "allreduce", "--compressors", "none,fp16"])
    assert "built-in CPU constants (--no-calibrate); on GPUs they are far smaller" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "a bare number is seconds" in " ".join(capsys.readouterr().out.split())
