"""Fuzzing the checkpoint and snapshot loaders with random, truncated, corrupted and
wrongly structured files: only :class:`~parlay.errors.CheckpointError` may come out (see
``test_fuzz.py`` for the conventions, including ``xfail(strict=True)`` for known bugs)."""
from __future__ import annotations

import contextlib
import io
import json
import tempfile
import warnings
from pathlib import Path
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from parlay import checkpoint
from parlay.errors import CheckpointError

FILES = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ checkpoint files
def _real_checkpoint() -> bytes:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save({"parlay_checkpoint": checkpoint.FORMAT_VERSION, "step": 7,
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng": checkpoint.rng_state()}, buf)
    return buf.getvalue()


REAL = _real_checkpoint()

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4)
keys = st.one_of(st.sampled_from(["parlay_checkpoint", "step", "identity", "model", "run_id",
                                  "world_size", "batch_size", "layout"]), st.text(max_size=3))
plain_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(keys, inner, max_size=4), max_leaves=10)
tensors = st.builds(torch.zeros, st.integers(0, 3))
# A well-formed torch file holding the wrong structure. Tensors sit where parlay expects them
# ("model"); a tensor where an int is expected is a known bug (tests below).
wrong_structures = st.one_of(
    plain_values, tensors, st.lists(tensors, max_size=2),
    st.builds(lambda version, rest, model: {**rest, "parlay_checkpoint": version, "model": model},
              st.one_of(st.integers(-1, 3), st.text(max_size=2), st.none()),
              st.dictionaries(st.sampled_from(["step", "identity", "rng"]), plain_values,
                              max_size=3),
              st.one_of(plain_values, st.dictionaries(st.text(max_size=2), tensors,
                                                      max_size=2))))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Falling back past an unusable checkpoint warns; that is expected here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _load_file(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt-0000000007.rank0.pt"
        path.write_bytes(data)
        try:
            state = checkpoint.load(path)
        except CheckpointError:
            state = None
        assert state is None or isinstance(state, dict)
        for identity in (None, {"world_size": 1, "batch_size": 4}):
            mgr = checkpoint.CheckpointManager(d, rank=0, identity=identity)
            try:
                got = mgr.load_latest()  # unreadable files are skipped with a warning
            except CheckpointError:
                continue
            finally:
                mgr.close()
            assert got is None or got.get("step") == 7


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@FILES
@given(st.binary(max_size=600))
@example(b"")  # a zero-byte file (the disk filled up)
@example(b"PK\x03\x04")
def test_checkpoint_random_bytes(data: bytes) -> None:
    with _quiet():
        _load_file(data)


@FILES
@given(st.integers(0, len(REAL)), st.lists(st.tuples(st.integers(0, len(REAL) - 1),
                                                      st.integers(0, 255)), max_size=3))
# A flipped byte in the zip64 end record (a number of disks) made zipfile.is_zipfile raise.
@example(len(REAL), [(len(REAL) - 26, REAL[-26] ^ 0xFF)])
@example(len(REAL), [(len(REAL) - 23, REAL[-23] ^ 0xFF)])
def test_checkpoint_truncated_or_corrupted(cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(REAL[:cut])
    for pos, byte in flips:
        if pos < len(data):
            data[pos] = byte
    with _quiet():
        _load_file(bytes(data))


@FILES
@given(wrong_structures)
def test_checkpoint_with_wrong_structure(obj: object) -> None:
    with _quiet():
        _load_file(_saved(obj))


# A tensor where an int or a plain identity is expected used to make a comparison ambiguous
# (torch's RuntimeError escaped); the loader now reports such a file as corrupt.
@pytest.mark.parametrize("fields", [
    {"parlay_checkpoint": torch.ones(2)},                               # checkpoint.load
    {"parlay_checkpoint": 1, "step": torch.zeros(2)},                   # _load_latest
    {"parlay_checkpoint": 1, "step": 7, "identity": {"world_size": torch.zeros(2)}},
], ids=["version", "step", "identity"])
def test_checkpoint_field_that_is_a_tensor(fields: dict) -> None:
    with _quiet():
        _load_file(_saved({"step": 7, **fields}))


# ------------------------------------------------------------------ snapshot files
def _snapshot(root: str):
    from parlay.snapshot import SnapshotStore

    store = SnapshotStore("fuzz", 0, root=root)
    w = torch.linspace(0, 1, 8192)
    store.save(3, {"model": {"w": w, "b": torch.ones(3)}, "step": 3, "lr": [0.1, (1, None)]})
    (meta,) = store.directory.glob("snap-*.json")   # the commit record (JSON)
    (data,) = store.directory.glob("data-*.pt")     # the tensors (torch.save, mapped)
    return store, meta, data


def _load_snapshot(store) -> None:
    try:
        state = store.load(3)
    except CheckpointError:
        state = None
    assert state is None or isinstance(state, dict)
    newest = store.latest()  # unreadable snapshots are skipped with a warning
    assert newest is None or newest[0] == 3


def _corrupt(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data[:cut])
    for pos, byte in flips:
        if pos < len(out):
            out[pos] = byte
    return bytes(out)


cuts = st.floats(0.0, 1.0)
flips = st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=3)


@FILES
@given(st.sampled_from(["meta", "data"]), cuts, flips,
       st.one_of(st.none(), st.binary(max_size=300)))
def test_snapshot_truncated_corrupted_or_random(which: str, cut: float, flips_, junk) -> None:
    with tempfile.TemporaryDirectory() as root, _quiet():
        store, meta, data = _snapshot(root)
        path = meta if which == "meta" else data
        raw = path.read_bytes()
        path.write_bytes(junk if junk is not None else
                         _corrupt(raw, int(cut * len(raw)), flips_))
        _load_snapshot(store)
        store.close()


json_trees = st.recursive(
    scalars.filter(lambda v: v == v), lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["T", "D", "L", "U", "x"]), inner, min_size=1,
                      max_size=2), max_leaves=12)


@FILES
@given(st.one_of(st.text(max_size=40), json_trees), st.booleans(),
       st.sampled_from(["skeleton", "step", "parlay_snapshot", "slot", "key"]))
def test_snapshot_record_with_wrong_structure(value, real_layout: bool, field: str) -> None:
    with tempfile.TemporaryDirectory() as root, _quiet():
        store, meta, _ = _snapshot(root)
        record = json.loads(meta.read_text())
        record[field] = value
        if not real_layout:
            record["layout"] = json.dumps(value)[:16]
        meta.write_text(json.dumps(record))
        _load_snapshot(store)
        store.close()


def _deep(record: dict) -> None:
    record["skeleton"] = "DEEP"  # replaced in the file's text: too deep for json.dumps


@pytest.mark.parametrize("which,change", [
    ("meta", _deep),
    ("meta", lambda r: r.update(skeleton={"T": 99})),
    ("meta", lambda r: r.update(skeleton={"T": "0"})),
    ("data", lambda d: d.update(tensors=[1, 2])),
    ("data", lambda d: d.update(tensors=[torch.zeros(3)])),
], ids=["deep-skeleton", "tensor-index-out-of-range", "tensor-index-text", "data-not-tensors",
        "data-other-layout"])
def test_snapshot_file_with_wrong_types(which: str, change) -> None:
    with tempfile.TemporaryDirectory() as root, _quiet():
        store, meta, data = _snapshot(root)
        if which == "meta":
            record = json.loads(meta.read_text())
            change(record)
            meta.write_text(json.dumps(record).replace(
                '"DEEP"', '{"L": [' * 3000 + "1" + "]}" * 3000))
        else:
            obj = torch.load(data, weights_only=True)
            change(obj)
            data.write_bytes(_saved(obj))
        with pytest.raises(CheckpointError):
            store.load(3)
        assert store.latest() is None
        store.close()
