"""What a parameter server keeps across restarts: shard checkpoints on disk and in memory.

:class:`ShardPersistence` is a mixin of :class:`~parlay.ps.server.Server` (it uses the server's
``flat`` shard, ``optimizer``, ``core``, ``plan``, ``index`` and ``worker_ranks``):

* disk: every ``checkpoint_every`` updates (``sync``: ``ps-<k>.step-<version>.pt``, resumed at
  the newest version every server holds; ``async``/``stale``: ``ps-<k>.pt``), or, when the
  workers keep their own checkpoints (a Trainer), ``ps-<k>.step-<t>.pt`` when every live
  worker asks for step ``t``; a file records its session's run id, as the workers' files do,
  and is not resumed with the workers' files of another run
  (:func:`~parlay.ps.recovery.agree_resume`);
* memory (``sync`` only): an in-memory snapshot (:class:`~parlay.snapshot.SnapshotStore`) of
  the shard, optimizer state, version and worker clocks right after each update, so a restart
  resumes at most one step back, from the step every server and worker holds. In ``sync`` the
  version after update ``t`` is exactly the state of every worker's step ``t``. ``async`` and
  ``stale`` have no such step: workers push at their own pace, so no version of a server
  matches a step at which every worker stands (and other servers apply the same pushes at other
  moments); they keep the disk checkpoints, whose save barrier holds every live worker and
  server at one step.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from parlay.ps.chunks import ELEMENTWISE
from parlay.runinfo import recipe_difference
from parlay.statefile import save_atomic, verify
from parlay.errors import CheckpointError
from parlay.snapshot import SnapshotStore, optimizer_tensors

__all__ = ["ShardPersistence", "snapshot_steps", "SNAPSHOTS_KEPT", "read_shard", "step_path"]

log = logging.getLogger("parlay.ps")

#: Worker-requested checkpoints a server keeps (the Trainer's default ``keep_last``).
SNAPSHOTS_KEPT = 3
_SNAPSHOT = re.compile(r"^ps-(\d+)\.step-(\d+)\.pt$")


def snapshot_steps(checkpoint_dir: str, index: int) -> list[int]:
    """Steps of the worker-requested checkpoints server ``index`` holds, ascending."""
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return []
    found = (_SNAPSHOT.match(n) for n in names)
    return sorted(int(m.group(2)) for m in found if m and int(m.group(1)) == index)


def read_shard(path: str, tag: int | None = None, server: int | None = None) -> dict[str, Any]:
    """A server's checkpoint file, verified (its CRC-32, its step when ``tag`` is given and its
    server when ``server`` is).

    Raises:
        CheckpointError: Unreadable, corrupt, or of another step or server than its name says.
    """
    try:
        sd = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a CheckpointError
        raise CheckpointError(f"could not read checkpoint {path!r}: {e}. Hint: the file is "
                              "truncated or corrupt; delete it (and the workers' files of "
                              "the same step) to resume from the previous one.") from e
    sd = verify(sd, Path(path), "parameter-server checkpoint", "delete it (and the "
                "workers' files of the same step) to resume from the previous one.")
    if tag is not None and sd.get("tag") != tag:
        raise CheckpointError(f"checkpoint {path!r} says step {sd.get('tag')}, its name says "
                              f"step {tag}: it was copied or renamed. Hint: delete it (and "
                              "the workers' files of that step) to resume the previous one.")
    if server is not None and sd.get("server", server) != server:
        raise CheckpointError(f"checkpoint {path!r} holds server {sd['server']}'s shard, its name "
                              f"says server {server}: it was copied, renamed or swapped. Hint: "
                              "put each server's files back under their own names, or delete "
                              "the step (with the workers' files of it) to resume the previous "
                              "one.")
    return dict(sd)


def _check_state_shapes(optimizer: torch.optim.Optimizer) -> None:
    """An element-wise optimizer's state has its parameter's shape: a state cut at other
    chunk bounds (the same number of pieces) loads without a word, then fails in a step."""
    if not isinstance(optimizer, ELEMENTWISE):  # (others are never cut into chunks)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape:
                    raise ValueError(f"state {k!r} of shape {tuple(v.shape)} for a piece of "
                                     f"shape {tuple(p.shape)}")


def step_path(checkpoint_dir: str, index: int, tag: int) -> str:
    """File of checkpoint ``tag`` (a worker step) of server ``index``."""
    return os.path.join(checkpoint_dir, f"ps-{index}.step-{int(tag):010d}.pt")


def _settings(optimizer: torch.optim.Optimizer, base_lrs: list[Any]) -> dict[str, str]:
    """The optimizer's settings a shard file must have been written with, per parameter group
    (its base learning rates, not the scaled ones, and every other hyperparameter)."""
    out: dict[str, str] = {}
    for i, (group, lr) in enumerate(zip(optimizer.param_groups, base_lrs)):
        for k, v in {**group, "lr": lr}.items():
            if k not in ("params", "initial_lr"):
                out[k if i == 0 else f"group {i} {k}"] = repr(v)
    return out


class ShardPersistence:
    """Disk checkpoints and in-memory snapshots of a server's shard (a mixin of Server)."""

    index: int
    plan: Any
    policy: Any
    flat: torch.Tensor
    optimizer: torch.optim.Optimizer
    base_lrs: list[Any]
    core: Any
    worker_ranks: list[int]
    dir: str | None
    path: str | None
    #: In-memory snapshots (``sync`` with snapshotting workers), else ``None``.
    memory: SnapshotStore | None = None
    #: Versions between in-memory snapshots (the workers' ``snapshot_every``; 0: none).
    snapshot_every: int = 1
    #: The session's run id (:attr:`~parlay.ps.session.DistributedSession.run`).
    run: int = 0

    # -- disk ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Shard, optimizer state, version, worker clocks and run id."""
        return {"format": 1, "server": self.index, "run": self.run, "plan": self.plan.rows(),
                "flat": self.flat.clone(), "optimizer": self.optimizer.state_dict(),
                "optimizer_class": type(self.optimizer).__qualname__,
                "settings": _settings(self.optimizer, self.base_lrs),
                "version": self.core.version, "clocks": list(self.core.clocks),
                "histogram": dict(self.core.histogram)}

    def save(self) -> None:
        """Checkpoint the shard (no-op without a checkpoint directory). ``sync``: as the step
        file of its version (every server writes the same versions, so a restart resumes the
        newest one all hold, also when a crash left one server an update ahead); ``async`` /
        ``stale`` (no version is common to all servers): ``ps-<index>.pt``, atomically."""
        if self.path and self.policy.aggregate:
            self.snapshot(self.core.version)
        elif self.path:
            save_atomic(self.state_dict(), self.path)

    def snapshot_path(self, tag: int) -> str:
        """File of checkpoint ``tag`` (a worker step) of this server."""
        assert self.dir is not None
        return step_path(self.dir, self.index, tag)

    def snapshot(self, tag: int) -> None:
        """Save checkpoint ``tag`` (every live worker waits at its step ``tag``) and keep the
        newest :data:`SNAPSHOTS_KEPT` up to it. Later steps (an earlier run's, in a folder
        whose workers' files were deleted) never count as newer: they would prune this run's.
        No-op without a checkpoint directory."""
        if not self.dir:
            return
        save_atomic({**self.state_dict(), "tag": int(tag)}, self.snapshot_path(tag))
        older = [t for t in snapshot_steps(self.dir, self.index) if t <= tag]
        for old in older[:-SNAPSHOTS_KEPT]:
            try:
                os.remove(self.snapshot_path(old))
            except FileNotFoundError:
                pass

    def _load(self, path: str, tag: int | None = None) -> tuple[int, list[int]]:
        return self._restore(read_shard(path, tag, self.index), f"checkpoint {path!r}")

    def _restore(self, sd: dict[str, Any], what: str) -> tuple[int, list[int]]:
        n = len(self.worker_ranks)
        if sd.get("plan") != self.plan.rows() or len(sd.get("clocks", [])) != n:
            raise CheckpointError(
                f"{what} was written for a different placement or number of "
                f"workers (expected {n} workers and the current ShardPlan). "
                "Hint: resume with the same model, --ps count and worker count, or use a new "
                "checkpoint_dir.")
        mine = type(self.optimizer).__qualname__
        if sd.get("optimizer_class", mine) != mine:  # (files before it was recorded: unchecked)
            raise CheckpointError(f"{what} holds the state of a {sd['optimizer_class']} optimizer, "
                                  f"this run steps {mine}. Hint: resume with the optimizer "
                                  "that wrote it, or use a new checkpoint_dir.")
        # (files before the settings were recorded: unchecked)
        diff = recipe_difference(sd.get("settings"), _settings(self.optimizer, self.base_lrs))
        if diff:
            raise CheckpointError(f"{what} was written with other optimizer settings ({diff}); "
                                  "loading it would silently replace this run's. Hint: resume "
                                  "with the optimizer_args that wrote it, or use a new "
                                  "checkpoint_dir.")
        self.flat.copy_(sd["flat"])
        try:
            self.optimizer.load_state_dict(sd["optimizer"])
            _check_state_shapes(self.optimizer)
        except ValueError as e:  # the server's parameters are cut at the sync chunk bounds
            raise CheckpointError(f"{what}: its optimizer state does not fit this server's "
                                  f"parameters ({e}). Hint: resume with the same optimizer, "
                                  "consistency and PARLAY_PS_CHUNK_BYTES as the run that "
                                  "wrote it (unset, ranks that share one host send pushes "
                                  "whole; across hosts, in chunks).") from e
        log.info("ps%d resumed from %s at version %d", self.index, what, sd["version"])
        return int(sd["version"]), [int(c) for c in sd["clocks"]]

    # -- memory -------------------------------------------------------------------------------
    def _load_memory(self, step: int) -> tuple[int, list[int]]:
        assert self.memory is not None
        sd = self.memory.load(step)  # CheckpointError names the file
        if sd.get("version") != step:
            raise CheckpointError(f"in-memory snapshot {step} of parameter server {self.index} "
                                  f"holds version {sd.get('version')}. Hint: delete "
                                  f"{self.memory.directory}.")
        return self._restore(sd, f"the in-memory snapshot of step {step}")

    def snapshot_memory(self, version: int) -> None:
        """Snapshot the state as of ``version`` (called right after the optimizer step that
        produced it, before any worker can see it). A failure stops snapshots with a
        warning and deletes this server's (now outdated) ones."""
        if self.memory is None or not self.snapshot_every or version % self.snapshot_every:
            return
        state = {"server": self.index, "plan": self.plan.rows(), "flat": self.flat,
                 "optimizer": self.optimizer.state_dict(), "version": int(version),
                 "clocks": [int(c) for c in self.core.clocks]}
        try:
            self.memory.save(version, state, defer=optimizer_tensors(self))
        except CheckpointError as e:
            warnings.warn(f"in-memory snapshots stopped on parameter server {self.index}: {e}",
                          stacklevel=2)
            self.drop_memory()

    def drop_memory(self) -> None:
        """Delete this server's in-memory snapshots and stop taking them."""
        store, self.memory = self.memory, None
        if store is not None:
            store.clear()
