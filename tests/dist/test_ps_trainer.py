"""The Trainer in mode="ps": parameter-server ranks serve inside should_stop(), workers train,
and sync PS gives the same model as the single-process oracle of the allreduce mode."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.data import ShardedSampler
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)  # float64; only the summation order differs
N, BATCH, LR, EPOCHS = 24, 4, 0.05, 2


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 5, generator=g, dtype=torch.float64),
                         torch.randn(N, 2, generator=g, dtype=torch.float64))


def _build():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double(), nn.MSELoss()


def _trainer_ps(consistency: str):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR, "momentum": 0.9}, batch_size=BATCH,
                       num_epochs=EPOCHS, warmup_epochs=0.5, progress=False, mode="ps",
                       strategy_options={"consistency": consistency})
    steps = 0
    while not t.should_stop():
        t.train_on_batch()
        steps += 1
    return parlay.role(), steps, [p.detach().clone() for p in t.model.parameters()]


def _oracle(workers: int):
    """One process, global batch = the union of the workers' batches, with the Trainer's
    learning-rate scaling and warm-up (factor 1 -> workers over the first half epoch)."""
    torch.manual_seed(0)
    model, loss_fn = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ds = _dataset()
    full = ShardedSampler(len(ds), 1, 0, seed=0)
    steps_per_epoch = N // workers // BATCH
    warm = round(0.5 * steps_per_epoch)
    step = 0
    for epoch in range(EPOCHS):
        full.set_epoch(epoch)
        order = list(full)
        for i in range(0, len(order), BATCH * workers):
            f = 1 + (workers - 1) * step / warm if step < warm else workers
            for g in opt.param_groups:
                g["lr"] = LR * f
            x, y = ds[order[i:i + BATCH * workers]]
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            step += 1
    return [p.detach() for p in model.parameters()]


def test_trainer_ps_sync_equals_single_process():
    out = run_world(_trainer_ps, 3, "sync", env={"PARLAY_NUM_PS": "1"})
    ref = _oracle(2)
    assert out[0][0] == "ps" and out[0][1] == 0  # the server only served
    assert [o[1] for o in out[1:]] == [EPOCHS * N // 2 // BATCH] * 2
    for _, _, params in out:  # the server's copy and the workers' copies
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, **TOL)


def test_trainer_ps_async_runs_to_the_end():
    out = run_world(_trainer_ps, 3, "async", env={"PARLAY_NUM_PS": "1"})
    assert [o[1] for o in out] == [0, EPOCHS * N // 2 // BATCH, EPOCHS * N // 2 // BATCH]
    assert all(torch.isfinite(p).all() for o in out for p in o[2])


class _Slope(nn.Module):
    """A constant gradient of 1: each update moves ``w`` by the learning rate it applies."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        return self.w * x


def _applied_lr(consistency: str):
    ds = TensorDataset(torch.ones(40, 1, dtype=torch.float64), torch.zeros(40, 1))
    t = parlay.Trainer(lambda: (_Slope(), lambda out, y: out.mean()), ds, torch.optim.SGD,
                       {"lr": 0.1}, 10, mode="ps", warmup_epochs=0, progress=False,
                       strategy_options={"consistency": consistency})
    t.train_to_end()
    return t.lr_scale, float(t.model.w)


@pytest.mark.parametrize("consistency, scale", [("sync", 2.0), ("async", 1.0), ("stale:1", 1.0)])
def test_learning_rate_is_scaled_only_where_an_update_averages_the_workers(consistency, scale):
    # 40 samples in batches of 10: sync takes 2 updates of 2 workers' batches at lr 0.2, async
    # 4 pushes of one batch each at the base lr 0.1; both move w by -0.4, as one process does
    out = run_world(_applied_lr, 3, consistency, env={"PARLAY_NUM_PS": "1"})
    assert [o[0] for o in out[1:]] == [scale, scale]
    assert out[0][1] == pytest.approx(-0.4, abs=1e-12)  # the server's copy


def _trainer_ps_resumable(ckpt: str, max_iteration):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR, "momentum": 0.9}, batch_size=BATCH,
                       num_epochs=EPOCHS, max_iteration=max_iteration, warmup_epochs=0.5,
                       progress=False, mode="ps", checkpoint_dir=ckpt, checkpoint_every=1)
    while not t.should_stop():
        t.train_on_batch()
    t.save_checkpoint()  # after the end: the final checkpoint holds it (servers have left)
    return [p.detach().clone() for p in t.model.parameters()]


def test_trainer_ps_resume_restores_server_shards(tmp_path):
    # Stop mid-epoch, start again from the same checkpoint_dir: the servers must reload their
    # shards (parameters and momentum), so the result equals the uninterrupted run. The
    # server's newest file is corrupt: every rank resumes the step before (the server failed
    # on its own, and the workers' newer files were not the servers' step).
    env = {"PARLAY_NUM_PS": "1"}
    run_world(_trainer_ps_resumable, 3, str(tmp_path), 2, env=env)
    newest = tmp_path / "ps" / "ps-0.step-0000000002.pt"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(bytes(raw))
    out = run_world(_trainer_ps_resumable, 3, str(tmp_path), None, env=env)
    ref = _oracle(2)
    for params in out[1:]:
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, **TOL)


def test_servers_files_swapped_are_refused_and_the_step_before_resumed(tmp_path):
    # Each server's file records its server: swapped under each other's names, they were
    # loaded silently (each server went on from the other's shard).
    env = {"PARLAY_NUM_PS": "2"}
    run_world(_trainer_ps_resumable, 4, str(tmp_path), 2, env=env)
    a, b = (tmp_path / "ps" / f"ps-{k}.step-0000000002.pt" for k in (0, 1))
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    out = run_world(_trainer_ps_resumable, 4, str(tmp_path), None, env=env)
    ref = _oracle(2)
    for params in out[2:]:
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, **TOL)


def test_a_fresh_run_keeps_its_own_server_files_beside_an_older_run_s(tmp_path):
    # A finished run left the servers' files of steps 4-6 in ps/; the workers' files were
    # deleted ("start afresh"). The new run's servers wrote steps 1 and 2 and pruned them at
    # once (the older run's later steps counted as newer), so its restart found no step the
    # servers and workers both held, and could not resume.
    env = {"PARLAY_NUM_PS": "1"}
    run_world(_trainer_ps_resumable, 3, str(tmp_path), None, env=env)
    for f in tmp_path.glob("ckpt-*"):
        f.unlink()
    run_world(_trainer_ps_resumable, 3, str(tmp_path), 2, env=env)
    out = run_world(_trainer_ps_resumable, 3, str(tmp_path), None, env=env)
    ref = _oracle(2)
    for params in out[1:]:
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, **TOL)


def test_resuming_with_another_server_count_is_refused_on_every_rank_at_once(tmp_path):
    # Worker files are named by global rank, which moves with --ps: the refusal says so, and
    # the servers hear the workers' error at once instead of waiting out their timeout.
    run_world(_trainer_ps_resumable, 3, str(tmp_path), 2, env={"PARLAY_NUM_PS": "1"})
    out = run_world(_trainer_ps_resumable, 4, str(tmp_path), None, timeout=60,
                    env={"PARLAY_NUM_PS": "2"}, return_exceptions=True)
    for server in out[:2]:
        assert "failed (it raised an error)" in str(server)
    for worker in out[2:]:
        assert "written by 2 rank(s): 1, 2; this run has 2 that checkpoint: 2, 3" in str(worker)
        assert "did the number of parameter servers change" in str(worker)


class _Unsized(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.zeros(5), torch.zeros(2)


def _workers_data_refused():
    data = _dataset() if parlay.rank() == 0 else _Unsized()  # a mistake on the workers only
    try:
        t = parlay.Trainer(_build, data, batch_size=BATCH, progress=False, mode="ps")
        while not t.should_stop():  # servers serve here
            t.train_on_batch()
    except (parlay.ConfigError, parlay.CommError) as e:
        return str(e)
    return None


def test_a_worker_failing_after_the_servers_started_is_named_by_them_at_once():
    server, *workers = run_world(_workers_data_refused, 3, env={"PARLAY_NUM_PS": "1"},
                                 timeout=40)
    # a worker still in its first pull when the other's failure reaches the server hears of
    # that failure instead of reaching its own data check; either way it is named, not a hang
    assert any("map-style Dataset" in w for w in workers), workers
    assert all("map-style Dataset" in w or "failed (it raised an error)" in w
               for w in workers), workers
    assert "failed (it raised an error)" in server


def _no_mode(mode):
    kw = {} if mode is None else {"mode": mode}  # None: mode left out
    try:
        parlay.Trainer(_build, _dataset(), batch_size=BATCH, progress=False, **kw)
    except parlay.ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("mode", [None, "hybrid", "diloco"])
def test_a_job_launched_with_servers_needs_mode_ps(mode):
    # the server rank used to train as a third data-parallel replica, silently
    for msg in run_world(_no_mode, 3, mode, env={"PARLAY_NUM_PS": "1"}):
        assert msg is not None and "parameter servers" in msg and "mode='ps'" in msg
        assert "launch without --ps" in msg


class _FlakyData(torch.utils.data.Dataset):
    def __init__(self):
        self.data = _dataset()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if parlay.rank() == 2 and i == 1:  # a corrupt record (worker 1 reads index 1 first)
            raise ValueError("boom in the user's dataset")
        return self.data[i]


def _raising_worker(where):
    model, loss_fn = _build()
    calls = [0]

    def loss(out, y):
        calls[0] += 1
        if parlay.rank() == 2 and calls[0] == 2 and where == "loss":
            raise ValueError("boom in the user's loss")
        return loss_fn(out, y)

    data = _FlakyData() if where == "data" else _dataset()
    t = parlay.Trainer(lambda: (model, loss), data, batch_size=BATCH, num_epochs=EPOCHS,
                       progress=False, mode="ps", shuffle=False, prefetch=0)
    while not t.should_stop():
        t.train_on_batch()


@pytest.mark.parametrize("where", ["loss", "data"])
def test_a_worker_that_raises_is_named_as_failed_not_lost(where):
    # the servers and the other worker hear of it at once, not after the timeout as a loss
    # (also when the batch's loading raises: it was outside the step, so they waited)
    out = run_world(_raising_worker, 3, where, env={"PARLAY_NUM_PS": "1"}, comm_timeout=60,
                    return_exceptions=True)
    assert f"boom in the user's {where}" in str(out[2])
    assert all("worker 1 (rank 2) failed (it raised an error)" in str(e) for e in out[:2])


def _max_steps():
    t = parlay.Trainer(_build, _dataset(), batch_size=BATCH, num_epochs=EPOCHS, progress=False,
                       mode="ps", strategy_options={"consistency": "sync", "max_steps": 2})
    while not t.should_stop():
        t.train_on_batch()
    return parlay.role(), t.state.step


def test_the_ps_option_max_steps_ends_the_trainer_s_loop():
    for role, step in run_world(_max_steps, 3, env={"PARLAY_NUM_PS": "1"}):
        assert step == (2 if role == "worker" else 0)


def _servers_dir_only(d):
    try:
        parlay.Trainer(_build, _dataset(), batch_size=BATCH, progress=False, mode="ps",
                       strategy_options={"checkpoint_dir": d})
    except parlay.ConfigError as e:
        return str(e)
    return None


def test_a_servers_checkpoint_dir_without_the_trainer_s_is_refused(tmp_path):
    # servers would resume their shards while the workers started again at step 0
    for msg in run_world(_servers_dir_only, 3, str(tmp_path), env={"PARLAY_NUM_PS": "1"}):
        assert msg is not None and "Trainer(checkpoint_dir=...)" in msg


def _one_worker_saves(ckpt: str, consistency: str):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR}, batch_size=BATCH, num_epochs=EPOCHS,
                       progress=False, mode="ps", checkpoint_dir=ckpt,
                       strategy_options={"consistency": consistency})
    try:
        while not t.should_stop():
            t.train_on_batch()
            if parlay.rank() == 1 and t.state.step == 2:
                t.save_checkpoint()  # the DDP habit: one rank saves; the others train on
    except parlay.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("consistency", ["sync", "stale:1"])
def test_a_checkpoint_only_one_worker_asks_for_is_refused_at_once(tmp_path, consistency):
    # the saver waited for the others at the checkpoint, the others for the saver's next
    # gradient: both sat out the 60 s timeout (longer than this test may run) before
    server, *workers = run_world(_one_worker_saves, 3, str(tmp_path), consistency,
                                 env={"PARLAY_NUM_PS": "1"}, comm_timeout=60, timeout=40,
                                 return_exceptions=True)
    for msg in workers:
        assert msg is not None and "went on training" in msg
        assert "save_checkpoint() on every worker" in msg
    # every worker failed: the server does not report a success
    assert isinstance(server, parlay.CommError) and "every worker was lost or failed" in str(server)


def _train_with_checkpoints(ckpt: str):
    try:
        t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                           optimizer_args={"lr": LR}, batch_size=BATCH, max_iteration=4,
                           progress=False, mode="ps", checkpoint_dir=ckpt, checkpoint_every=2)
        while not t.should_stop():
            t.train_on_batch()
    except (parlay.CheckpointError, parlay.CommError) as e:
        return str(e)
    return None


def test_a_relaunch_with_another_layout_is_refused_and_keeps_the_servers_files(tmp_path):
    # the servers deleted every step of theirs before the workers' layout check refused
    assert run_world(_train_with_checkpoints, 3, str(tmp_path),
                     env={"PARLAY_NUM_PS": "1"}) == [None] * 3
    saved = sorted(p.name for p in (tmp_path / "ps").iterdir())
    assert saved, "the servers checkpointed"
    out = run_world(_train_with_checkpoints, 4, str(tmp_path), env={"PARLAY_NUM_PS": "1"},
                    comm_timeout=20)
    assert any(m and "another layout" in m for m in out), out
    assert sorted(p.name for p in (tmp_path / "ps").iterdir()) == saved


class _FrozenHalfFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(5, dtype=torch.float16), requires_grad=False)
        self.body = _build()[0]

    def forward(self, x):
        return self.body(x * self.gain.double())


def _frozen_first():
    torch.manual_seed(0)
    t = parlay.Trainer(lambda: (_FrozenHalfFirst(), nn.MSELoss()), _dataset(),
                       optimizer=torch.optim.SGD, optimizer_args={"lr": LR}, batch_size=BATCH,
                       max_iteration=3, progress=False, mode="ps")
    while not t.should_stop():
        t.train_on_batch()
    return [p.detach().clone() for p in t.model.body.parameters()]


def test_a_frozen_first_parameter_of_another_dtype_trains():
    # the workers sized their pushes by the frozen fp16 parameter, the server by the first
    # trainable one: gloo aborted every rank on the size mismatch
    server, a, b = run_world(_frozen_first, 3, env={"PARLAY_NUM_PS": "1"})
    for x, y, z in zip(server, a, b):
        assert torch.equal(x, y) and torch.equal(x, z)


def _straggler():
    slow = parlay.rank() == 2

    def loss(out, y):
        if slow:
            time.sleep(1.0)  # half the timeout a step: never lost, but 12 s behind at the end
        return ((out - y) ** 2).mean()

    ds = TensorDataset(torch.randn(120, 3, generator=torch.Generator().manual_seed(0)),
                       torch.zeros(120, 1))
    t = parlay.Trainer(lambda: (nn.Linear(3, 1), loss), ds, torch.optim.SGD, {"lr": 0.01},
                       batch_size=5, mode="ps", progress=False,
                       strategy_options={"consistency": "async"})
    t.train_to_end()
    return t.global_step


def test_async_worker_waits_out_a_straggler_longer_than_its_timeout_at_the_epoch_end():
    # The fast worker waits ~12 s at the epoch end, past its 2 * 2 + 5 s receive timeout: the
    # server tells it to wait on every second (it died blaming the server).
    out = run_world(_straggler, 3, env={"PARLAY_NUM_PS": "1"}, comm_timeout=2, timeout=90)
    assert out == [0, 12, 12]
