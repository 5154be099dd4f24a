"""Top-k's compact wire (``topk:R,compact=1``): half the bytes, nothing lost with error feedback.

Real compressors on real tensors; the 2-rank reduction through gloo is in
``tests/dist/test_compression_into.py`` (the same name in its ``NAMES``).
"""
from __future__ import annotations

import pytest
import torch

from parlay.compress import get_compressor
from parlay.compress.sparsewire import compact_bytes, pack_compact, unpack_compact
from parlay.errors import CommError, ConfigError
from parlay.plan.model import wire_rounds

pytestmark = pytest.mark.timeout(60)

N = 200_003  # four 65536-blocks, the last one short


def test_sent_plus_kept_is_exactly_what_was_produced_and_the_support_is_top_k():
    g = torch.Generator().manual_seed(0)
    compact, plain = get_compressor("topk:0.01,compact=1"), get_compressor("topk:0.01")
    produced = torch.zeros(N)
    sent_total = torch.zeros(N)
    for step in range(5):
        grad = torch.randn(N, generator=g)
        produced += grad
        payload, ctx = compact.compress(grad.clone(), "b")
        assert [(p.dtype, p.numel()) for p in payload] == [(torch.uint8, compact_bytes(N, 2000))]
        out = compact.decompress(payload, ctx)
        sent_total += out
        # the plain top-k of the same corrected gradient picks the same coordinates
        if step == 0:
            ref_payload, ref_ctx = plain.compress(grad.clone(), "b")
            ref = plain.decompress(ref_payload, ref_ctx)
            assert torch.equal(out != 0, ref != 0)
            assert torch.allclose(out, ref, rtol=2 ** -8, atol=0)  # bfloat16's rounding
            assert sum(p.numel() * p.element_size() for p in ref_payload) == 2000 * 8
    # error feedback keeps what rounding took off: sent + residual == produced, bit for bit
    torch.testing.assert_close(sent_total + compact.memory.residual["b"], produced,
                               rtol=0, atol=1e-5)
    assert compact_bytes(N, 2000) == 4 * 4 + 4 * 2000


def test_fewer_than_k_are_padded_at_coordinate_zero_and_indices_round_trip():
    idx = torch.tensor([199_999, 5, 70_000, 131_072])
    vals = torch.tensor([1.0, -2.0, 3.0, 0.5])
    buf = pack_compact(vals, idx, N, 6)
    got_vals, got_idx = unpack_compact(buf, N, 6)
    assert got_idx.tolist() == [0, 0, 5, 70_000, 131_072, 199_999]
    assert got_vals.float().tolist() == [0.0, 0.0, -2.0, 3.0, 0.5, 1.0]


def test_an_empty_bucket_round_trips_from_any_offset_of_a_gathered_buffer():
    # an empty slice at an odd offset cannot be viewed as int32 (a zero-element bucket's
    # payload inside an allgather buffer failed as a "lost peer")
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), pack_compact(
        torch.zeros(0), torch.zeros(0, dtype=torch.long), 0, 0)])[3:]
    vals, idx = unpack_compact(buf, 0, 0)
    assert vals.numel() == idx.numel() == 0


def test_malformed_payloads_are_comm_errors():
    buf = pack_compact(torch.ones(3), torch.tensor([1, 2, 3]), N, 3)
    for bad in (buf[:-1], buf.clone().view(torch.int32).index_fill_(0, torch.tensor([0]), 7)
                .view(torch.uint8), torch.zeros(compact_bytes(N, 3), dtype=torch.int8)):
        with pytest.raises(CommError, match="malformed"):
            unpack_compact(bad, N, 3)
    last = pack_compact(torch.ones(1), torch.tensor([N - 1]), N, 1)
    last[-2:] = 0xFF  # offset 65535 in the short last block: past the bucket's end
    with pytest.raises(CommError, match="names coordinate"):
        unpack_compact(last, N, 1)


def test_options_and_cost_model():
    with pytest.raises(ConfigError, match="error feedback"):
        get_compressor("topk:0.01,compact=1,ef=0")
    assert "compact=True" in repr(get_compressor("topk:0.01,compact=true"))
    # one grammar: the cost model prices what the registry builds from the same string
    with pytest.raises(ConfigError, match="unknown option 'compact'"):
        wire_rounds("randomk:0.01,compact=1", N, 2)
    (r,) = wire_rounds("topk:0.01,compact=1", N, 2)
    assert r.kind == "allgather" and r.nbytes == compact_bytes(N, 2000)
    assert wire_rounds("topk:0.01", N, 2)[0].nbytes == 2000 * 8
