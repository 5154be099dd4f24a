"""The gradient journal in one process: the real gradient buckets (with the local reducer, which
needs no process group), a real optimizer, real slot files. A journal opened afresh on the same
folder (a restarted process) replays to the live state bit for bit, and corrupted slots give
only :class:`~parlay.errors.CheckpointError` (see ``test_fuzz.py`` for the conventions)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parlay.compress.base import CommStats, NoneCompressor
from parlay.dp.buckets import BucketPlan, ParamInfo
from parlay.dp.hooks import GradientBuckets, LocalReducer
from parlay.errors import CheckpointError
from parlay.snapshot import SnapshotStore
from parlay.snapshot.journal import RECORD_BYTES, GradientJournal

BASE_EVERY = 4


class Run:
    """A model, its optimizer, buckets and journal on ``root`` (``fresh``: started at step 0;
    otherwise a restarted process that has not resumed yet); ``train(n)`` takes n steps."""

    def __init__(self, root: Path, seed: int, fresh: bool = True) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                         torch.nn.Linear(7, 3))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        named = list(self.model.named_parameters())
        plan = BucketPlan.build([ParamInfo(n, p.numel(), p.dtype, "cpu") for n, p in named],
                                cap_bytes=100)  # several buckets
        self.buckets = GradientBuckets(named, plan, LocalReducer(), NoneCompressor(),
                                       CommStats(), passes=1, prescale=0.5, postscale=1.0,
                                       overlap=True, as_views=True, sparse_only=False)
        self.step = 0
        self.store = SnapshotStore("journal-unit", 0, root=root)
        self.journal = GradientJournal(self.store, self.buckets, self.opt, self.head(),
                                       self.load_base, self.compose, BASE_EVERY)
        if fresh:  # a restarted process resumes first, then starts (as the Trainer does)
            self.journal.start(0)

    def head(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return {"step": self.step}, [torch.get_rng_state()]

    def full(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "step": self.step}

    def load_base(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])

    def compose(self, plain: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
        return {**self.full(), "step": plain["step"], "rng": tensors[0]}

    def train(self, n: int) -> None:
        g = torch.Generator().manual_seed(self.step)
        for _ in range(n):
            x = torch.randn(8, 5, generator=g)
            self.opt.zero_grad(set_to_none=True)  # as the Trainer: before, not after the step
            self.model(x).pow(2).mean().backward()
            self.buckets.finish()
            for group in self.opt.param_groups:
                group["lr"] = 1e-2 / (1 + self.step)  # a schedule: each record keeps its lr
            self.opt.step()
            self.step += 1
            self.journal.after_step(self.step, True, self.head, self.full, set)


def _state(run: Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()] + [
        v.clone() for st_ in run.opt.state.values() for v in st_.values()]


def test_a_restarted_process_replays_to_the_live_state_bit_for_bit(tmp_path):
    live = Run(tmp_path, seed=0)
    live.train(11)  # bases at steps 1, 5 and 9; records of 10 and 11
    live.journal.wait()
    want = _state(live)
    assert live.store.steps() == [5, 9] and live.journal.steps()[-1] == 11
    again = Run(tmp_path, seed=1, fresh=False)  # all it holds comes from the journal
    state = again.journal.load(11)
    assert state["step"] == 11
    assert all(torch.equal(a, b) for a, b in zip(_state(again), want))
    # The optimizer's learning rates are the recorded ones (the schedule's value at step 11).
    assert again.opt.param_groups[0]["lr"] == live.opt.param_groups[0]["lr"]
    # Continuing after the replay matches continuing the live run.
    again.step = 11
    again.journal.start(11)
    again.train(3)
    again.journal.wait()
    live.train(3)
    live.journal.wait()  # its last record is written; nothing stays queued on this thread
    assert all(torch.equal(a, b) for a, b in zip(_state(again), _state(live)))


def test_a_slot_is_withdrawn_before_it_is_reused_and_later_records_go_at_a_restart(tmp_path):
    live = Run(tmp_path, seed=0)
    live.train(7)
    live.journal.wait()
    # The buckets hold step 8's slot: its old record (step 8 - 6 = 2) is gone already.
    assert 2 not in live.journal._committed() and 7 in live.journal._committed()
    again = Run(tmp_path, seed=1, fresh=False)
    again.journal.start(6)  # resumed at 6: step 7 belongs to a timeline that was not resumed
    assert max(again.journal.steps()) == 6


flips = st.lists(st.tuples(st.integers(0, RECORD_BYTES + 15), st.integers(1, 255)),
                 min_size=1, max_size=6)


@pytest.fixture(scope="module")
def written() -> Path:
    root = Path(tempfile.mkdtemp(prefix="parlay-journal-fuzz-"))
    live = Run(root, seed=0)
    live.train(7)  # bases 1 and 5, records 6 and 7
    live.journal.close()
    return root


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from([6, 7]), flips)
def test_corrupted_records_give_only_checkpoint_errors(written, step, changes):
    journal = Run(written, seed=1, fresh=False).journal
    slot = journal._committed()[step]
    meta, commit = journal._np[slot][1], journal._np[slot][2]
    keep = meta.copy(), commit.copy()
    raw = memoryview(meta)  # the record's JSON bytes, then (step, length) as bytes
    tail = memoryview(commit).cast("B")
    try:
        for at, xor in changes:
            if at < RECORD_BYTES:
                raw[at] ^= xor
            else:
                tail[at - RECORD_BYTES] ^= xor
        try:
            steps = journal.steps()
            if 7 in steps:
                journal.load(7)
        except CheckpointError:
            pass
    finally:
        meta[:], commit[:] = keep


class SharedHead(Run):
    """A head whose second tensor is one shared object until it changes (as NumPy's and
    Python's RNG states come back from :func:`parlay.rngstate.rng_state`)."""

    def __init__(self, root: Path) -> None:
        self.shared, self.seen = torch.zeros(4), {}
        super().__init__(root, seed=0)

    def head(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if self.step % 5 == 3:  # drawn from now and then: a new object, new values
            self.shared = torch.full((4,), float(self.step))
        self.seen[self.step] = self.shared.clone()
        return {"step": self.step}, [torch.get_rng_state(), self.shared]


def test_each_record_holds_its_own_steps_state_when_unchanged_tensors_skip_their_copy(tmp_path):
    live = SharedHead(tmp_path)
    live.train(23)  # 6 slots: each reused three times, the shared tensor changing in between
    live.journal.wait()
    committed = live.journal._committed()
    assert len(committed) >= 4
    for step, slot in committed.items():
        _, tensors = live.journal._read(step, slot)
        assert torch.equal(tensors[live.journal._nbuf + 1], live.seen[step]), step
