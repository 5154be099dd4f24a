"""reduce_async(into=...) on real gloo ranks: decoding into the bucket itself gives the same sum.

The data-parallel optimizer passes its bucket as ``into`` so top-k, random-k, PowerSGD and the
casts decode without a bucket-sized allocation per step; here twins with and without ``into`` must agree exactly, and
top-k (exact and DGC-sampled) must equal the sum of what every rank sent (input minus residual).
"""
from __future__ import annotations

import pytest
import torch

import parlay
from parlay import comm
from parlay.compress import get_compressor, reduce_async
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

SHAPE = (256, 512)  # >= 65536 elements: top-k's sampled path applies
N = SHAPE[0] * SHAPE[1]
NAMES = ["topk:0.01", "topk:0.01,sample=0.01", "topk:0.01,compact=1", "powersgd:4",
         "randomk:0.01", "fp16", "bf16"]


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(-4096, 4096, (N,), generator=g).double() / 1024  # sums stay exact


def _reduce_into(names: list[str]) -> dict:
    rank, report = parlay.rank(), {}
    for name in names:
        a, b = get_compressor(name), get_compressor(name)
        a.set_layout("bucket0", [SHAPE])
        b.set_layout("bucket0", [SHAPE])
        rows = []
        for s in range(3):
            flat = _grad(rank, s)
            mem = getattr(a, "memory", None)  # (the casts keep no residual)
            zero = torch.zeros(N, dtype=torch.float64)
            before = mem.residual.get("bucket0", zero).clone() if mem is not None else zero
            out = reduce_async(flat, a, "bucket0", into=flat).wait()
            ref = reduce_async(_grad(rank, s), b, "bucket0").wait()
            sent = _grad(rank, s) + before - (mem.residual["bucket0"] if mem is not None
                                              else zero)
            comm.allreduce(sent, "sum")
            rows.append(dict(is_into=out is flat, out=out.clone(), ref=ref, sent_sum=sent))
        report[name] = rows
    return report


@pytest.fixture(scope="module")
def per_rank():
    return run_world(_reduce_into, 2, NAMES, timeout=100)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_into_the_bucket_matches_a_fresh_result(per_rank, name):
    for rank, rep in enumerate(per_rank):
        for s, row in enumerate(rep[name]):
            assert row["is_into"], f"{name} rank {rank} step {s}: result not written into"
            torch.testing.assert_close(row["out"], row["ref"], rtol=0, atol=0)
            torch.testing.assert_close(row["out"], per_rank[0][name][s]["out"], rtol=0, atol=0)
            if name.startswith("topk"):  # what the ranks sent, summed: nothing else
                torch.testing.assert_close(row["out"], row["sent_sum"], rtol=0, atol=0)
