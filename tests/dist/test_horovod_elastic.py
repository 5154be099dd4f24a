"""``hvd.elastic``: TorchState commits, restores and syncs; ``@hvd.elastic.run`` resumes a
restarted job from the newest commit every rank holds and retries after a failed collective."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parlay.errors import ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# An elastic Horovod script with only the import changed: a float64 MLP with dropout (so the
# restored random-number generators matter), momentum SGD, 2 epochs x 6 batches, a commit after
# every batch. On the first attempt the ranks make a mismatched collective at step FAIL_AT (a
# real HorovodInternalError on both: restore, re-init, retry in process), then rank 1 SIGKILLs
# itself before step KILL_AT (torchrun restarts both workers from their snapshots).
SCRIPT = r'''
import os, signal, sys
import torch
import parlay.horovod as hvd

out, fail_at, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
failed = []
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
g = torch.Generator().manual_seed(1)
X = torch.randn(96, 6, generator=g, dtype=torch.float64)
Y = torch.randn(96, 1, generator=g, dtype=torch.float64)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                            torch.nn.Linear(16, 1)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
EPOCHS, BATCHES, B = 2, 6, 8
log = open(os.path.join(out, f"log{hvd.rank()}.txt"), "a")


def on_state_reset():
    for group in opt.param_groups:
        group["lr"] = 0.05 * hvd.size()
    log.write(f"reset {attempt}\n")
    log.flush()


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        for b in range(state.batch, BATCHES):
            step = state.epoch * BATCHES + b
            if attempt == 0 and step == fail_at and not failed:
                failed.append(step)
                hvd.allreduce(torch.ones(2 + hvd.rank()), name="bad")  # shapes disagree
            if hvd.rank() == 1 and attempt == 0 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            lo = (b * hvd.size() + hvd.rank()) * B
            state.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(state.model(X[lo:lo + B]), Y[lo:lo + B])
            loss.backward()
            state.optimizer.step()
            log.write(f"step {step} {attempt}\n")
            log.flush()
            state.batch = b + 1
            state.commit()
        state.batch = 0


state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
if hvd.rank() == 0:
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))
'''


def _launch(tmp: Path, out: Path, *argv: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PARLAY_SNAPSHOT_DIR"] = str(tmp / "snapshots")
    return subprocess.Popen([sys.executable, "-m", "parlay.cli", "run", "-n", "2",
                             "--max-restarts", "1", str(tmp / "train.py"), str(out), *argv],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _run_script(path: str, *argv: str) -> None:
    """The script on run_world's ranks, uninterrupted (its hvd.init() finds the group up)."""
    import runpy

    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def _log(out: Path, rank: int) -> list[tuple[str, int, int]]:
    rows = []
    for line in (out / f"log{rank}.txt").read_text().splitlines():
        kind, *nums = line.split()
        rows.append((kind, int(nums[-2]) if kind == "step" else -1, int(nums[-1])))
    return rows


@pytest.mark.timeout(150)
def test_failed_collective_retries_and_killed_rank_resumes_bit_identical(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    fail_at, kill_at = 3, 7
    plain, faulty = tmp_path / "plain", tmp_path / "faulty"
    plain.mkdir(), faulty.mkdir()
    p = _launch(tmp_path, faulty, str(fail_at), str(kill_at))
    # Meanwhile the same script uninterrupted, on run_world's ranks (same gloo sums).
    run_world(_run_script, 2, str(tmp_path / "train.py"), str(plain), "-1", "-1")
    text, _ = p.communicate(timeout=140)
    assert p.returncode == 0, f"parlay run failed:\n{text[-4000:]}"

    ref = torch.load(plain / "final.pt", weights_only=True)
    got = torch.load(faulty / "final.pt", weights_only=True)
    for k in ref:  # dropout masks too: each commit restores the random-number generators
        assert torch.equal(ref[k], got[k]), f"{k} differs from the uninterrupted run"

    for rank in (0, 1):
        rows = _log(faulty, rank)
        assert rows[0] == ("step", 0, 0), f"attempt 0 did not train:\n{text[-4000:]}"
        first = [s for kind, s, a in rows if kind == "step" and a == 0]
        second = [s for kind, s, a in rows if kind == "step" and a == 1]
        # The in-process retry after the failed collective at step 3 recomputes nothing.
        assert first[:kill_at - 1] == list(range(kill_at - 1)), rows
        assert second and second == list(range(second[0], 12)), rows
        # Committing every batch loses at most the one batch whose commit the kill cut short.
        assert len(set(first) & set(second)) <= 1 and set(first) | set(second) == set(range(12))
        assert max(first) <= kill_at and second[0] >= kill_at - 1, rows
        resets = [a for kind, _, a in rows if kind == "reset"]
        assert resets == [0, 1], f"rank {rank}: reset callbacks ran on attempts {resets}"
    assert [r for r in _log(plain, 0) if r[0] == "reset"] == []
    # Snapshots are deleted once every rank returned from the training function.
    assert not [f for f in (tmp_path / "snapshots").rglob("*") if f.is_file()]


# ---------------------------------------------------------------- in-process world (run_world)
def _model_and_state():
    import parlay.horovod as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1)).double()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0, history=[])
    return model, state


def _elastic_train(fail_at: int = -1, crash_at: int = -1, uncommitted: tuple[int, ...] = (),
                   steps: int = 8):
    """Train ``steps`` batches elastically. ``fail_at``: on the first pass, ranks make one
    mismatched collective at that batch (a real HorovodInternalError on every rank).
    ``crash_at``: the process "dies" after that many batches, the ranks in ``uncommitted``
    without committing the last one (as if the kill cut that write short)."""
    import parlay.horovod as hvd

    model, state = _model_and_state()
    resets, seen = [], []
    state.register_reset_callbacks([lambda: resets.append(state.batch)])
    g = torch.Generator().manual_seed(7)
    data = torch.randn(steps, 2, 5, 4, generator=g, dtype=torch.float64)
    failed = []

    @hvd.elastic.run
    def train(state):
        for b in range(state.batch, steps):
            if b == fail_at and not failed:
                failed.append(b)
                hvd.allreduce(torch.ones(2 + hvd.rank()), name="bad")  # shapes disagree
            seen.append(b)
            state.optimizer.zero_grad()
            model(data[b, hvd.rank()]).pow(2).mean().backward()
            state.optimizer.step()
            state.batch = b + 1
            state.history = state.history + [b]
            if b + 1 == crash_at:
                if hvd.rank() not in uncommitted:
                    state.commit()
                raise KeyboardInterrupt("simulated crash")
            state.commit()
        return "done"

    try:
        result = train(state)
    except KeyboardInterrupt:
        result = "crashed"
    return result, {k: v.clone() for k, v in model.state_dict().items()}, resets, seen, \
        state.history


def test_restart_resumes_from_newest_commit_every_rank_holds(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "elastic-test", "TORCHELASTIC_MAX_RESTARTS": "1",
           "TORCHELASTIC_RESTART_COUNT": "0", "PARLAY_SNAPSHOT_DIR": str(tmp_path)}
    plain = run_world(_elastic_train, 2)
    # Attempt 0 dies with rank 1's 5th commit missing (as if the kill cut its write short).
    first = run_world(_elastic_train, 2, crash_at=5, uncommitted=(1,), env=env)
    assert [r[0] for r in first] == ["crashed", "crashed"]
    second = run_world(_elastic_train, 2, env={**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    for r in range(2):
        result, weights, resets, seen, history = second[r]
        assert result == "done" and resets == [4] and seen == [4, 5, 6, 7]
        assert history == list(range(8))
        for k, v in plain[r][1].items():
            assert torch.equal(v, weights[k]), k
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    # A fresh job (restart count 0) under the same run id never resumes old commits.
    run_world(_elastic_train, 2, crash_at=3, env=env)
    fresh = run_world(_elastic_train, 2, env=env)
    assert [r[2] for r in fresh] == [[], []] and [r[3] for r in fresh] == [list(range(8))] * 2


# ---------------------------------------------------------------- single process
def test_commit_restore_and_plain_value_checks():
    import parlay.horovod as hvd

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = hvd.elastic.TorchState(model, opt, scheduler=sched, epoch=1, tags={"a": [1, 2]})
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    state.commit()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    r = torch.rand(3)
    for _ in range(2):  # restoring twice gives the same state: restore never aliases a commit
        opt.step()
        sched.step()
        state.epoch, state.tags["a"] = 5, None
        state.restore()
        assert state.epoch == 1 and state.tags == {"a": [1, 2]}
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
        assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
        assert torch.equal(torch.rand(3), r)  # the RNG is back where the commit left it
    with pytest.raises(ConfigError, match="elastic state epoch is a object"):
        hvd.elastic.TorchState(model, epoch=object())
    state.epoch = {1, 2}
    with pytest.raises(ConfigError, match="epoch is a set"):
        state.commit()


def _sampler_skips_recorded_samples():
    from parlay.horovod.elastic import ElasticSampler

    s = ElasticSampler(list(range(10)), shuffle=True, seed=3)
    order = list(s)
    assert sorted(order) == list(range(10)) and len(s) == 10
    s.record_batch(0, 4)
    clone = ElasticSampler(list(range(10)), shuffle=True, seed=3)
    clone.load_state_dict(s.state_dict())
    assert list(clone) == order[4:]
    s.set_epoch(1)
    assert list(s) != order and sorted(s) == list(range(10))


def test_elastic_sampler_skips_recorded_samples():
    run_world(_sampler_skips_recorded_samples, 1)  # (it needs hvd.init(), as in Horovod)


def _batch(rank: int, epoch: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * epoch + 10 * rank + i)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def _fails_between_backward_and_step():
    import parlay.horovod as hvd

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters())
    state = hvd.elastic.TorchState(m, opt, epoch=0, batch=0)
    fired = []

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 2):
            while state.batch < 4:
                x, y = _batch(hvd.rank(), state.epoch, state.batch)
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                if (state.epoch, state.batch) == (0, 2) and not fired:
                    fired.append(1)  # a collective fails after backward, before step
                    hvd.allreduce(torch.zeros(1 + hvd.rank()), name="bad")
                opt.step()
                state.batch += 1
                state.commit()
            state.batch = 0

    train(state)
    return [p.detach().clone() for p in m.parameters()]


def test_a_step_that_fails_after_backward_is_retried_from_the_commit():
    # The retry's backward raised "computed more than backward_passes_per_step times": the
    # failed step's reduction state survived the restore.
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        for i in range(4):
            opt.zero_grad()
            x, y = zip(*(_batch(r, epoch, i) for r in range(2)))
            torch.nn.functional.mse_loss(m(torch.cat(x)), torch.cat(y)).backward()
            opt.step()
    for got in run_world(_fails_between_backward_and_step, 2, comm_timeout=10):
        for p, q in zip(got, m.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-6)
