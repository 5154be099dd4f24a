"""Horovod's elastic ``State``, ``ObjectState`` and ``TorchState``: what a commit holds, how it
is restored, synced from rank 0 and resumed from the snapshot store after a restart (see
:mod:`parlay.horovod.elastic`)."""
from __future__ import annotations

import copy
import io
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from parlay import checkpoint, comm, runtime
from parlay._tree import map_tensors
from parlay.errors import CheckpointError, ConfigError

__all__ = ["State", "ObjectState", "TorchState"]

log = logging.getLogger("parlay")

# What a snapshot (parlay.snapshot) stores without pickling.
_LEAVES = (type(None), bool, int, float, str)
_CONTAINERS = (list, tuple, dict, OrderedDict, torch.Size)
_states_created = 0  # orders State objects within a process: a restarted script builds the same


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def _check_plain(value: Any, where: str) -> None:
    """Raise ConfigError unless a snapshot can hold ``value`` (and load it back unpickled)."""
    if isinstance(value, torch.Tensor) or type(value) in _LEAVES:
        return
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise ConfigError(f"elastic state {where} is a {type(value).__name__}; a commit holds "
                      "tensors, None, numbers, strings and lists/tuples/dicts of them. Hint: pass "
                      "an object with state_dict()/load_state_dict(), or keep it out of the "
                      "state.")


def _host_copy(value: Any) -> Any:
    """A copy of ``value`` whose tensors live in host memory: a commit never doubles the
    accelerator memory the model takes (restoring copies back to each tensor's device)."""
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), value)


def _check_unsharded(name: str, value: Any) -> None:
    """Refuse a sharded optimizer: a restore makes rank 0's state everyone's, and its
    ``state_dict()`` is rank 0's shard only."""
    if getattr(value, "shard", None) and hasattr(value, "shard_engine"):
        raise ConfigError(f"elastic TorchState cannot hold {name}, a DistributedOptimizer with "
                          f"shard={value.shard!r}: a restore makes rank 0's state every rank's, "
                          "and a sharded optimizer's state_dict() is its own rank's shard. Hint: "
                          "drop shard= under hvd.elastic.")


def _stateful(value: Any) -> bool:
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or (
        callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None)) and not isinstance(value, type))


def _broadcast_tree(tree: Any, root: int = 0) -> Any:
    """``tree`` of rank ``root`` on every rank, as bytes in a tensor, loaded ``weights_only``."""
    if runtime.size() == 1:
        return tree
    dev = comm.group_device()  # CUDA for a NCCL-only world
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    data = b""
    if runtime.rank() == root:
        buf = io.BytesIO()
        torch.save(tree, buf)
        data = buf.getvalue()
        n[0] = len(data)
    comm.broadcast(n, src=root)
    raw = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if runtime.rank() == root
           else torch.empty(int(n.item()), dtype=torch.uint8, device=dev))
    comm.broadcast(raw, src=root)
    if runtime.rank() == root:
        return tree
    return torch.load(io.BytesIO(raw.cpu().numpy().tobytes()), map_location="cpu",
                      weights_only=True)


def _all_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=comm.group_device())
    if runtime.size() > 1:
        comm.allreduce(t, "min")
    return int(t.item())


class State:
    """Horovod's ``State``: committed in memory and in this rank's snapshot store.

    Subclasses implement :meth:`_capture` (a deep copy of the current state) and
    :meth:`_apply` (set it back), plus the rank-0 broadcast of :meth:`sync`.
    """

    def __init__(self) -> None:
        global _states_created
        _states_created += 1
        self._index = _states_created
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0
        self._store: Any = None
        self._resume_checked = False
        self._saved: dict[str, Any] = {}

    # ---------------------------------------------------------------- Horovod's API
    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Call ``callbacks`` after every reset: a restart of the workers, or an in-process
        retry after a failed collective (e.g. to rescale the learning rate by ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run :meth:`reset`, then the registered callbacks (what :func:`run` does on a reset)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    on_state_reset = on_reset

    def commit(self) -> None:
        """Save the state in memory and, when the launcher can restart, to this rank's snapshot
        store (asynchronously). Call it at the same points on every rank.

        Raises:
            ConfigError: An attribute is not a tensor/plain value or a ``state_dict`` holder.
        """
        self.save()
        self._commits += 1
        if self._store is not None:
            self._store.save(self._commits, self._saved)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """A no-op: parlay's world never changes while it runs (a lost rank restarts all)."""

    def save(self) -> None:
        """Save the current state in memory (:meth:`restore` returns to it)."""
        self._saved = self._capture()

    def restore(self) -> None:
        """Return to the last saved state, undoing uncommitted changes (RNG included)."""
        self._apply(self._saved)

    def sync(self) -> None:
        """Make every rank's state rank 0's (collective); the result becomes the saved state."""
        raise NotImplementedError

    def reset(self) -> None:
        """Hook run on a reset, before the callbacks."""

    # ---------------------------------------------------------------- snapshots
    def _capture(self) -> dict[str, Any]:
        return {"rng": checkpoint.rng_state()}

    def _apply(self, saved: dict[str, Any]) -> None:
        if "rng" in saved:
            checkpoint.set_rng_state(_host_copy(saved["rng"]))

    def _open_store(self, fresh: bool) -> None:
        """Open this rank's snapshot store when the launcher can restart (collective), holding
        the run id's live lock as the Trainer does: a second live job under the same run id is
        refused on every rank before it deletes anything. A ``fresh`` job then deletes the
        commits an old job of the same run id left.

        Raises:
            ConfigError: Another live job holds the run id (or a rank's store failed).
        """
        if self._store is not None or _env_int("TORCHELASTIC_MAX_RESTARTS") <= 0:
            return
        from parlay.snapshot import SnapshotStore, key_or_off

        key = key_or_off(f"horovod-elastic-state-{self._index}",
                         f"rank {runtime.rank()}: the job has no run id, so elastic commits stay "
                         "in memory and a restart starts over. Hint: pass --rdzv-id or set "
                         "PARLAY_RUN_ID.", logging.WARNING)
        if key is None:
            return
        store, error = None, None
        try:
            store = SnapshotStore(key, runtime.rank(), live=True)
        except (ConfigError, CheckpointError) as e:
            error = e
        ok = _all_min(int(store is not None))
        if store is None or not ok:
            if store is not None:
                store.close()
            raise error or ConfigError(
                f"rank {runtime.rank()}: another rank could not open its elastic commits (see "
                "its error: another live job holds this job's run id, or the snapshot folder "
                "is not writable). Fix: give this job its own PARLAY_RUN_ID (or parlay run "
                "--rdzv-id), or stop the other job.")
        if fresh:
            store.drop_after(-1)
        self._store = store

    def _resume(self) -> bool:
        """On entering :func:`run`: open the snapshot store and, in a restarted worker, load
        the newest commit every rank holds (collective).

        Returns:
            Whether this process is a restarted worker entering ``run`` the first time.
        """
        first, self._resume_checked = not self._resume_checked, True
        restarted = first and _env_int("TORCHELASTIC_RESTART_COUNT") > 0
        self._open_store(fresh=first and not restarted)
        if not restarted or self._store is None:
            return restarted
        from parlay.snapshot import agree

        found = agree(self._store)
        if found is None:
            log.warning("rank %d: restarted, but no commit is held by every rank; starting "
                        "from the script's initial state", runtime.rank())
            return True
        self._commits, self._saved = found
        self._apply(self._saved)
        log.info("rank %d: resumed from elastic commit %d", runtime.rank(), self._commits)
        return True

    def _finish(self) -> None:
        """Every rank returned from the function: drop the snapshots (collective)."""
        if self._store is not None:
            _all_min(1)
            self._store.clear()
            self._store = None
            _all_min(1)  # no rank opens the run's folder again while another deletes it


class ObjectState(State):
    """Plain attributes (numbers, strings, tensors, lists/dicts of them), committed together.

    Args:
        bcast_object: Accepted for Horovod compatibility and ignored: parlay syncs with tensors.
        get_rank: Accepted for Horovod compatibility and ignored.
        **kwargs: Attributes to track, e.g. ``epoch=0, batch=0``.

    Raises:
        ConfigError: A value is not plain.
    """

    def __init__(self, bcast_object: Any = None, get_rank: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self._values = list(kwargs)
        for name, value in kwargs.items():
            _check_plain(value, name)
            setattr(self, name, value)
        self.save()

    def _capture(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self._values}
        for name, value in values.items():
            _check_plain(value, name)
        return {**super()._capture(), "values": copy.deepcopy(values)}

    def _apply(self, saved: dict[str, Any]) -> None:
        super()._apply(saved)
        for name, value in copy.deepcopy(saved.get("values", {})).items():
            setattr(self, name, value)

    def _shared(self) -> dict[str, Any]:
        return {"values": {name: getattr(self, name) for name in self._values}}

    def _apply_shared(self, shared: dict[str, Any]) -> None:
        for name, value in shared["values"].items():
            setattr(self, name, value)

    def sync(self) -> None:
        self._apply_shared(_broadcast_tree(self._shared()))
        self.save()


class TorchState(ObjectState):
    """A PyTorch training state: model, optimizer and any other attributes.

    Objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers,
    :class:`ElasticSampler`) are committed through their state dicts; everything else must be a
    plain value. Each keyword becomes an attribute (``state.epoch``); assigning a new object to
    a tracked name (``state.model = other``) tracks the new one.

    Args:
        model: The model (optional).
        optimizer: The optimizer, e.g. ``hvd.DistributedOptimizer`` (optional).
        **kwargs: More objects or plain values, e.g. ``epoch=0, batch=0, scheduler=sched``.
    """

    _objects: dict[str, Any]

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        every = {"model": model, "optimizer": optimizer, **kwargs}
        objects = {k: v for k, v in every.items() if _stateful(v)}
        for name, obj in objects.items():
            _check_unsharded(name, obj)
        object.__setattr__(self, "_objects", objects)
        for name, obj in objects.items():
            object.__setattr__(self, name, obj)
        super().__init__(**{k: v for k, v in every.items() if k not in objects})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in getattr(self, "_objects", {}):
            _check_unsharded(name, value)
            self._objects[name] = value
        super().__setattr__(name, value)

    def _capture(self) -> dict[str, Any]:
        sds = {name: obj.state_dict() for name, obj in self._objects.items()}
        for name, sd in sds.items():
            _check_plain(sd, f"{name}.state_dict()")
        return {**super()._capture(), "objects": _host_copy(sds)}

    def _apply(self, saved: dict[str, Any]) -> None:
        super()._apply(saved)
        for name, sd in saved.get("objects", {}).items():
            # A copy: optimizers keep the loaded tensors, and later steps update them in place.
            self._objects[name].load_state_dict(_host_copy(sd))

    def _shared(self) -> dict[str, Any]:
        sds = {name: obj.state_dict() for name, obj in self._objects.items()}
        return {**super()._shared(), "objects": sds}

    def _apply_shared(self, shared: dict[str, Any]) -> None:
        super()._apply_shared(shared)
        for name, sd in shared["objects"].items():
            obj = self._objects[name]
            if isinstance(obj, torch.optim.Optimizer):
                # Compression residuals are this rank's own: never rank 0's.
                mine = obj.state_dict().get("parlay_compression")
                if mine is not None:
                    sd = {**sd, "parlay_compression": mine}
            if runtime.rank() != 0:
                obj.load_state_dict(sd)
