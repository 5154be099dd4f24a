"""Chunked, pipelined sync pushes on real gloo ranks: the same result as one-message pushes (and
as single-process training) to 1e-10 in float64, and a worker that dies half-way through a
chunked push still ends every other rank with a CommError naming it."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

import parlay
from parlay.errors import CommError, ConfigError
from parlay.ps import DistributedSession
from parlay.ps.chunks import CHUNK_ENV, DEFAULT_CHUNK_BYTES, chunk_bounds, chunk_bytes, cut_pieces
from parlay.ps.plan import ShardPlan
from parlay.testing import WorldError, run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)
PS2 = {"PARLAY_NUM_PS": "2"}
STEPS = 3
TIMEOUT = 3.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()


def _batch(worker: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * t + worker)
    return (torch.randn(5, 6, generator=g, dtype=torch.float64),
            torch.randn(5, 3, generator=g, dtype=torch.float64))


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _train():
    model = _model()
    with DistributedSession(model=model, optimizer=torch.optim.Adam,
                            optimizer_args={"lr": 0.05, "weight_decay": 0.01},
                            consistency="sync", split_bytes=256) as sess:
        t = 0
        while not sess.should_stop() and t < STEPS:
            sess.train_step(_batch(sess.worker_index, t), _mse)
            t += 1
    part = sess.server if not sess.is_worker else sess.worker
    chunks = (len(part.bounds) if not sess.is_worker
              else [len(b) if b else 0 for b in part.bounds])
    return {"params": [p.detach().clone() for p in model.parameters()], "chunks": chunks}


def _oracle(workers: int) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.01)
    for t in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(_batch(w, t) for w in range(workers)))
        _mse(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_chunked_push_equals_one_message_push_and_single_process():
    # 40-byte chunks (5 float64s) cut whole tensors and split pieces mid-way; 0 turns it off.
    chunked = run_world(_train, 4, env={**PS2, CHUNK_ENV: "40"})
    whole = run_world(_train, 4, env={**PS2, CHUNK_ENV: "0"})
    assert all(c > 3 for c in chunked[2]["chunks"])  # workers really pushed in chunks
    assert whole[2]["chunks"] == [0, 0]
    oracle = _oracle(2)
    for r in (2, 3):
        for a, b, o in zip(chunked[r]["params"], whole[r]["params"], oracle):
            torch.testing.assert_close(a, b, **TOL)
            torch.testing.assert_close(a, o, **TOL)


DEAD = 3  # worker 1 of 2 servers + 2 workers


def _die_mid_push():
    model = _model()
    with DistributedSession(model=model, optimizer=torch.optim.SGD, optimizer_args={"lr": 0.1},
                            consistency="sync") as sess:
        if sess.is_worker:
            sess.train_step(_batch(sess.worker_index, 0), _mse)
            if parlay.rank() == DEAD:
                w = sess.worker
                post = w._post_chunks

                def half_then_die(recv: bool):
                    if recv:
                        return post(recv=True)
                    # The headers announced every chunk; only the first half is sent.
                    w.bounds = [b[: len(b) // 2] for b in w.bounds]
                    for _, h in post(recv=False):
                        h.wait()
                    os._exit(1)

                w._post_chunks = half_then_die
            t0 = time.monotonic()
            try:
                sess.train_step(_batch(sess.worker_index, 1), _mse)
            except CommError as e:
                return {"error": e, "seconds": time.monotonic() - t0}
        else:
            sess.should_stop()
    return {"error": None}


def test_worker_lost_mid_chunked_push_is_named_within_the_timeout():
    t0 = time.monotonic()
    out = run_world(_die_mid_push, 4, env={**PS2, CHUNK_ENV: "40"}, comm_timeout=TIMEOUT,
                    return_exceptions=True)
    assert isinstance(out[DEAD], WorldError)  # it died
    for r in (0, 1):  # both servers
        assert isinstance(out[r], CommError), (r, out[r])
        assert "worker 1 (rank 3) was lost" in str(out[r]) and out[r].peer == DEAD
    survivor = out[2]["error"]
    assert isinstance(survivor, CommError) and "worker 1 (rank 3) was lost" in str(survivor)
    assert survivor.peer == DEAD
    assert out[2]["seconds"] < TIMEOUT + 2.0  # the closed connection is noticed at once
    assert time.monotonic() - t0 < 60


def test_chunk_layout_and_setting():
    plan = ShardPlan([("a", (3, 4), torch.float32), ("b", (7,), torch.float32)], 1)
    bounds = chunk_bounds(plan.numel(0), 5)
    assert bounds == [(0, 5), (5, 10), (10, 15), (15, 19)]
    cut = cut_pieces(plan.pieces(0), bounds)
    # contiguous, every chunk covered exactly, whole tensors keep their shape when not cut
    assert [(o, n) for o, n, _, _ in cut] == [(0, 5), (5, 5), (10, 2), (12, 3), (15, 4)]
    assert [k for *_, k in cut] == [0, 1, 2, 2, 3]
    assert cut_pieces(plan.pieces(0), [(0, 19)])[0][2] == (3, 4)
    assert chunk_bytes({}) == DEFAULT_CHUNK_BYTES and chunk_bytes({CHUNK_ENV: "0"}) == 0
    # every rank on one host: whole pushes by default, chunks only when asked for
    assert chunk_bytes({}, one_host=True) == 0
    assert chunk_bytes({CHUNK_ENV: "1024"}, one_host=True) == 1024
    with pytest.raises(ConfigError, match=CHUNK_ENV):
        chunk_bytes({CHUNK_ENV: "lots"})


def _checkpointed(ckpt: str, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    try:
        with DistributedSession(model=model, optimizer=torch.optim.Adam,
                                optimizer_args={"lr": 0.05}, consistency="sync",
                                checkpoint_dir=ckpt, checkpoint_every=1) as sess:
            while not sess.should_stop() and sess.step < steps:
                x, y = _batch(sess.worker_index, sess.step)
                sess.train_step((x[:, :5], y), _mse)
    except Exception as e:  # noqa: BLE001 - what each rank met
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_resuming_with_other_chunk_bounds_is_refused_by_the_server(tmp_path):
    # 720 and 800 bytes cut the 147 float64 parameters into as many pieces at other bounds:
    # the Adam state loaded into the wrong pieces, and the first update failed on a shape.
    env = {"PARLAY_NUM_PS": "1", CHUNK_ENV: "720"}
    assert run_world(_checkpointed, 3, str(tmp_path), 2, env=env) == ["ok"] * 3
    out = run_world(_checkpointed, 3, str(tmp_path), 4, env={**env, CHUNK_ENV: "800"},
                    comm_timeout=10)
    assert out[0].startswith("CheckpointError") and "does not fit" in out[0], out[0]
    assert "PARLAY_PS_CHUNK_BYTES" in out[0]
