"""A gradient journal: in-memory snapshots whose per-step cost is a small record, not a copy of
the whole training state.

A full snapshot copies the model and the optimizer state every step (MNIST MLP with Adam:
14.6 MB, ~2 ms, 10-15% of a 27 ms CPU step here). But a data-parallel step changes that state
only through the optimizer, from the averaged gradients, and replaying the optimizer on the same
gradients from the same state gives the same bits (the same CPU kernels on the same inputs). So
the journal keeps

* a **base**, a full snapshot in the :class:`~parlay.snapshot.store.SnapshotStore`, every
  ``base_every`` steps (and at the first step of a process that cannot replay to where it is,
  or after steps that were not journalled);
* each step's **gradients** exactly as the optimizer consumed them, without a copy: the
  gradient buckets of :class:`~parlay.dp.DistributedOptimizer` (whose views are the ``p.grad``
  the optimizer reads) are pointed, from one step to the next, at the next of
  ``base_every + 2`` slots of host shared memory (``grad-<slot>.pt``, mapped ``MAP_SHARED``),
  so the step's own reduction writes its journal entry;
* a small **record** per step, in the same slot, taken at the end of the step and written
  while the next step waits for its gradient reduction (:mod:`parlay.idle`): the learning rates,
  whether the optimizer stepped (an fp16 overflow or a non-finite skip does not) and the rest
  of the Trainer's state (counters, sampler position, loss scale, RNG states: ~16 KB), as JSON
  and tensors, then committed by storing the step number last. No file is created, renamed or
  deleted per step: the slots are memory the process writes into (the page cache survives it).

Resuming at step ``t`` loads the newest base ``b <= t`` whose records ``b+1 .. t`` are all
there and replays the optimizer over them (~1 ms a step for the MLP), then takes ``t``'s record
for the rest. A slot is reused only after its commit is withdrawn (step number -1), and a
record is committed only after its step, so a process killed at any point leaves every
committed record's gradients intact; with ``base_every + 2`` slots the records back to the
newest committed base always survive (a base is committed during the step after it, see
:mod:`parlay.snapshot.deferred`).

Used only where it is exact and zero-copy: CPU data parallelism whose gradients are bucket
views, without a stateful compressor, ``snapshot_every=1``. Anything else keeps full snapshots.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from parlay._validate import int_var
from parlay.errors import CheckpointError
from parlay.idle import discard, while_waiting
from parlay.snapshot.codec import layout, map_shared
from parlay.snapshot.store import SnapshotStore

__all__ = ["GradientJournal", "base_every_for", "JOURNAL_BUDGET", "JOURNAL_VERSION"]

log = logging.getLogger("parlay")

JOURNAL_VERSION = 1
#: Host memory the journal's slots may take by default (``base_every`` shrinks to fit).
JOURNAL_BUDGET = 512 << 20
#: Longest default distance between bases (a resume replays at most this many steps).
MAX_BASE_EVERY = 32
#: Bytes of a record's JSON part (learning rates, flags, the state's structure) per slot.
RECORD_BYTES = 64 << 10


def base_every_for(grad_bytes: int) -> int:
    """Steps between full snapshots: ``$PARLAY_SNAPSHOT_BASE_EVERY`` when set (0 or 1: no
    journal, a full snapshot every step), else the most, up to :data:`MAX_BASE_EVERY`, whose
    ``base_every + 2`` gradient slots fit in :data:`JOURNAL_BUDGET` (0 when not even 2 do).

    Raises:
        ConfigError: The variable is not an int >= 0.
    """
    name = "PARLAY_SNAPSHOT_BASE_EVERY"
    raw = os.environ.get(name, "").strip()
    if raw:  # steps between full in-memory snapshots; 0: a full one every step
        n = int_var({name: raw}, name) or 0
        return n if n >= 2 else 0
    fits = JOURNAL_BUDGET // max(1, grad_bytes) - 2
    return int(min(MAX_BASE_EVERY, fits)) if fits >= 2 else 0


class GradientJournal:
    """One rank's snapshots as bases plus a gradient journal (see the module's text).

    It answers what a :class:`SnapshotStore` answers to the resume logic (:meth:`steps`,
    :meth:`load`, :attr:`rank`, :attr:`directory`, :meth:`wait`, :meth:`close`, :meth:`clear`),
    and the Trainer calls :meth:`start` once it resumed and :meth:`after_step` after each step.

    Args:
        store: The rank's snapshot store (bases go there; the journal shares its folder).
        buckets: The optimizer's gradient buckets (``params``, ``buffers``, ``views``,
            ``in_flight``, :meth:`use_buffers`, :meth:`views_in`).
        optimizer: The optimizer that consumes the gradients (replayed on resume).
        head: A record's state as :meth:`after_step` gets it: ``(plain, tensors)``, a dict of
            JSON values and a list of CPU tensors (their dtypes and shapes fix the slots'
            layout).
        load_base: Loads a full state (a base) into the trainer.
        compose: ``compose(plain, tensors)``: the trainer's full state as of now, with a
            record's state put in.
        base_every: Steps between bases (>= 2).

    Raises:
        CheckpointError: The slots cannot be created (host shared memory full).
    """

    def __init__(self, store: SnapshotStore, buckets: Any, optimizer: torch.optim.Optimizer,
                 head: tuple[dict[str, Any], list[torch.Tensor]],
                 load_base: Callable[[dict[str, Any]], None],
                 compose: Callable[[dict[str, Any], list[torch.Tensor]], dict[str, Any]],
                 base_every: int) -> None:
        self.store, self.buckets, self.optimizer = store, buckets, optimizer
        self._load_base, self._compose = load_base, compose
        self.base_every = int(base_every)
        self.n_slots = self.base_every + 2
        self.active = True
        self._nbuf = len(buckets.buffers)
        head_tensors = [t.detach() for t in head[1]]
        self._head_sig = [(t.dtype, t.shape) for t in head_tensors]
        # A slot: the buckets, the record's tensors, its JSON bytes, and (step, JSON length):
        # step -1 while nothing is committed in it.
        like = [b.detach() for b in buckets.buffers] + head_tensors + [
            torch.zeros(RECORD_BYTES, dtype=torch.uint8), torch.tensor([-1, 0])]
        self._layout = layout(like)
        need = self.n_slots * sum(t.numel() * t.element_size() for t in like)
        free = shutil.disk_usage(store.directory).free
        if need > free // 2:
            raise CheckpointError(f"a gradient journal of {need >> 20} MB does not fit in half "
                                  f"the {free >> 20} MB free in {store.directory}.")
        self._slots = [map_shared(self._slot_path(k), like, self._layout)
                       for k in range(self.n_slots)]
        # Per slot: the parameters' gradient views, and NumPy views of the record's parts
        # (a NumPy store costs ~0.1 us, a tensor's __setitem__ ~7).
        self._views = [buckets.views_in(t[:self._nbuf]) for t in self._slots]
        self._np = [([h.numpy() for h in t[self._nbuf:-2]], t[-2].numpy(), t[-1].numpy())
                    for t in self._slots]
        # Per slot, the record tensors last copied into it: NumPy's and Python's RNG states
        # come back as the same tensor objects while nobody draws from them (held here, so
        # never freed and their ids never reused), and a slot holding them needs no copy.
        self._wrote: list[list[Any]] = [[None] * len(head_tensors) for _ in self._slots]
        self._last_base: int | None = None
        self._slot, self._expect = 0, -1  # the buckets' slot, and the step it was handed for
        self._pending: tuple[Any, ...] | None = None  # a record taken, not written yet
        self._broken = False  # a record could not be written: the journal goes off

    # ------------------------------------------------------------------ the store's face
    @property
    def rank(self) -> int:
        return self.store.rank

    @property
    def directory(self) -> Path:
        return self.store.directory

    def _slot_path(self, slot: int) -> Path:
        return self.store.directory / f"grad-{slot}.pt"

    def _committed(self) -> dict[int, int]:
        """step -> slot of every committed record."""
        out = {}
        for k, slot in enumerate(self._slots):
            step = int(slot[-1][0])
            if step >= 0:
                out[step] = k
        return out

    def _withdraw(self, slot: int) -> None:
        self._np[slot][2][0] = -1

    def _chain(self, step: int, records: dict[int, int]) -> int | None:
        """The newest base from which ``records`` (:meth:`_committed`) reach ``step``, or
        ``None``."""
        for base in sorted((b for b in self.store.steps() if b <= step), reverse=True):
            if all(t in records for t in range(base + 1, step + 1)):
                return base
        return None

    def steps(self) -> list[int]:
        """Steps this rank can resume at: its bases, and each step its records reach from one."""
        self._flush()
        records = self._committed()
        out = set()
        for base in self.store.steps():
            t = base
            while t == base or t in records:
                out.add(t)
                t += 1
        return sorted(out)

    def load(self, step: int) -> dict[str, Any]:
        """The full training state of ``step``: a base, with the optimizer replayed over the
        records after it (this loads the base into the trainer).

        Raises:
            CheckpointError: No base reaches ``step``, or a record or slot is unreadable.
        """
        records = self._committed()
        base = self._chain(step, records)
        if base is None:
            raise CheckpointError(f"rank {self.rank} holds no snapshot of step {step} in "
                                  f"{self.directory} (it has {self.steps()}).")
        state = self.store.load(base)
        if base == step:
            return state
        entries = [self._read(t, records[t]) for t in range(base + 1, step + 1)]
        self._load_base(state)
        params = self.buckets.params
        try:
            for record, tensors in entries:
                for group, lr in zip(self.optimizer.param_groups, record["lrs"]):
                    group["lr"] = lr
                if record["stepped"]:
                    for p, g in zip(params, self.buckets.views_in(tensors[:self._nbuf])):
                        p.grad = g
                    self.optimizer.step()
            return self._compose(entries[-1][0]["head"], list(entries[-1][1][self._nbuf:]))
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise CheckpointError(f"journal of step {step} in {self.directory} could not be "
                                  f"replayed ({type(e).__name__}: {e}).") from e
        finally:
            for p in params:
                p.grad = None

    def _read(self, step: int, slot: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        tensors = self._slots[slot]
        meta, commit = tensors[-2], tensors[-1]
        try:
            size = int(commit[1])
            record = json.loads(meta[:size].numpy().tobytes())
        except (ValueError, RuntimeError, RecursionError) as e:
            raise CheckpointError(f"journal record of step {step} in {self._slot_path(slot)} is "
                                  f"unreadable ({e}).") from e
        lrs = record.get("lrs") if isinstance(record, dict) else None
        if not (isinstance(record, dict) and record.get("parlay_journal") == JOURNAL_VERSION
                and record.get("key") == self.store.key and record.get("step") == step
                and int(commit[0]) == step and isinstance(record.get("stepped"), bool)
                and isinstance(record.get("head"), dict) and isinstance(lrs, list)
                and len(lrs) == len(self.optimizer.param_groups)
                and all(type(lr) in (int, float) for lr in lrs)):
            raise CheckpointError(f"{self._slot_path(slot)} holds no journal record of step "
                                  f"{step} of run {self.store.key!r} (corrupt). Hint: delete the "
                                  "folder.")
        return record, tensors[:-2]

    # ------------------------------------------------------------------ while training
    def start(self, step: int) -> None:
        """Training continues after ``step`` (where the trainer resumed, or 0): bases and
        records after it belong to a timeline that was not resumed and go; the buckets get
        their first slot. The first step takes a base unless the journal reaches ``step``."""
        self.store.drop_after(step)
        for t, slot in self._committed().items():
            if t > step:
                self._withdraw(slot)
        # The base the records reach this step from counts as the last one (the next base is
        # due base_every steps after it, so the records back to it are never overwritten).
        self._last_base = self._chain(step, self._committed())
        self._use_slot(step + 1)

    def _use_slot(self, step: int) -> None:
        """Hand the buckets the slot for ``step``'s gradients, its record withdrawn first (a
        kill while the slot fills then leaves no record that lies)."""
        slot = step % self.n_slots
        self._withdraw(slot)
        self.buckets.use_buffers(self._slots[slot][:self._nbuf], self._views[slot])
        self._slot, self._expect = slot, step

    def after_step(self, step: int, stepped: bool,
                   head: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]],
                   full: Callable[[], dict[str, Any]], defer: Callable[[], set[int]]) -> None:
        """Record ``step`` (its gradients are in the current slot already); take a base when
        one is due (every ``base_every`` steps, the first step that cannot be replayed, or for
        good once the journal is off); hand the buckets the next slot.

        What the record holds is taken now; it is written into the slot while this thread next
        waits for communication (:mod:`parlay.idle`: the next step's gradient reduction), at the
        latest by the next call, :meth:`wait` or :meth:`close`.

        Raises:
            CheckpointError: A base could not be written.
        """
        self._flush()  # the previous step's record, if no wait wrote it
        # Only a step whose slot was handed out for it has its gradients there. A step not
        # journalled since the last (start() not called, snapshot_every changed in between) or
        # a record that could not be written breaks the chain: a base is due now.
        journalled = self.active and step == self._expect
        due = (not journalled or self._last_base is None
               or step - self._last_base >= self.base_every)
        if journalled:
            pending = None if self._broken else self._capture(step, stepped, head())
            if pending is None:
                self._stop()
                due = True
            else:
                self._pending = pending
                while_waiting(self._write_pending)
        if due:
            self.store.save(step, full(), defer=defer())
            self._last_base = step
        if self.active:
            self._use_slot(step + 1)

    def _capture(self, step: int, stepped: bool,
                 head: tuple[dict[str, Any], list[torch.Tensor]]) -> tuple[Any, ...] | None:
        """What ``step``'s record holds; ``None`` when the step cannot be journalled exactly."""
        if stepped and not all(p.grad is not None and v is not None
                               and p.grad.data_ptr() == v.data_ptr()
                               for p, v in zip(self.buckets.params, self.buckets.views)):
            log.info("gradient journal off: the optimizer stepped on gradients that are not "
                     "its buckets' views (full snapshots from now on)")
            return None
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        plain, tensors = head
        if [(t.dtype, t.shape) for t in tensors] != self._head_sig or \
                not all(type(lr) in (int, float) for lr in lrs):
            log.info("gradient journal off: the recorded state changed shape (full snapshots "
                     "from now on)")
            return None
        return self._slot, step, stepped, lrs, plain, tensors

    def _write_pending(self) -> bool:
        """The pending record, written while this thread waits (:func:`while_waiting`)."""
        self._flush()
        return False

    def _flush(self) -> None:
        """Write the pending record into its slot and commit it (the step number, stored
        last); a record that cannot be written breaks the chain (``_broken``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        discard(self._write_pending)
        slot, step, stepped, lrs, plain, tensors = pending
        try:
            text = json.dumps({"parlay_journal": JOURNAL_VERSION, "key": self.store.key,
                               "step": int(step), "stepped": bool(stepped), "lrs": lrs,
                               "head": plain}).encode()
            if len(text) > RECORD_BYTES:
                raise ValueError(f"a record needs {len(text)} bytes, a slot has {RECORD_BYTES}")
            heads, meta, commit = self._np[slot]
            wrote = self._wrote[slot]
            for i, (d, src) in enumerate(zip(heads, tensors)):
                if wrote[i] is not src:
                    wrote[i] = None  # a copy cut short leaves no claim behind
                    d[...] = src.numpy()
                    wrote[i] = src
            meta[:len(text)] = np.frombuffer(text, dtype=np.uint8)
            commit[1] = len(text)
            commit[0] = step  # the commit: stored last
        except (TypeError, ValueError, RuntimeError) as e:
            log.info("gradient journal off: step %d could not be recorded (%s); full snapshots "
                     "from now on", step, e)
            self._broken = True

    def _stop(self) -> None:
        """Journal off for good: the buckets get private buffers, the records go."""
        self.active = False
        self._pending = None
        discard(self._write_pending)
        self._release_buckets()
        for slot in range(self.n_slots):
            self._withdraw(slot)

    def _release_buckets(self) -> None:
        """The buckets go back to private memory (between steps; the slots keep their data)."""
        if not self.buckets.in_flight:
            self.buckets.use_buffers([b.clone() for b in self.buckets.buffers])

    # ------------------------------------------------------------------ teardown
    def wait(self) -> None:
        """Write the pending record and finish the pending base copy (see
        :meth:`SnapshotStore.wait`)."""
        self._flush()
        self.store.wait()

    def close(self) -> None:
        """Write the pending record, finish the pending base; the buckets get private buffers
        again (the slots stay)."""
        try:
            self._flush()
            self.store.close()
        finally:
            if self.active:
                self._release_buckets()
                self.active = False

    def clear(self) -> None:
        """Delete this rank's snapshots and journal, and unmap the slots."""
        self.close()
        self.store.clear()
        self._slots, self._views, self._np, self._wrote = [], [], [], []
