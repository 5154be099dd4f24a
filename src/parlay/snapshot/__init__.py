"""In-memory snapshots of the training state, for restarts that lose at most one step.

:class:`SnapshotStore` keeps one rank's newest snapshots in host shared memory
(:mod:`parlay.snapshot.store`); a :class:`GradientJournal` keeps them as a full snapshot every
few steps plus each step's averaged gradients, which the optimizer's buckets reduce straight
into shared memory, and replays the optimizer on resume (:mod:`parlay.snapshot.journal`: data
parallel on CPU); :func:`agree` makes the ranks resume from the same step
(:mod:`parlay.snapshot.resume`).
"""
from parlay.snapshot.journal import GradientJournal
from parlay.snapshot.resume import (agree, journal_for_trainer, open_for_trainer,
                                    optimizer_tensors, resume_trainer, run_key, trainer_head)
from parlay.snapshot.store import FORMAT_VERSION, SnapshotStore, default_root

__all__ = ["SnapshotStore", "agree", "run_key", "open_for_trainer", "resume_trainer",
           "optimizer_tensors", "GradientJournal", "journal_for_trainer", "trainer_head",
           "default_root",
           "FORMAT_VERSION"]
