"""Edges of a parameter-server session's life: calls after it closed, every worker failing at a
checkpoint, sync rounds short of a worker that finished early, options that cannot work
together, and sessions that initialise the runtime from an explicit task spec."""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn

from parlay import runtime
from parlay.errors import CheckpointError, CommError, ConfigError
from parlay.ps import DistributedSession, get_consistency
from parlay.ps.consistency import LOST, ServerCore
from parlay.strategies.ps import ParameterServerStrategy
from parlay.taskspec import TaskSpec, TaskSpecDef
from parlay.testing import free_port, run_world

pytestmark = pytest.mark.timeout(120)

PS1 = {"PARLAY_NUM_PS": "1"}


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _session(call: str, ckpt: str | None = None):
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    batch = (x, x.sum(1, keepdim=True))
    tagged = {"checkpoint_dir": ckpt, "resume_steps": []} if ckpt else {}
    try:
        with DistributedSession(model=nn.Linear(4, 1), optimizer=torch.optim.SGD,
                                optimizer_args={"lr": 0.1}, consistency="async",
                                **tagged) as sess:
            while not sess.should_stop() and sess.step < 4:
                sess.train_step(batch, _mse)
                if call == "slip" and sess.step == 2 + sess.worker_index:
                    sess.save_shards(sess.step)  # the workers ask for different steps
        if sess.is_worker:
            {"train": lambda: sess.train_step(batch, _mse), "save": lambda: sess.save_shards(4),
             "epoch": lambda: sess.end_epoch(0, 8)}[call]()
    except Exception as e:  # noqa: BLE001 - the test looks at which
        return type(e), str(e)
    return None, ""


@pytest.mark.parametrize("call", ["train", "save", "epoch"])
def test_a_call_after_the_session_closed_is_a_config_error(call):
    out = run_world(_session, 3, call, env=PS1, comm_timeout=10)
    assert out[0] == (None, "")
    for kind, msg in out[1:]:
        assert kind is ConfigError and "after the session closed" in msg, (kind, msg)


def test_every_worker_failing_at_a_checkpoint_fails_the_servers_too(tmp_path):
    out = run_world(_session, 3, "slip", str(tmp_path), env=PS1, comm_timeout=10)
    for kind, msg in out[1:]:
        assert kind is CheckpointError and "different steps" in msg, (kind, msg)
    kind, msg = out[0]  # not a success: no worker finished
    assert kind is CommError and "every worker was lost or failed" in msg, (kind, msg)


def test_workers_told_of_a_checkpoint_mismatch_count_as_failed():
    core = ServerCore(get_consistency("async"), 3, 5.0, lambda g, lr: None, now=0.0)
    for w in range(3):
        core.hello(w, 0.0)
    core.done(2, 0.0)
    core.save(0, 2, 1.0)
    assert [r.kind for r in core.save(1, 3, 1.0)] == ["error", "error"]
    assert core.lost == [0, 1] and core.state[:2] == [LOST, LOST] and core.finished()


def _sync_rounds(steps: tuple[int, int], caplog) -> list[str]:
    core = ServerCore(get_consistency("sync"), 2, 5.0, lambda g, lr: None, now=0.0)
    for w in range(2):
        core.hello(w, 0.0)
    with caplog.at_level(logging.WARNING, logger="parlay.ps"):
        for t in range(max(steps)):
            for w in range(2):
                if t < steps[w]:
                    core.push(w, t, t, torch.zeros(1), 1.0, 0.0)
            for w in range(2):
                if t + 1 == steps[w]:
                    core.done(w, 0.0)
    return [r.getMessage() for r in caplog.records]


def test_sync_warns_once_when_updates_go_on_without_a_worker_that_finished(caplog):
    assert _sync_rounds((3, 3), caplog) == []
    msgs = _sync_rounds((5, 2), caplog)
    assert len(msgs) == 1 and "worker(s) [1] finished while the others still push" in msgs[0]
    assert "from update 3 on" in msgs[0] and "1 of 2 workers" in msgs[0]


@pytest.mark.parametrize("consistency", ["async", "stale:1"])
def test_max_steps_with_checkpoints_is_refused_where_workers_stop_apart(consistency, tmp_path):
    s = ParameterServerStrategy(consistency=consistency, max_steps=15)
    with pytest.raises(ConfigError, match=r"max_iteration=N"):
        s.use_checkpoint_dir(str(tmp_path))
    ParameterServerStrategy(consistency="sync", max_steps=15).use_checkpoint_dir(str(tmp_path))


def _one_finishes_early():
    x = torch.randn(8, 4)
    with DistributedSession(model=nn.Linear(4, 1), optimizer=torch.optim.SGD,
                            optimizer_args={"lr": 0.1}, consistency="async") as sess:
        if sess.is_ps:
            sess.serve()
            return None
        for _ in range(2 if sess.worker_index == 1 else 3):
            sess.train_step((x, x.sum(1, keepdim=True)), _mse)
        if sess.worker_index == 1:
            return None  # it finishes: not lost
        out = sess.end_epoch(0, 24)
        return out, sess.worker.finished


def test_an_epoch_end_tells_a_finished_worker_from_a_lost_one():
    _, (live, finished), _ = run_world(_one_finishes_early, 3, env=PS1, comm_timeout=10)
    assert live == (24, [1]) and finished == [1]  # worker 1 (rank 2) finished
    core = ServerCore(get_consistency("async"), 3, 5.0, lambda g, lr: None, now=0.0)
    for w in range(3):
        core.hello(w, 0.0)
    core.done(1, 0.0)
    core.lose(2, 1, 0.0)
    assert core.end_epoch(0, 0, 8, 1.0)[0].counts == (8, -2, -1)


_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PARLAY_NUM_PS")


def _explicit_spec_session(kind: str, port: int):
    r = runtime.rank()
    if kind == "hand":  # 1 ps + 2 workers on one host, started without a launcher
        runtime.shutdown()
        for k in _LAUNCHER:
            os.environ.pop(k, None)
        hosts = [f"127.0.0.1:{port + i}" for i in range(3)]
        spec: TaskSpec = TaskSpecDef("ps" if r == 0 else "worker", max(r - 1, 0), None,
                                     hosts[0], ",".join(hosts[1:]))
    else:  # the launcher's last worker evaluates: the other three train
        os.environ["MASTER_PORT"] = str(port)
        spec = TaskSpec.from_env().use_last_worker_as_evaluator()
        torch.distributed.barrier()  # every rank's mesh is up before the evaluator leaves it
        runtime.shutdown()
        if spec.is_evaluator:
            return None
    before = spec.local_index()
    with DistributedSession(task_spec=spec, model=nn.Linear(2, 1), optimizer=torch.optim.SGD,
                            optimizer_args={"lr": 0.1}, max_steps=1) as sess:
        got = (before, runtime.local_rank(), runtime.local_size(), runtime.cross_rank(),
               runtime.cross_size())
        while not sess.should_stop():
            sess.train_step((torch.ones(2, 2), torch.ones(2, 1)), _mse)
    return got


@pytest.mark.parametrize("kind", ["hand", "evaluator"])
def test_a_session_from_an_explicit_spec_uses_the_local_rank_device_fn_promised(kind):
    # device_fn() picks cuda:<spec.local_index()>: the runtime the session starts must agree,
    # and place the tasks on the spec's hosts (one here) or the launcher's nodes (two here).
    env = dict(PS1, PARLAY_TIMEOUT="20")
    if kind == "hand":
        out = run_world(_explicit_spec_session, 3, kind, free_port(), env=env)
        assert out == [(0, 0, 3, 0, 1), (0, 0, 3, 0, 1), (1, 1, 3, 0, 1)]
    else:
        out = run_world(_explicit_spec_session, 4, kind, free_port(), env=env,
                        local_world_size=2)
        assert out == [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (0, 0, 2, 1, 2), None]


def test_an_evaluator_or_a_spec_the_launcher_did_not_start_is_refused_before_init(monkeypatch):
    hosts = {"ps_hosts": ["127.0.0.1:1"], "worker_hosts": ["127.0.0.1:2", "127.0.0.1:3"]}
    evaluator = TaskSpec("worker", 1, **hosts).use_last_worker_as_evaluator()

    def start(spec: TaskSpec) -> None:
        DistributedSession(spec, nn.Linear(2, 1), torch.optim.SGD).start()

    with pytest.raises(ConfigError, match="evaluators take no part in a DistributedSession"):
        start(evaluator)
    monkeypatch.setenv("PARLAY_TIMEOUT", "3")
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"3 training tasks .* started 2 processes"):
        start(TaskSpec("ps", 0, **hosts))  # 3 tasks under a launcher of 2
    assert not runtime.is_initialized()
