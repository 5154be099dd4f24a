"""What a checkpoint says about the run that wrote it, and the lock on a checkpoint directory.

A checkpoint can only be continued *exactly* by a run with the same layout (ranks, data-parallel
replicas, pipeline stages), the same per-replica batch size, mode and model architecture. Each
checkpoint records that *identity*; a resume compares it with its own and refuses with the
reason and the fix instead of silently starting over, loading a model into the wrong shapes or
continuing with another batch size. The model fingerprint hashes parameter and buffer names,
shapes and dtypes (never values), so it is the same on every rank and every restart.

Two runs writing one directory at the same time would prune each other's checkpoints, so the
chief holds an exclusive POSIX lock (``fcntl.lockf``) on ``<dir>/.lock`` for the run's life. The
kernel drops it when the process ends, even on SIGKILL, so a restarted run is never locked out
by the run it replaces, and forked children (DataLoader workers) do not inherit it.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import torch.nn as nn

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows: no lock there
    fcntl = None  # type: ignore[assignment]

__all__ = ["model_layout", "fingerprint", "describe_mismatch", "DirLock", "trainer_identity",
           "recipe_difference", "same_numbers", "stable_repr", "MAY_CHANGE"]

#: Identity fields a resume must match exactly, with how to tell the user about each.
#: Identity fields that say how many ranks wrote a state (a resharded resume may differ).
LAYOUT_FIELDS = ("world_size", "dp_size", "dp_rank", "pp")

#: Recipe fields a resume may change (the Trainer logs it): no state depends on them, and a
#: run stopped by a non-finite step continues from its checkpoint with ``nonfinite="skip"`` or
#: a ``grad_clip``. Not ``precision``: fp16's compression residuals are owed in scaled units.
MAY_CHANGE = ("grad_clip", "nonfinite")


def model_layout(model: nn.Module) -> list[list[Any]]:
    """``[[name, shape, dtype], ...]`` of the model's parameters and buffers (no values)."""
    return [[name, list(t.shape), str(t.dtype).replace("torch.", "")]
            for name, t in model.state_dict().items()]


def fingerprint(layout: list[list[Any]]) -> str:
    """A short hash of :func:`model_layout`: equal iff names, shapes and dtypes are equal."""
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def _first_difference(saved: list[list[Any]], now: list[list[Any]]) -> str:
    for k in range(max(len(saved), len(now))):
        a = saved[k] if k < len(saved) else None
        b = now[k] if k < len(now) else None
        if a != b:
            def fmt(e: Any) -> str:
                return "absent" if e is None else f"{e[0]!r} {tuple(e[1])} {e[2]}"
            return f"entry #{k} is {fmt(a)} in the checkpoint but {fmt(b)} in this model"
    return "the fingerprints differ"


def _emptied(saved: Any, now: list[list[Any]]) -> bool:
    """Whether ``saved`` is ``now`` as checkpoints of ``shard="parameters"`` recorded it before
    the layout was taken ahead of sharding: the same names and dtypes, some shapes ``[0]``."""
    return isinstance(saved, list) and len(saved) == len(now) and all(
        a[0] == b[0] and a[2] == b[2] and a[1] in (b[1], [0]) for a, b in zip(saved, now))


def describe_mismatch(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why a checkpoint written with identity ``saved`` cannot be continued exactly by a run
    with identity ``now``, with the fix; ``None`` when it can (fields either lacks are skipped,
    so older checkpoints stay loadable)."""
    def has(k: str) -> bool:
        return k in saved and k in now
    fresh = " or start afresh with a new (or emptied) checkpoint_dir."
    if has("mode") and saved["mode"] != now["mode"]:
        return (f"it was written in mode {saved['mode']!r}, this run uses mode {now['mode']!r}. "
                f"Fix: resume with mode={saved['mode']!r},{fresh}")
    if any(has(k) and saved[k] != now[k] for k in LAYOUT_FIELDS if k != "dp_rank"):
        def lay(d: dict[str, Any]) -> str:
            return (f"{d.get('world_size')} rank(s): {d.get('dp_size')} data-parallel "
                    f"replica(s) x {d.get('pp', 1)} pipeline stage(s)")
        return (f"it was written by {lay(saved)}; this run has {lay(now)}. Resuming on another "
                "layout cannot continue exactly (each replica's data shard, compression "
                "residuals and RNG belong to its rank). Fix: relaunch with the same layout "
                f"(e.g. parlay run -n {saved.get('world_size')}),{fresh}")
    if has("batch_size") and saved["batch_size"] != now["batch_size"]:
        return (f"it was written with batch_size={saved['batch_size']} per replica, this run "
                f"uses batch_size={now['batch_size']} (the epoch position and learning-rate "
                f"schedule depend on it). Fix: pass batch_size={saved['batch_size']},{fresh}")
    if has("model_fingerprint") and saved["model_fingerprint"] != now["model_fingerprint"] \
            and not _emptied(saved.get("model_layout"), now.get("model_layout", [])):
        diff = _first_difference(saved.get("model_layout", []), now.get("model_layout", []))
        return (f"it was written for a different model architecture ({diff}). Fix: build the "
                f"same model as the run that wrote it,{fresh}")
    settings = recipe_difference(saved.get("recipe"), now.get("recipe"))
    if settings:
        return (f"it was written with other training settings ({settings}), so continuing it would "
                "not be the run that wrote it (another job under the same directory or run "
                f"id?). Fix: resume with the same settings (a resume may change only "
                f"{' and '.join(MAY_CHANGE)}), give this job its own checkpoint_dir,{fresh}")
    if has("dp_rank") and saved["dp_rank"] != now["dp_rank"]:
        return (f"this rank's file was written by data-parallel replica {saved['dp_rank']}, "
                f"this rank is replica {now['dp_rank']}. Fix: keep the rank order of the run "
                f"that wrote it,{fresh}")
    return None


class DirLock:
    """Exclusive lock on ``<directory>/.lock`` held for a run's life (see module docstring).

    Re-locking a directory this process already holds succeeds (a script may build a second
    Trainer on the same directory after the first one stopped).
    """

    _held: dict[str, list[int]] = {}  # realpath -> [fd, users], per process

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / ".lock"
        self._key = os.path.realpath(self.path)
        self.locked = False

    def acquire(self, info: dict[str, Any]) -> str | None:
        """Take the lock and record ``info`` in it; returns ``None`` on success, else a
        description of the run that holds it."""
        if fcntl is None:
            return None
        held = self._held.get(self._key)
        if held is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)  # this process holds no lock on the file: closing drops nothing
                return self.holder()
            held = self._held[self._key] = [fd, 0]
        held[1] += 1
        self.locked = True
        self.update(info)
        return None

    def update(self, info: dict[str, Any]) -> None:
        """Rewrite the recorded run description (only while holding the lock)."""
        held = self._held.get(self._key)
        if not self.locked or held is None:
            return
        rec = {"pid": os.getpid(), "host": socket.gethostname(),
               "since": time.strftime("%Y-%m-%d %H:%M:%S"), **info}
        data = json.dumps(rec).encode()
        os.ftruncate(held[0], 0)
        os.pwrite(held[0], data, 0)

    def holder(self) -> str:
        """Who holds the lock, as recorded in the lock file (read by a non-holder only:
        closing any descriptor of the file would drop a POSIX lock this process holds)."""
        try:
            rec = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            rec = {}
        if not rec:
            return "another run (it recorded no details)"
        return (f"run {rec.get('run_id', '?')} (pid {rec.get('pid', '?')} on "
                f"{rec.get('host', '?')}, since {rec.get('since', '?')})")

    def release(self) -> None:
        """Drop this user's hold; the lock goes when the last user in the process drops it."""
        held = self._held.get(self._key)
        if not self.locked or held is None:
            return
        self.locked = False
        held[1] -= 1
        if held[1] <= 0:
            del self._held[self._key]
            os.close(held[0])


def trainer_identity(strategy: Any, mode: str, batch_size: int, layout: list[list[Any]],
                     recipe: dict[str, str] | None = None) -> dict[str, Any]:
    """The identity a Trainer's checkpoints record and a resume must match (``strategy``: a
    :class:`~parlay.strategies.Strategy`; its ``layout_world_size`` counts ps workers that sit
    a resume out; ``layout``: the model's :func:`model_layout` as built; ``recipe``: the
    training settings, see :func:`stable_repr`)."""
    out = {"mode": mode, "world_size": int(strategy.layout_world_size),
           "dp_size": int(strategy.dp_size), "dp_rank": int(strategy.dp_rank),
           "pp": int(strategy.pp), "batch_size": int(batch_size),
           "model_fingerprint": fingerprint(layout), "model_layout": layout}
    if recipe is not None:
        out["recipe"] = dict(recipe)
    return out


def recipe_difference(saved: Any, now: Any, changeable: bool = False) -> str | None:
    """The settings two recipes (see :func:`stable_repr`) disagree on, as ``"k: a then, b
    now; ..."``, but those a resume may change (:data:`MAY_CHANGE`), or with ``changeable``
    only those; ``None`` when they agree or either is missing (older states had none)."""
    if not (isinstance(saved, dict) and isinstance(now, dict)) or saved == now:
        return None
    saved, now = ({k: _canonical(k, str(v)) for k, v in r.items()} for r in (saved, now))
    return "; ".join(f"{k}: {saved.get(k)} then, {now.get(k)} now"
                     for k in sorted(set(saved) | set(now))
                     if saved.get(k) != now.get(k) and (k in MAY_CHANGE) == changeable) or None


def _canonical(key: str, text: str) -> str:
    """A recipe field as compared across a resume: numbers as :func:`same_numbers`, and a
    compression spec (``'topk:1e-2'``, ``None``) as the compressor it builds, so that equal
    settings spelt apart (``"topk:0.01"``, ``TopK(ratio=0.01)``) compare equal."""
    text = same_numbers(text)
    if key == "compression" and (text == "None" or text[:1] in "'\""):
        from parlay.compress import get_compressor
        try:
            return same_numbers(repr(get_compressor(ast.literal_eval(text))))
        except Exception:  # noqa: BLE001 - a spec this version cannot read compares as text
            return text
    return text


def same_numbers(text: str) -> str:
    """``text`` with its integral float literals as ints (``1.0`` -> ``1``), so that a setting
    passed as ``1`` or as ``1.0`` compares equal (also against recipes saved as either)."""
    return re.sub(r"(?<![\w.])(\d+)\.0(?![\w.])", r"\1", text)


def stable_repr(value: Any) -> str:
    """``repr(value)`` without memory addresses (``<... at 0x7f...>``), so a setting reads the
    same in every process that is given it (a recipe field of a run's identity)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {stable_repr(v)}" for k, v in sorted(
            value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
