"""In-memory snapshots of the training state, for restarts that lose at most one step.

:class:`SnapshotStore` keeps one rank's newest full copies in host shared memory, the bulk of
each copied while the rank waits for communication (:mod:`parlay.snapshot.store`,
:mod:`parlay.snapshot.deferred`); :func:`agree` makes the ranks resume from the same step
(:mod:`parlay.snapshot.resume`).
"""
from parlay.snapshot.resume import (agree, key_or_off, open_for_trainer, optimizer_tensors,
                                    resume_trainer, run_key)
from parlay.snapshot.store import FORMAT_VERSION, SnapshotStore, default_root

__all__ = ["SnapshotStore", "agree", "run_key", "key_or_off", "open_for_trainer", "resume_trainer",
           "optimizer_tensors", "default_root", "FORMAT_VERSION"]
