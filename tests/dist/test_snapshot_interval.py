"""The snapshot interval: ``snapshot_every="auto"`` keeps snapshots within 2% of training, the
ranks agree on it, and the printing rank logs how many steps a crash can cost."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.trainer import persistence
from parlay.trainer.persistence import BUDGET, PROBE_STEPS, choose_interval

pytestmark = pytest.mark.timeout(120)


def test_interval_is_the_smallest_that_keeps_snapshots_within_the_budget():
    assert choose_interval(0.0, 0.01) == 1
    assert choose_interval(0.0002, 0.01) == 1          # exactly 2% every step
    assert choose_interval(0.00021, 0.01) == 2
    assert choose_interval(0.001, 0.01) == 5           # 10% per copy: every 5th step
    assert choose_interval(0.05, 0.001) == 2500
    for copy, step in [(0.003, 0.02), (0.0007, 0.004), (1e-5, 1.0)]:
        k = choose_interval(copy, step)
        assert copy / (k * step) <= BUDGET + 1e-12
        assert k == 1 or copy / ((k - 1) * step) > BUDGET, "not the smallest such interval"


def _build():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), nn.CrossEntropyLoss()


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _train(capsys, steps: int, **options) -> tuple[parlay.Trainer, str, list[int]]:
    t = parlay.Trainer(_build, _data(), batch_size=4, max_iteration=steps, progress=False,
                       **options)
    held: list[int] = []
    while not t.should_stop():
        t.train_on_batch()
        store = t.persistence.store
        if store is not None:
            store.wait()
            held = store.steps()
    return t, capsys.readouterr().out, held


@pytest.fixture
def run_id(monkeypatch, tmp_path):
    monkeypatch.setenv("PARLAY_RUN_ID", f"interval-{tmp_path.name}")
    monkeypatch.setenv("PARLAY_SNAPSHOT_DIR", str(tmp_path / "shm"))
    yield
    parlay.shutdown()


def test_auto_interval_is_measured_logged_and_kept(run_id, monkeypatch, capsys):
    seen = []

    def choose(copy_s, step_s):
        seen.append((copy_s, step_s))
        return 3

    monkeypatch.setattr(persistence, "choose_interval", choose)
    t, out, held = _train(capsys, 3 * PROBE_STEPS + 6)
    (copy_s, step_s), = seen
    assert copy_s > 0 and step_s > 0, "a real snapshot and a real step were timed"
    assert t.snapshot_every == 3
    assert "snapshot interval: measured over the first steps" in out
    assert "in-memory snapshots every 3 step(s)" in out and "steps at risk: 3" in out
    # Measured over the first 3 * PROBE_STEPS steps, then every third: the newest two held.
    assert held == [3 * PROBE_STEPS + 3, 3 * PROBE_STEPS + 6]


def test_auto_interval_prices_what_a_snapshot_costs_the_step(run_id, monkeypatch, capsys):
    """The cost is what a snapshot adds to a step (steps timed with and without), not only the
    store's own copy time: here each save costs its step 100 ms outside the store's timing
    (large against a loaded machine's noise in the steps' times)."""
    import time

    from parlay.snapshot import SnapshotStore

    save = SnapshotStore.save

    def slow(self, *args, **kwargs):
        time.sleep(0.1)  # the cost under test, not a synchronisation
        return save(self, *args, **kwargs)

    seen = []
    monkeypatch.setattr(SnapshotStore, "save", slow)
    monkeypatch.setattr(persistence, "choose_interval", lambda c, s: seen.append((c, s)) or 7)
    t, out, _ = _train(capsys, 3 * PROBE_STEPS + 1)
    (cost_s, step_s), = seen
    assert cost_s >= 0.05, (cost_s, step_s)
    assert t.snapshot_every == 7 and "steps at risk: 7" in out


def test_the_step_that_chooses_the_interval_is_snapshotted(run_id, monkeypatch, capsys):
    """The probe's last snapshot is PROBE_STEPS + 1 steps old when it chooses 11: the next
    multiple of 11 (22) would put 14 steps at risk, not the 11 logged."""
    monkeypatch.setattr(persistence, "choose_interval", lambda c, s: 11)
    t, out, held = _train(capsys, 21)
    assert "steps at risk: 11" in out and t.snapshot_every == 11
    assert held == [2 * PROBE_STEPS - 1, 3 * PROBE_STEPS]   # 7, 12: then 22, 33...


@pytest.mark.parametrize("options, risk", [
    ({"snapshot_every": 2}, 2),
    ({"snapshot_every": 0}, 6),                                      # nothing saved: all
    ({"snapshot_every": 0, "checkpoint_every": 4, "checkpoint_dir": "ck"}, 4),
    ({"snapshot_every": None, "checkpoint_dir": "ck"}, 16),          # an epoch of 16 steps
    ({"snapshot_every": 4, "checkpoint_every": 3, "checkpoint_dir": "ck"}, 3)])  # the newer
def test_steps_at_risk_are_logged_at_start(run_id, tmp_path, capsys, options, risk):
    if "checkpoint_dir" in options:
        options = {**options, "checkpoint_dir": str(tmp_path / "ck")}
    t, out, _ = _train(capsys, 6, **options)
    assert f"; steps at risk: {risk}" in out
    assert t.snapshot_every == (options["snapshot_every"] or 0)


def test_a_failing_snapshot_stops_snapshots_not_training(run_id, monkeypatch, capsys):
    from parlay.errors import CheckpointError
    from parlay.snapshot import SnapshotStore

    save = SnapshotStore.save

    def failing(self, step, *args, **kwargs):
        if step == 2:  # while the interval is being measured
            raise CheckpointError("no room left")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "save", failing)
    with pytest.warns(UserWarning, match="in-memory snapshots stopped on rank 0: no room left"):
        t, out, held = _train(capsys, 8)
    assert t.state.step == 8 and t.persistence.store is None and t.snapshot_every == 0
    assert "in-memory snapshots every" not in out


def _agree(want: list[int]) -> int:
    persistence.choose_interval = lambda copy_s, step_s: want[parlay.rank()]
    t = parlay.Trainer(_build, _data(), batch_size=4, max_iteration=3 * PROBE_STEPS + 2,
                       progress=False)
    t.train_to_end()
    return t.snapshot_every


def test_ranks_agree_on_the_largest_interval_any_asks_for(tmp_path):
    from parlay.testing import run_world

    env = {"PARLAY_RUN_ID": f"agree-{tmp_path.name}", "PARLAY_SNAPSHOT_DIR": str(tmp_path)}
    assert run_world(_agree, 2, [2, 5], env=env) == [5, 5]
