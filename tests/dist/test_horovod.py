"""parlay.horovod collectives on real gloo ranks, against results computed by hand.

What Horovod's own test suite (test/parallel/test_torch.py) taught, restated as our tests:
operations match by name, not call order; disagreeing ranks all get HorovodInternalError
(never a hang); join() lets a finished rank answer allreduces with zeros; process sets are
groups addressed with *global* root ranks; scaling of integers truncates in float64.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import parlay
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

EXACT = dict(rtol=0, atol=0)


def test_parlay_and_horovod_export_the_same_objects():
    import parlay.horovod as hvd

    common = [n for n in hvd.__all__ if hasattr(parlay, n)]
    assert {"init", "rank", "size", "DistributedOptimizer", "broadcast_parameters", "allreduce",
            "Compression", "join", "Average", "Adasum"} <= set(common)
    assert [n for n in common if getattr(parlay, n) is not getattr(hvd, n)] == []


def test_compression_fp16_horovod_style_and_parlay_style():
    import parlay.horovod as hvd
    from parlay.compress import get_compressor

    t = torch.ones(5, dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(t)
    assert sent.dtype == torch.float16 and hvd.Compression.fp16.decompress(sent, ctx).dtype == t.dtype
    i = torch.ones(3, dtype=torch.int32)
    assert hvd.Compression.fp16.compress(i)[0].dtype == torch.int32
    # The optimizer's protocol: an instance compresses a flat bucket under a key.
    payload, _ = get_compressor(hvd.Compression.fp16).compress(torch.ones(4), "bucket0")
    assert payload[0].dtype == torch.float16


def _collectives():
    import parlay.horovod as hvd

    r, n = hvd.rank(), hvd.size()
    out = {}
    base = torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4)
    x = base * (r + 1)
    out["avg"] = hvd.allreduce(x)
    out["sum"] = hvd.allreduce(x, op=hvd.Sum)
    out["min"], out["max"], out["prod"] = (hvd.allreduce(x, op=o) for o in (hvd.Min, hvd.Max,
                                                                            hvd.Product))
    # Integers: average truncates towards zero; prescale runs in float64, then truncates.
    out["int_avg"] = hvd.allreduce(torch.tensor([-3, 3, 5], dtype=torch.int32) + r)
    out["int_pre"] = hvd.allreduce(torch.tensor([7, -7], dtype=torch.int64), op=hvd.Sum,
                                   prescale_factor=0.5)
    out["half_post"] = hvd.allreduce(torch.tensor([1.5, 3.0], dtype=torch.float16), op=hvd.Sum,
                                     postscale_factor=0.25)
    inplace = x.clone()
    hvd.allreduce_(inplace, op=hvd.Sum)
    out["inplace"] = inplace
    out["grouped"] = hvd.grouped_allreduce([x, x.double().t(), torch.ones(2, dtype=torch.int16)],
                                           op=hvd.Sum)
    # allgather: first dimension differs per rank; int16 and bool travel as bytes.
    out["gather"] = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int16))
    out["gather_bool"] = hvd.allgather(torch.tensor([r == 0]))
    out["ggather"] = hvd.grouped_allgather([torch.full((r + 2,), float(r)), torch.ones(1, 3) * r])
    src = torch.full((2, 2), float(r))
    out["bcast"] = hvd.broadcast(src, root_rank=1)
    out["bcast_src_untouched"] = src
    out["bcast_"] = hvd.broadcast_(torch.full((3,), r, dtype=torch.int8), root_rank=1)
    # alltoall: rank r sends r+1 rows to each rank, tagged with the destination.
    rows = torch.cat([torch.full((r + 1, 2), 10 * r + d) for d in range(n)])
    out["a2a"] = hvd.alltoall(rows, splits=torch.tensor([r + 1] * n, dtype=torch.int32))
    out["a2a_equal"] = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    # reducescatter: 5 rows over 2 ranks -> rank 0 keeps 3, rank 1 keeps 2.
    out["rs"] = hvd.reducescatter(torch.arange(10.).reshape(5, 2), op=hvd.Sum)
    out["rs_avg"] = hvd.grouped_reducescatter([torch.arange(4) * (r + 1)], op=hvd.Average)
    sp = torch.sparse_coo_tensor([[r, 2]], [1.0 + r, 5.0], (4,))
    out["sparse"] = hvd.sparse_allreduce_async(sp, "s", hvd.Sum)().to_dense()
    return out


def test_collectives_match_hand_computed_results():
    outs = run_world(_collectives, 2)
    base = torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4)
    x0, x1 = base, base * 2
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["avg"], (x0 + x1) / 2, **EXACT)
        torch.testing.assert_close(o["sum"], x0 + x1, **EXACT)
        torch.testing.assert_close(o["min"], torch.minimum(x0, x1), **EXACT)
        torch.testing.assert_close(o["max"], torch.maximum(x0, x1), **EXACT)
        torch.testing.assert_close(o["prod"], x0 * x1, **EXACT)
        assert o["int_avg"].tolist() == [-2, 3, 5]       # (-3 + -2)/2 = -2.5 -> -2
        assert o["int_pre"].tolist() == [6, -6]           # trunc(3.5) * 2
        assert o["half_post"].dtype == torch.float16 and o["half_post"].tolist() == [0.75, 1.5]
        torch.testing.assert_close(o["inplace"], x0 + x1, **EXACT)
        g = o["grouped"]
        torch.testing.assert_close(g[1], (x0 + x1).double().t(), **EXACT)
        assert g[2].dtype == torch.int16 and g[2].tolist() == [2, 2]
        assert o["gather"].tolist() == [[0, 0], [1, 1], [1, 1]]
        assert o["gather"].dtype == torch.int16
        assert o["gather_bool"].tolist() == [True, False]
        assert o["ggather"][0].tolist() == [0, 0, 1, 1, 1] and o["ggather"][1].shape == (2, 3)
        assert o["bcast"].tolist() == [[1.0, 1.0]] * 2
        assert o["bcast_src_untouched"].tolist() == [[float(r)] * 2] * 2
        assert o["bcast_"].tolist() == [1, 1, 1]
        got, recv = o["a2a"]
        assert recv.tolist() == [1, 2] and recv.dtype == torch.int32
        assert got[:, 0].tolist() == [r] + [10 + r] * 2
        assert o["a2a_equal"].tolist() == [2 * r, 2 * r + 1, 100 + 2 * r, 101 + 2 * r]
        full = torch.arange(10.).reshape(5, 2) * 2
        torch.testing.assert_close(o["rs"], full[:3] if r == 0 else full[3:], **EXACT)
        assert o["rs_avg"][0].tolist() == ([0, 1] if r == 0 else [3, 4])  # trunc(3k / 2)
        assert o["sparse"].tolist() == [1.0, 2.0, 10.0, 0.0]


def _name_matching():
    import parlay.horovod as hvd
    from parlay import comm

    r = hvd.rank()
    t = torch.ones(3) * (r + 1)
    if r == 0:
        # Started before rank 1 even submits it: it cannot be complete yet.
        h = hvd.allreduce_async(t, name="late", op=hvd.Sum)
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(t, name="late")
        pending_before = hvd.poll(h)
        comm.barrier()                  # rank 1 submits "late" only after this
        hvd.barrier()                   # negotiated barrier while "late" is in flight
        return pending_before, hvd.synchronize(h).tolist(), hvd.poll(h)
    comm.barrier()
    hvd.barrier()
    res = hvd.allreduce(t, name="late", op=hvd.Sum)
    return False, res.tolist(), True


def test_operations_match_by_name_not_call_order():
    for pending, res, done in run_world(_name_matching, 2):
        assert pending is False and done is True
        assert res == [3.0, 3.0, 3.0]


def _mismatches():
    import parlay.horovod as hvd

    r = hvd.rank()
    seen = []
    cases = [lambda: hvd.allreduce(torch.ones(3 + r)),
             lambda: hvd.allreduce(torch.ones(2, 3) if r == 0 else torch.ones(3, 2)),
             lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32 if r == 0 else torch.float32)),
             lambda: hvd.allgather(torch.ones(2, 3 + r)),
             lambda: hvd.broadcast(torch.ones(2), root_rank=r),
             lambda: hvd.alltoall(torch.ones(4, 1 + r)),
             lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Max)]
    for case in cases:
        try:
            case()
            seen.append("no error")
        except hvd.HorovodInternalError as e:
            seen.append(str(e))
    seen.append(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist())   # the engine lives on
    return seen


def test_disagreeing_ranks_all_raise_instead_of_hanging():
    for seen in run_world(_mismatches, 2, timeout=60):
        assert "Mismatched allreduce tensor shapes" in seen[0] and "[3]" in seen[0]
        assert "[2, 3]" in seen[1] and "[3, 2]" in seen[1]
        assert "Mismatched data types" in seen[2] and "torch.int32" in seen[2]
        assert "only the first dimension may differ" in seen[3]
        assert "Mismatched root ranks" in seen[4]
        assert "Mismatched alltoall tensor shapes" in seen[5]
        assert "Mismatched reduction ops" in seen[6]
        assert seen[-1] == [2.0, 2.0]


def _join():
    import parlay.horovod as hvd

    r = hvd.rank()
    res = {}
    if r == 0:
        res["last"] = hvd.join()
    else:
        res["avg"] = hvd.allreduce(torch.tensor([4.0, -2.0]), name="j").tolist()
        res["int_avg"] = hvd.allreduce(torch.tensor([5, -5])).tolist()   # auto-named
        with pytest.raises(hvd.HorovodInternalError, match="joined"):
            hvd.allgather(torch.ones(1))
        res["last"] = hvd.join()
    # After join the auto-name counters agree again: this unnamed op matches on both ranks.
    res["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    return res


def test_join_contributes_zeros_and_returns_the_last_rank():
    outs = run_world(_join, 2)
    assert outs[1]["avg"] == [2.0, -1.0]             # zeros from the joined rank, / full size
    assert outs[1]["int_avg"] == [2, -2]
    assert outs[0]["last"] == outs[1]["last"] == 1
    assert outs[0]["after"] == outs[1]["after"] == 2.0


def _process_sets():
    import parlay.horovod as hvd
    from parlay.errors import ConfigError

    r = hvd.rank()
    edge = hvd.add_process_set([2, 0])
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(hvd.ProcessSet([0, 2]))
    res = {"included": edge.included(), "set_rank": edge.rank(), "size": edge.size()}
    if r in (0, 2):
        res["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=edge).item()
        res["bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=2, process_set=edge).item()
        res["obj"] = hvd.broadcast_object({"from": r}, root_rank=2, process_set=edge)
        res["gather"] = hvd.allgather(torch.tensor([r]), process_set=edge).tolist()
        hvd.barrier(edge)
    else:
        with pytest.raises(ConfigError, match="not in"):
            hvd.allreduce(torch.ones(1), process_set=edge)
    res["removed"] = hvd.remove_process_set(edge)
    res["again"] = hvd.remove_process_set(edge)
    res["global_removed"] = hvd.remove_process_set(hvd.global_process_set)
    return res


def test_process_sets_are_groups_with_global_root_ranks():
    outs = run_world(_process_sets, 3)
    for r, o in enumerate(outs):
        assert o["included"] is (r != 1) and o["size"] == 2
        assert o["removed"] is True and o["again"] is False and o["global_removed"] is False
        if r != 1:
            assert o["set_rank"] == (0 if r == 0 else 1)
            assert o["sum"] == 2.0 and o["bcast"] == 2 and o["obj"] == {"from": 2}
            assert o["gather"] == [0, 2]


def _gradients():
    import parlay.horovod as hvd

    r, n = hvd.rank(), hvd.size()
    g = {}
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    g["allreduce_sum"] = x.grad.tolist()
    x = torch.ones(r + 1, 2, requires_grad=True)
    (hvd.allgather(x) * torch.arange(1.0, 4.0)[:, None]).sum().backward()
    g["allgather"] = x.grad.tolist()
    x = torch.ones(2, requires_grad=True)
    (hvd.broadcast(x, root_rank=1) * (r + 1)).sum().backward()
    g["broadcast"] = x.grad.tolist()
    x = torch.arange(4.0, requires_grad=True)
    out, _ = hvd.alltoall(x, splits=[1, 3] if r == 0 else [2, 2])
    (out * (r + 1)).sum().backward()
    g["alltoall"] = x.grad.tolist()
    x = torch.ones(4, 2, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    g["reducescatter"] = x.grad[:, 0].tolist()
    return g, n


def test_gradients_follow_horovods_rules():
    outs = run_world(_gradients, 2)
    for r, (g, n) in enumerate(outs):
        assert g["allreduce_sum"] == [2.0] * 3
        # allgather: this rank's rows of the averaged upstream gradient (weights 1, 2, 3).
        assert g["allgather"] == ([[1.0, 1.0]] if r == 0 else [[2.0, 2.0], [3.0, 3.0]])
        # broadcast: the root gets the average of (r + 1), the others zero.
        assert g["broadcast"] == ([0.0, 0.0] if r == 0 else [1.5, 1.5])
        # alltoall: element i went to rank d, whose gradient there is d + 1.
        dest = [0, 1, 1, 1] if r == 0 else [0, 0, 1, 1]
        assert g["alltoall"] == [float(d + 1) for d in dest]
        assert g["reducescatter"] == [2.0] * 4


def _adasum_and_inline():
    import parlay.horovod as hvd
    from parlay.horovod.execute import adasum

    r = hvd.rank()
    ortho = hvd.allreduce(torch.tensor([1.0, 0.0]) if r == 0 else torch.tensor([0.0, 2.0]),
                          op=hvd.Adasum)
    same = hvd.allreduce(torch.tensor([3.0, 4.0]), op=hvd.Adasum)
    v = torch.tensor([1.0, 2.0, 3.0]) * (r + 1) + torch.tensor([0.5, -1.0, 0.0]) * r
    mixed = hvd.allreduce(v, op=hvd.Adasum)
    ref = adasum([torch.tensor([1.0, 2.0, 3.0]),
                  torch.tensor([1.0, 2.0, 3.0]) * 2 + torch.tensor([0.5, -1.0, 0.0])])
    inline = hvd.allreduce(torch.ones(2) * r, op=hvd.Sum,
                           process_group=torch.distributed.group.WORLD)
    return ortho.tolist(), same.tolist(), mixed, ref, inline.tolist()


def test_adasum_and_process_group_inline_path():
    for ortho, same, mixed, ref, inline in run_world(_adasum_and_inline, 2):
        assert ortho == [1.0, 2.0]          # orthogonal gradients add up
        assert same == [3.0, 4.0]           # identical gradients are not doubled
        torch.testing.assert_close(mixed, ref.float(), rtol=1e-6, atol=1e-6)
        assert inline == [1.0, 1.0]


def _timeline_and_reinit(path):
    import parlay.horovod as hvd
    from parlay.errors import ConfigError

    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    hvd.stop_timeline()
    env = (os.environ.get("HOROVOD_RANK"), os.environ.get("HOROVOD_SIZE"))
    ps = hvd.add_process_set([1])
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    with pytest.raises(ConfigError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=ps)
    return env, hvd.allreduce(torch.ones(1) * hvd.rank(), op=hvd.Sum).item()


def test_timeline_is_chrome_trace_json_and_reinit_works(tmp_path):
    path = str(tmp_path / "timeline.json")
    outs = run_world(_timeline_and_reinit, 2, path)
    for r, (env, total) in enumerate(outs):
        assert env == (str(r), "2") and total == 1.0
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)            # torch.profiler's Chrome trace, with Horovod's spans
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START", "allreduce.test_allreduce"} <= names
    assert trace["start_time_since_epoch_in_micros"] > 0


def _one_rank_imports_horovod():
    import sys

    from parlay import comm

    assert "parlay.horovod" not in sys.modules
    if parlay.rank() == 0:
        # A parameter server never touches parlay.horovod; a worker may, after init. That
        # must not start anything collective (nothing connects before a Horovod-style op).
        # (parlay.Compression is the core's namespace now: the Horovod name loads it.)
        assert parlay.horovod.Compression.fp16.compress(torch.ones(1))[0].dtype == torch.float16
    comm.barrier()
    return "parlay.horovod" in sys.modules


def test_importing_horovod_on_some_ranks_starts_nothing_collective():
    assert run_world(_one_rank_imports_horovod, 2, timeout=60) == [True, False]


def _desynced():
    import parlay.horovod as hvd

    name = "a" if hvd.rank() == 0 else "b"
    try:
        hvd.allreduce(torch.ones(1), name=name)
        err = "no error"
    except hvd.HorovodInternalError as e:
        err = str(e)
    return err, hvd.allreduce(torch.ones(1), op=hvd.Sum, name="c").item()


def test_ranks_waiting_for_different_names_fail_after_the_timeout_and_recover():
    outs = run_world(_desynced, 2, comm_timeout=3, timeout=60)
    assert "allreduce.a stalled" in outs[0][0] and "allreduce.b" in outs[0][0]
    assert "allreduce.b stalled" in outs[1][0] and "ranks [0] did not" in outs[1][0]
    assert outs[0][1] == outs[1][1] == 2.0


def _peer_dies_mid_allreduce():
    import parlay.horovod as hvd

    hvd.allreduce(torch.ones(1), name="warm")  # the engine is connected on every rank
    if hvd.rank() == 2:
        os._exit(3)
    try:
        hvd.synchronize(hvd.allreduce_async(torch.ones(4), name="t"))
    except hvd.HorovodInternalError as e:
        return str(e), e.peer
    return "no error", None


def test_a_rank_lost_mid_operation_is_named():
    # the negotiation's allgather said only "a peer was lost or the operation failed"
    out = run_world(_peer_dies_mid_allreduce, 3, comm_timeout=5, timeout=60,
                    return_exceptions=True)
    for msg, peer in out[:2]:
        assert "rank 2 did not answer" in msg and peer == 2, msg
