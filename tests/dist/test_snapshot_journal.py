"""The gradient journal (:mod:`parlay.snapshot.journal`): in-memory snapshots as a full copy
every ``base_every`` steps plus each step's gradients, replayed on resume.

Two phases on real gloo ranks share one run id and snapshot folder: the first trains some steps
and ends like a crash (the snapshots stay), the second resumes from the journal, which replays
the optimizer from the newest base over the steps recorded after it, and trains to the end. Its
final state (weights, optimizer state, loss scale, RNG) must equal an uninterrupted run's bit
for bit, also across steps an fp16 overflow skipped.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(150)
STEPS = 12


def _phase(steps: int, finish: bool, precision: str = "fp32") -> tuple[tuple, dict, list[int]]:
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay
    from parlay.snapshot import GradientJournal

    g = torch.Generator().manual_seed(11)
    x = torch.randn(44, 6, generator=g)
    # fp16: steps skipped by overflows; fp32: gradients clipped in place before the update.
    options = {"loss_scale": 2.0 ** 24} if precision == "fp16" else None
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3),
                                              nn.Linear(16, 2)), nn.CrossEntropyLoss()),
                       TensorDataset(x, (x[:, :3].sum(1) > 0).long()),
                       optimizer_args={"lr": 1e-2}, batch_size=4, max_iteration=STEPS,
                       precision=precision, strategy_options=options, progress=False,
                       grad_clip=None if precision == "fp16" else 0.05)
    journal = isinstance(t._snap, GradientJournal)
    start = (t.state.step, t.resumed_from_snapshot, journal)
    while t.state.step < steps:
        t.train_on_batch()
    if journal:
        t._snap.wait()  # a skipped step takes no optimizer step, which would finish the copy
    bases = t._snap.store.steps() if journal else []
    if finish:
        t.should_stop()
    s = t.strategy
    opt = s.optimizer.state_dict()
    state = {"params": [p.detach().clone() for p in t.model.parameters()],
             "opt": [v.clone() for st in opt["state"].values() for v in st.values()
                     if isinstance(v, torch.Tensor)],
             "lrs": [g["lr"] for g in opt["param_groups"]],
             "scale": s.scaler.state_dict() if s.scaler is not None else None,
             "skipped": t.skipped_steps, "step": t.state.step,
             "rng": torch.rand(3)}  # the RNG state resumed: the next draws agree
    t.close()  # without should_stop(): like a crash, the snapshots stay
    return start, state, bases


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), k
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
        else:
            assert x == y, k


@pytest.mark.parametrize("precision, base_every, stop", [
    ("fp32", 4, 7),    # bases at steps 1 and 5: the resume replays steps 6 and 7 (clipped)
    ("fp32", 3, 9),    # bases 1, 4, 7; replays 8, 9 (the records of 2..7 were rotated out)
    ("fp16", 4, 6)])   # steps skipped by fp16 overflows are recorded as such and not replayed
def test_resume_replays_the_journal_bit_identical(tmp_path, precision, base_every, stop):
    from parlay.testing import run_world

    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "journal",
           "PARLAY_SNAPSHOT_BASE_EVERY": str(base_every)}
    first = run_world(_phase, 2, stop, False, precision, env=env, timeout=90)
    for start, _, bases in first:
        assert start == (0, None, True), "the journal is on, from the start"
        assert stop not in bases and max(bases) >= stop - base_every, bases
    second = run_world(_phase, 2, STEPS, True, precision, env=env, timeout=90)
    full = run_world(_phase, 2, STEPS, True, precision, timeout=90,
                     env={**env, "PARLAY_RUN_ID": "whole", "PARLAY_SNAPSHOT_BASE_EVERY": "0"})
    if precision == "fp16":
        assert full[0][1]["skipped"] > 0, "the test needs steps that overflowed"
    for (start, got, _), (full_start, want, _) in zip(second, full):
        assert start == (stop, stop, True)
        assert full_start == (0, None, False), "BASE_EVERY=0: full snapshots, no journal"
        _same(got, want)
    assert not [f for f in (tmp_path / "shm").rglob("*") if f.is_file()], "cleared at the end"


def _choices(tmp: str) -> list:
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay
    from parlay.errors import ConfigError
    from parlay.snapshot import GradientJournal

    x = torch.randn(16, 6)
    ds = TensorDataset(x, (x[:, 0] > 0).long())

    def kind(**kw: object) -> str:
        t = parlay.Trainer(lambda: (nn.Linear(6, 2), nn.CrossEntropyLoss()), ds, batch_size=4,
                           max_iteration=2, progress=False, **kw)
        got = type(t._snap).__name__ if t._snap is not None else None
        if isinstance(t._snap, GradientJournal):
            # Gradients the optimizer does not read from the buckets: full snapshots from then
            # on, and the buckets get private memory again.
            t.train_on_batch()
            t.model.weight.register_hook(lambda g: g.clone())
            real_step = t.strategy.optimizer.optimizer.step

            def step_on_copies(*a: object, **k: object) -> object:
                for p in t.model.parameters():
                    p.grad = p.grad.clone()
                return real_step(*a, **k)
            t.strategy.optimizer.optimizer.step = step_on_copies
            t.train_on_batch()
            t._snap.wait()  # the base of step 2 is committed
            got += f" active={t._snap.active} bases={t._snap.store.steps()}"
            buckets = t.strategy.optimizer.gradient_buckets
            try:
                buckets.use_buffers([torch.zeros(3)])
            except ConfigError as e:
                got += " | " + str(e).split(" with ")[0]
        t.should_stop()
        return got

    return [kind(), kind(snapshot_every=2), kind(compression="topk:0.5"),
            kind(snapshot_every=0)]


def test_the_journal_is_used_where_it_is_exact_and_steps_back_otherwise(tmp_path):
    from parlay.testing import run_world

    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "choices"}
    out = run_world(_choices, 2, str(tmp_path), env=env, timeout=90)
    assert out[0] == out[1] == [
        "GradientJournal active=False bases=[1, 2] | GradientBuckets.use_buffers() needs one "
        "flat buffer per bucket",
        "SnapshotStore", "SnapshotStore", None]


def test_base_every_is_read_from_the_environment_and_checked(monkeypatch):
    from parlay.errors import ConfigError
    from parlay.snapshot.journal import JOURNAL_BUDGET, MAX_BASE_EVERY, base_every_for

    monkeypatch.delenv("PARLAY_SNAPSHOT_BASE_EVERY", raising=False)
    assert base_every_for(1 << 20) == MAX_BASE_EVERY
    assert base_every_for(JOURNAL_BUDGET // 6) == 4           # 6 slots fit: a base every 4
    assert base_every_for(JOURNAL_BUDGET // 3) == 0           # 3 slots: no journal
    for value, want in (("7", 7), ("1", 0), ("0", 0), (" 3 ", 3)):
        monkeypatch.setenv("PARLAY_SNAPSHOT_BASE_EVERY", value)
        assert base_every_for(1 << 40) == want
    monkeypatch.setenv("PARLAY_SNAPSHOT_BASE_EVERY", "-2")
    with pytest.raises(ConfigError, match="expected an integer >= 0, got -2"):
        base_every_for(1)
    monkeypatch.setenv("PARLAY_SNAPSHOT_BASE_EVERY", "often")
    with pytest.raises(ConfigError, match="PARLAY_SNAPSHOT_BASE_EVERY: expected an integer, "
                       "got 'often'"):
        base_every_for(1)


def test_rng_state_reflects_every_draw():
    import random

    import numpy as np

    from parlay.rngstate import rng_state, set_rng_state

    before = rng_state()
    again = rng_state()
    assert again["python"]["state"] is before["python"]["state"], "unchanged: not converted again"
    random.random()
    np.random.rand()
    after = rng_state()
    assert not torch.equal(after["python"]["state"], before["python"]["state"])
    assert after["numpy"]["pos"] != before["numpy"]["pos"]
    set_rng_state(before)
    first = (random.random(), float(np.random.rand()))
    set_rng_state(after)
    second = (random.random(), float(np.random.rand()))
    set_rng_state(before)
    assert (random.random(), float(np.random.rand())) == first != second
    # NumPy's legacy Gaussian cache is used up without moving the generator: still seen.
    np.random.randn()
    cached = rng_state()["numpy"]
    np.random.randn()
    used = rng_state()["numpy"]
    assert (cached["has_gauss"], used["has_gauss"]) == (1, 0) and cached["pos"] == used["pos"]
    set_rng_state({**before, "numpy": cached})  # the same bytes, the Gaussian cached again
    assert rng_state()["numpy"]["has_gauss"] == 1
    # Python's gauss() likewise caches its second value in the instance, outside the generator.
    random.gauss(0.0, 1.0)
    cached = rng_state()["python"]
    random.gauss(0.0, 1.0)
    used = rng_state()["python"]
    assert cached["gauss"] is not None and used["gauss"] is None
    assert torch.equal(cached["state"], used["state"])
