"""Replicas agree: a bit flipped in one replica is found at the next check, naming the step and
the rank; three replicas heal the odd one exactly, two stop with ReplicaDivergence."""
from __future__ import annotations

import pytest
import torch

from parlay.testing import run_world

pytestmark = pytest.mark.timeout(180)


def _train(flip_rank, flip_after, where, check, steps=12, mode="allreduce", options=None):
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay
    from parlay.errors import ReplicaDivergence

    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 6, generator=g)
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)),
                                nn.CrossEntropyLoss()),
                       TensorDataset(x, (x[:, :3].sum(1) > 0).long()),
                       optimizer_args={"lr": 1e-2}, batch_size=4, max_iteration=steps,
                       snapshot_every=0, replica_check=check, progress=False, mode=mode,
                       strategy_options=options)
    try:
        while t.state.step < steps:
            t.train_on_batch()
            if parlay.rank() == flip_rank and t.state.step == flip_after:
                p = next(t.model.parameters())
                if where == "param":
                    target = p.data
                else:  # Adam's second moment: changes only this rank's next update
                    target = t.strategy.optimizer.state[p]["exp_avg_sq"]
                target.view(-1)[3:4].view(torch.int32).bitwise_xor_(1 << 20)
    except ReplicaDivergence as e:
        return "diverged", e.step, e.ranks, e.agreed_at, str(e)
    finally:
        t.close()
    return "done", [p.detach().clone() for p in t.model.parameters()]


def test_two_replicas_stop_at_the_next_check_naming_the_step_and_ranks():
    out = run_world(_train, 2, 1, 5, "param", 3, timeout=120)
    for kind, step, ranks, agreed_at, text in out:
        assert (kind, step, ranks, agreed_at) == ("diverged", 6, [0, 1], 3)
        assert "replicas disagree at step 6" in text and "last agreed at step 3" in text


def test_three_replicas_heal_the_odd_one_exactly(caplog):
    clean = run_world(_train, 3, -1, 0, "adam", 1, timeout=120)
    healed = run_world(_train, 3, 2, 4, "adam", 1, timeout=120)
    for (kind, params), (_, want) in zip(healed, clean):
        assert kind == "done"
        assert all(torch.equal(p, q) for p, q in zip(params, want)), "healed bit for bit"


def test_replicas_that_agree_train_unchanged_and_checks_are_off_without_replicas():
    checked = run_world(_train, 2, -1, 0, "param", 1, timeout=120)
    unchecked = run_world(_train, 2, -1, 0, "param", 0, timeout=120)
    for (_, a), (_, b) in zip(checked, unchecked):
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_flip_inside_one_pipeline_stage_stops_every_stage():
    out = run_world(_train, 4, 1, 5, "param", 2, 12, "hybrid", {"pp": 2}, timeout=150)
    assert {o[0] for o in out} == {"diverged"}
    assert len({repr(o[1:4]) for o in out}) == 1, "every rank reports the same"
    step, ranks, agreed_at = out[0][1:4]
    assert step == 6 and agreed_at == 4 and 1 in ranks and len(ranks) == 2


def test_bad_replica_check_is_a_clear_error():
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay
    from parlay.errors import ConfigError

    with pytest.raises(ConfigError, match="replica_check must be 'auto', an int >= 0 or None"):
        parlay.Trainer(lambda: (nn.Linear(2, 2), nn.MSELoss()),
                       TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2)), replica_check=-1)


def _train_ckpt(ckpt, flip_rank, steps=10):
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay
    from parlay.errors import ReplicaDivergence

    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(5))
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)),
                                nn.CrossEntropyLoss()),
                       TensorDataset(x, (x[:, :3].sum(1) > 0).long()),
                       optimizer_args={"lr": 1e-2}, batch_size=4, max_iteration=steps,
                       checkpoint_dir=ckpt, checkpoint_every=2, snapshot_every=1,
                       replica_check=10, progress=False)
    start = (t.state.step, t.resumed_from_snapshot)
    try:
        while not t.should_stop():
            t.train_on_batch()
            if parlay.rank() == flip_rank and t.state.step == 5:
                next(t.model.parameters()).data.view(-1)[3:4].view(torch.int32) \
                    .bitwise_xor_(1 << 20)
    except ReplicaDivergence as e:
        return "diverged", e.step, e.agreed_at, str(e)
    finally:
        t.close()
    return "done", start, [p.detach().clone() for p in t.model.parameters()]


def test_two_replicas_keep_only_agreed_checkpoints_and_a_relaunch_resumes_one(tmp_path):
    env = {"PARLAY_RUN_ID": "rc-ckpt", "PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm")}
    clean = run_world(_train_ckpt, 2, str(tmp_path / "clean"), -1, env=env, timeout=120)
    ck = str(tmp_path / "ckpt")
    out = run_world(_train_ckpt, 2, ck, 1, env=env, timeout=120)
    for kind, step, agreed_at, text in out:  # found by the check before step 6's checkpoint
        assert (kind, step, agreed_at) == ("diverged", 6, 4), text
        assert "relaunching the job resumes an agreed state" in text
    # The snapshots of steps 5 and 6 are gone, the checkpoint of step 4 was agreed: resume it.
    again = run_world(_train_ckpt, 2, ck, -1, env=env, timeout=120)
    for (kind, start, params), (_, _, want) in zip(again, clean):
        assert (kind, start) == ("done", (4, None))
        assert all(torch.equal(p, q) for p, q in zip(params, want)), "bit-exact after relaunch"
