"""Parameter-server faults and restarts on real processes.

* The README's Trainer loop in mode="ps" validates after ``should_stop()`` under ``parlay run``.
* A server SIGKILLed mid-run under ``parlay run --max-restarts 1`` comes back from server shards
  and worker checkpoints of the same step on disk (snapshots off; test_ps_snapshot covers them):
  the final weights equal an uninterrupted run (sync PS is the maths of allreduce, so the
  single-process oracle of test_ps_trainer applies).
* async/stale: a killed worker is dropped at once (its connection closes), the survivors finish,
  including the Trainer's epoch-end metrics, and the server's receiver threads have all ended
  (a thread left blocked in gloo aborted the process at exit now and then); workers mark
  themselves droppable for the launcher.
* A killed server ends every worker with a CommError naming it, well within the timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.errors import CommError, ConfigError
from parlay.ps.consistency import SAVING, Reply, ServerCore, get_consistency
from parlay.testing import WorldError, run_world

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
PS1 = {"PARLAY_NUM_PS": "1"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PARLAY_TIMEOUT="30", OMP_NUM_THREADS="1")
    return env


def _parlay_run(tmp: Path, script: str, *args: str, restarts: int = 0, timeout: float = 150,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = tmp / "script.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, "-m", "parlay.cli", "run", "-n", "3", "--ps", "1",
                           "--max-restarts", str(restarts), str(path), *args],
                          cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


# -- the README's loop: validate() after should_stop() -------------------------------------------
README_LOOP = '''
    import sys
    import torch, torch.nn as nn
    from torch.utils.data import TensorDataset
    import parlay

    def build():
        model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
        return model, nn.CrossEntropyLoss()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, generator=g)
    y = x[:, :3].argmax(1)
    trainer = parlay.Trainer(build, TensorDataset(x, y),
                             optimizer=torch.optim.Adam, optimizer_args={"lr": 1e-3},
                             batch_size=8, mode="ps", num_epochs=2, progress=False,
                             checkpoint_dir=sys.argv[1],
                             validation_dataset=TensorDataset(x[:30], y[:30]))
    while not trainer.should_stop():
        trainer.train_on_batch()
    result = trainer.validate()
    # Each rank writes its own file: ranks' stdout lines can interleave in the launcher's pipe.
    with open(f"{sys.argv[2]}/validate.rank{parlay.rank()}", "w") as f:
        f.write(repr(result))
'''


def test_readme_loop_validates_after_should_stop_in_ps_mode(tmp_path):
    p = _parlay_run(tmp_path, README_LOOP, str(tmp_path / "ckpt"), str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {r: (tmp_path / f"validate.rank{r}").read_text() for r in range(3)}
    assert lines[0] == "{}"  # the server answers at once
    assert lines[1] == lines[2] and "'samples': 30.0" in lines[1]


# -- a killed server comes back from consistent state ------------------------------------------
RESTART = '''
    import os, signal, sys
    import torch
    import parlay

    root, ckpt_dir, out_dir, kill_version = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    sys.path.insert(0, root)
    from tests.dist.test_ps_trainer import BATCH, EPOCHS, LR, _build, _dataset

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR, "momentum": 0.9}, batch_size=BATCH,
                       num_epochs=EPOCHS, warmup_epochs=0.5, progress=False, mode="ps",
                       checkpoint_dir=ckpt_dir, checkpoint_every=2, snapshot_every=0)
    server = t.strategy.session.server
    if server is not None and attempt == 0:
        apply = server.core._apply

        def apply_then_die(grads, lr):  # the server dies right after update `kill_version`
            apply(grads, lr)
            if server.core.version + 1 == kill_version:
                os.kill(os.getpid(), signal.SIGKILL)

        server.core._apply = apply_then_die
    print(f"attempt {attempt} rank {parlay.rank()} starts at step {t.state.step}", flush=True)
    while not t.should_stop():
        t.train_on_batch()
    torch.save([p.detach().clone() for p in t.model.parameters()],
               f"{out_dir}/rank{parlay.rank()}.pt")
'''


@pytest.mark.parametrize("kill_version", [3, pytest.param(6, marks=pytest.mark.slow)])
def test_killed_server_resumes_from_consistent_state(tmp_path, kill_version):
    from tests.dist.test_ps_trainer import TOL, _oracle

    out = tmp_path / "out"
    out.mkdir()
    p = _parlay_run(tmp_path, RESTART, str(ROOT), str(tmp_path / "ckpt"), str(out),
                    str(kill_version), restarts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    # Checkpoints every 2 steps: the restart resumes the newest step servers and workers hold.
    resumed = 2 * ((kill_version - 1) // 2)
    for r in (1, 2):
        assert f"attempt 1 rank {r} starts at step {resumed}" in p.stdout, p.stdout
    ref = _oracle(2)
    for r in range(3):  # the server's copy and both workers'
        for a, b in zip(torch.load(out / f"rank{r}.pt", weights_only=True), ref):
            torch.testing.assert_close(a, b, **TOL)


# -- the checkpoint barrier on the server (pure) -------------------------------------------------
def test_server_snapshots_only_when_every_live_worker_waits_at_the_same_step():
    for spec in ("sync", "async", "stale:1"):
        saved: list[int] = []
        core = ServerCore(get_consistency(spec), 3, 10.0, lambda g, f: None, 0.0,
                          snapshot=saved.append)
        for w in range(3):
            core.hello(w, 0.0)
        assert core.save(0, 4, 0.0) == [] and core.state[0] == SAVING
        assert core.save(1, 4, 0.0) == [] and saved == []
        if spec == "sync":
            replies = core.save(2, 4, 0.0)
        else:  # a lost worker no longer holds the others' checkpoint back
            replies = core.lose(2, 1, 0.0)
        assert saved == [4], spec
        live = core.active()
        assert replies == [Reply("saved", w) for w in live]
        tags = iter([6, 8, 6])
        out = [r for w in live for r in core.save(w, next(tags), 1.0)]
        assert out == [Reply("error", w, 5, w) for w in live] and saved == [4], spec


# -- async / stale: a lost worker is dropped ------------------------------------------------------
def _session_with_casualty(consistency: str, die_at: int, steps: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64)
    with parlay.DistributedSession(model=nn.Linear(4, 1).double(), optimizer=torch.optim.SGD,
                                   optimizer_args={"lr": 0.05}, consistency=consistency) as sess:
        t0 = time.monotonic()
        if sess.is_worker:
            for t in range(steps):
                if parlay.rank() == 2 and t == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                sess.train_step((x, x.sum(1, keepdim=True)), nn.functional.mse_loss)
        else:
            sess.should_stop()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("parlay-ps")]
    return {"lost": sess.lost_workers(), "step": sess.step, "threads": alive,
            "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("consistency", ["async", "stale:2"])
def test_killed_worker_is_dropped_at_once_and_the_server_exits_cleanly(consistency):
    # The survivor finishes long before a silent worker would time out (30 s): the dead one is
    # dropped when its connection closes, and no receiver thread is left blocked in gloo.
    out = run_world(_session_with_casualty, 3, consistency, 2, 8, env=PS1, comm_timeout=30,
                    return_exceptions=True)
    assert isinstance(out[2], WorldError)
    assert out[0]["lost"] == [2] and out[0]["threads"] == []
    assert out[1]["step"] == 8
    assert out[0]["seconds"] < 20, out[0]


DROP = '''
    import os, signal, sys, time
    import torch, torch.nn as nn
    import parlay

    parlay.init()
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    with parlay.DistributedSession(model=nn.Linear(4, 1), optimizer=torch.optim.SGD,
                                   optimizer_args={"lr": 0.05}, consistency=sys.argv[1]) as sess:
        if sess.is_worker:
            for t in range(12):
                if parlay.rank() == 2 and t == 5:
                    if sys.argv[2] == "hang":
                        time.sleep(600)
                    os.kill(os.getpid(), signal.SIGKILL)
                sess.train_step((x, x.sum(1, keepdim=True)), nn.functional.mse_loss)
        else:
            sess.should_stop()
    print(f"rank {parlay.rank()} done: step {sess.step}, lost {sess.lost_workers()}", flush=True)
'''


@pytest.mark.parametrize("consistency, how", [("async", "kill"),
                                              pytest.param("stale:2", "kill", marks=pytest.mark.slow),
                                              ("async", "hang")])
def test_killed_worker_is_dropped_under_parlay_run(tmp_path, consistency, how):
    # a hung worker the server dropped is stopped by the launcher: it held the job forever
    p = _parlay_run(tmp_path, DROP, consistency, how, env={"PARLAY_TIMEOUT": "5"}, timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 1 done: step 12, lost []" in p.stdout
    assert "rank 0 done: step 0, lost [2]" in p.stdout
    assert "rank 2 (droppable parameter-server worker) was lost" in p.stdout + p.stderr


def _marker(consistency: str, run_dir: str) -> bool:
    with parlay.DistributedSession(model=nn.Linear(2, 1), optimizer=torch.optim.SGD,
                                   optimizer_args={"lr": 0.1}, consistency=consistency) as sess:
        mine = os.path.exists(os.path.join(run_dir, "droppable", str(parlay.rank())))
        sess.should_stop()
    return mine


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_async_workers_mark_themselves_droppable_for_the_launcher(tmp_path, consistency):
    # parlay run keeps the job going when a rank with $PARLAY_RUN_DIR/droppable/<rank> fails:
    # async/stale workers write it once they train; servers and sync workers never do.
    out = run_world(_marker, 3, consistency, str(tmp_path), env={**PS1,
                                                                 "PARLAY_RUN_DIR": str(tmp_path)})
    if consistency == "async":
        assert out == [False, True, True]
        assert sorted(os.listdir(tmp_path / "droppable")) == ["1", "2"]
    else:
        assert out == [False, False, False] and not (tmp_path / "droppable").exists()
    assert run_world(_marker, 3, "async", str(tmp_path / "none"), env=PS1) == [False] * 3
    assert not (tmp_path / "none").exists()


N, BATCH = 24, 2


def _trainer_async_casualty(die_at: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    ds = TensorDataset(x, x[:, :2].clone())

    def build():
        return nn.Linear(5, 2).double(), nn.MSELoss()

    t = parlay.Trainer(build, ds, optimizer=torch.optim.SGD, optimizer_args={"lr": 0.05},
                       batch_size=BATCH, num_epochs=2, progress=False, mode="ps",
                       log_step_size=2, validation_dataset=ds,
                       strategy_options={"consistency": "async"})
    epochs = []
    while not t.should_stop():
        if parlay.rank() == 2 and t.state.step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        epoch = t.state.epoch
        t.train_on_batch()
        if t.state.epoch != epoch:
            epochs.append(t.state.step)
    return {"steps": t.state.step, "epochs": epochs, "val": t.validate(),
            "lost": t.strategy.session.lost_workers()}


def test_trainer_async_survivor_finishes_with_metrics_after_a_worker_dies():
    out = run_world(_trainer_async_casualty, 3, 2, env=PS1, comm_timeout=30,
                    return_exceptions=True)
    assert isinstance(out[2], WorldError)
    assert out[0]["lost"] == [2] and out[0]["val"] == {}
    steps_per_epoch = N // 2 // BATCH  # epoch 1: the survivor alone trains every sample
    assert out[1]["steps"] == 3 * steps_per_epoch
    assert out[1]["epochs"] == [steps_per_epoch, 3 * steps_per_epoch]  # epoch-end metrics ran
    assert out[1]["val"]["samples"] == N  # alone, it evaluates the whole validation set


# -- a killed server -----------------------------------------------------------------------------
def _server_killed(consistency: str, kill_version: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g)

    def build():
        return nn.Linear(5, 2), nn.MSELoss()

    t = parlay.Trainer(build, TensorDataset(x, x[:, :2].clone()), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=BATCH, num_epochs=4,
                       progress=False, mode="ps", strategy_options={"consistency": consistency})
    server = t.strategy.session.server
    if server is not None:
        apply = server.core._apply

        def apply_then_die(grads, lr):
            apply(grads, lr)
            if server.core.version + 1 == kill_version:
                os.kill(os.getpid(), signal.SIGKILL)

        server.core._apply = apply_then_die
    last = time.monotonic()
    try:
        while not t.should_stop():
            t.train_on_batch()
            last = time.monotonic()
    except CommError as e:
        return {"error": str(e), "peer": e.peer, "seconds": time.monotonic() - last}
    return {"error": None}


@pytest.mark.parametrize("consistency", ["sync", "async"])
def test_killed_server_ends_every_worker_with_a_comm_error_naming_it(tmp_path, consistency):
    timeout = 30.0
    out = run_world(_server_killed, 3, consistency, 3, env={**PS1, "PARLAY_RUN_DIR": str(tmp_path)},
                    comm_timeout=timeout, return_exceptions=True)
    assert isinstance(out[0], WorldError)
    for r in (1, 2):
        res = out[r]
        assert res["error"] and "parameter server 0 (rank 0)" in res["error"], res
        assert res["peer"] == 0
        assert res["seconds"] < timeout, res  # its connection closed: no wait for the timeout
    # Losing a server is not a droppable loss: the launcher must stop (or restart) the job.
    markers = tmp_path / "droppable"
    assert not markers.exists() or list(markers.iterdir()) == []


# -- validation reduces tensors only ------------------------------------------------------------
def _reduce(case: str):
    from parlay.trainer.evaluation import reduce_metrics as _reduce_metrics

    r = parlay.rank()
    if case == "empty-rank":  # rank 2 saw no validation samples
        sums, count = ({}, 0) if r == 2 else ({"acc": 1.0 * (r + 1), "loss": 2.0}, 2)
    else:  # rank 1 reports a different metric
        sums, count = ({"acc": 1.0, "loss": 1.0} if r != 1 else {"acc": 1.0, "lossx": 1.0}), 1
    try:
        return _reduce_metrics(sums, count, None)
    except ConfigError as e:
        return str(e)


def test_validation_metrics_reduce_as_tensors_and_ranks_must_agree_on_names():
    out = run_world(_reduce, 3, "empty-rank")
    assert out[0] == out[1] == out[2] == {"acc": 3.0 / 4, "loss": 4.0 / 4, "samples": 4.0}
    bad = run_world(_reduce, 3, "mismatch")
    assert all(isinstance(m, str) and "different validation metrics" in m for m in bad)


# -- async/stale with checkpoints: survivors go on checkpointing after a loss --------------------
# Kill scripts here and in test_ps_snapshot.py start with ``t``: 12 steps, a checkpoint every 2.
PS_CKPT_TRAINER = '''
    import os, signal, sys
    import torch, torch.nn as nn
    from torch.utils.data import TensorDataset
    import parlay

    ckpt_dir, consistency = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 5, generator=g)

    def build():
        return nn.Linear(5, 2), nn.MSELoss()

    t = parlay.Trainer(build, TensorDataset(x, x[:, :2].clone()), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=2, num_epochs=1, progress=False,
                       mode="ps", checkpoint_dir=ckpt_dir, checkpoint_every=2,
                       strategy_options={"consistency": consistency})
'''
CKPT_DROP = PS_CKPT_TRAINER + '''
    while not t.should_stop():
        if parlay.rank() == 2 and t.state.step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t.train_on_batch()
    print(f"rank {parlay.rank()} done at step {t.state.step}", flush=True)
'''


@pytest.mark.parametrize("consistency", ["async", pytest.param("stale:1", marks=pytest.mark.slow)])
def test_survivors_keep_checkpointing_after_a_worker_is_lost(tmp_path, consistency):
    ckpt = tmp_path / "ckpt"
    p = _parlay_run(tmp_path, CKPT_DROP, str(ckpt), consistency)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 1 done at step 12" in p.stdout, p.stdout  # 48 samples / 2 workers / batch 2
    assert "rank 2 (droppable parameter-server worker) was lost" in p.stdout + p.stderr
    names = sorted(os.listdir(ckpt))
    # The survivor and the server kept checkpointing after the loss at step 3, up to the end
    # (keep_last=3: steps 8, 10, 12); the lost worker's newest file is from before it died.
    assert [f"ckpt-{s:010d}.rank1.pt" for s in (8, 10, 12)] == \
        [n for n in names if n.endswith(".rank1.pt")], names
    assert [n for n in names if n.endswith(".rank2.pt")] == ["ckpt-0000000002.rank2.pt"], names
    assert "ps-0.step-0000000012.pt" in os.listdir(ckpt / "ps"), os.listdir(ckpt / "ps")
