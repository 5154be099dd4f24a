"""Corrupted state between a kill and the restart: detected and refused, never loaded silently.

Each try trains the small model of :mod:`tools.fault_cases._train` on 2 ranks under
``parlay run`` with a fixed ``PARLAY_RUN_ID`` and ``PARLAY_SNAPSHOT_DIR`` and a
``checkpoint_dir`` in the try's folder; a random rank SIGKILLs itself after a random step (the
launcher then stops the other). Then 1-4 consecutive bytes (each XOR-ed with a random non-zero
value) at a random offset of one random rank's newest state are flipped: the snapshot data
file or its commit record (snapshots every step, a checkpoint every 5), or the disk checkpoint
(snapshots off, a checkpoint every 2); the state flipped is the one the restart would resume
from. Half of the offsets are drawn over the whole file, half over the bytes that are not
tensor data (zip headers and padding, the pickle, the central directory), which a uniform draw
would almost never reach. The job is launched again with the same run id and must end with:

* the corruption detected: a warning naming the file and the rank, and that state not used;
* exit 0, every rank's final parameters equal, and equal to an uninterrupted run's (or a
  warning that the resume used a replica's state and is not bit-exact).

A flipped byte that no reader uses (the padding in a zip entry's extra field, the CRC and
timestamps torch does not check, a JSON space turned into another whitespace) cannot be seen
by any checksum of the contents, and need not be: the try then loads the original file and the
flipped one and compares what they hold. When they hold the same state the try counts as
"unread bytes" (ok without a warning, if the run still ends bit-exact); when they differ, a
load without a warning fails the try, however small the change.
"""
from __future__ import annotations

import io
import json
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from tools.fault_cases._train import ROOT, finals, launch, same, tries

TARGETS = ("snapshot data", "snapshot record", "checkpoint")
STEPS = 20  #: steps of every run (the killed one, the restart, the uninterrupted reference)
_CONFIG = {True: ["--snapshot-every", "1", "--checkpoint-every", "5"],  # snapshot targets
           False: ["--snapshot-every", "0", "--checkpoint-every", "2"]}  # checkpoint target


def regions(raw: bytes) -> list[tuple[int, int, str]]:
    """``(start, end, what)`` of every part of the ``torch.save`` archive ``raw``."""
    out = []
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        infos = z.infolist()
        cd = min((i.header_offset for i in infos), default=0)
        for i in infos:
            h = i.header_offset
            name_len = int.from_bytes(raw[h + 26:h + 28], "little")
            extra_len = int.from_bytes(raw[h + 28:h + 30], "little")
            data = h + 30 + name_len + extra_len
            short = i.filename.split("/", 1)[-1]
            out += [(h, h + 30 + name_len, f"local header of {short}"),
                    (h + 30 + name_len, data, f"extra field (alignment padding) of {short}"),
                    (data, data + i.compress_size,
                     "tensor data" if "/data/" in i.filename else f"member {short}")]
            cd = max(cd, data + i.compress_size)
    out.append((cd, len(raw), "central directory and end record"))
    return out


def _where(parts: list[tuple[int, int, str]], offset: int) -> str:
    return next((w for s, e, w in parts if s <= offset < e), "between entries")


def _offset(rng: random.Random, raw: bytes, is_zip: bool) -> tuple[int, str]:
    """A random offset (half the time among the bytes that are not tensor data) and its part."""
    if not is_zip:
        return rng.randrange(len(raw)), "commit record (JSON)"
    parts = regions(raw)
    if rng.random() < 0.5:
        off = rng.randrange(len(raw))
    else:
        meta = [(s, e) for s, e, w in parts if w != "tensor data" and e > s]
        pick = rng.randrange(sum(e - s for s, e in meta))
        for s, e in meta:
            if pick < e - s:
                off = s + pick
                break
            pick -= e - s
    return off, _where(parts, off)


def _content(path: str) -> Any:
    """What a reader gets from ``path`` (``torch.load(weights_only=True)`` or ``json``)."""
    import torch

    if path.endswith(".json"):
        return json.loads(Path(path).read_bytes())
    return torch.load(path, map_location="cpu", weights_only=True)


def holds_the_same(original: str, flipped: str) -> bool:
    """Whether ``flipped`` loads to exactly what ``original`` does (False: it does not load)."""
    try:
        return _equal(_content(original), _content(flipped))
    except Exception:  # noqa: BLE001 - the flipped file does not load at all
        return False


def _same_content(original: Path, flipped: Path) -> bool | None:
    """:func:`holds_the_same` in a process of its own (a reader could crash on a flipped file);
    ``None`` when that process failed."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tools.fault_cases.corrupt "
            "import holds_the_same as h; print(h(sys.argv[2], sys.argv[3]))")
    p = subprocess.run([sys.executable, "-c", code, str(ROOT), str(original), str(flipped)],
                       capture_output=True, text=True, timeout=120)
    return {"True": True, "False": False}.get(p.stdout.strip())


def _equal(a: Any, b: Any) -> bool:
    """Deep, bitwise equality of two loaded states."""
    import torch
    from torch.utils import _pytree as pytree

    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if not same({"t": x}, {"t": y}):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _victim_file(d: Path, target: str, victim: int) -> tuple[Path, int] | None:
    """The file of ``victim``'s newest state that every rank holds (the one a restart tries
    first), and its step."""
    if target == "checkpoint":
        steps = [{int(m.group(1)) for p in (d / "ckpt").iterdir()
                  if (m := re.match(rf"ckpt-(\d+)\.rank{r}\.pt$", p.name))} for r in range(2)]
        common = set.intersection(*steps)
        return (d / "ckpt" / f"ckpt-{max(common):010d}.rank{victim}.pt", max(common)) \
            if common else None
    ranks = [next((d / "shm").glob(f"*/rank{r}"), None) for r in range(2)]
    if None in ranks:
        return None
    held = [{int(m.group(1)): int(m.group(2)) for p in r.iterdir()  # type: ignore[union-attr]
             if (m := re.match(r"snap-(\d+)\.s(\d+)\.json$", p.name))} for r in ranks]
    common = set(held[0]) & set(held[1])
    if not common:
        return None
    step = max(common)
    slot = held[victim][step]
    rank_dir: Path = ranks[victim]  # type: ignore[assignment]
    name = f"snap-{step:010d}.s{slot}.json" if target == "snapshot record" else f"data-{slot}.pt"
    return rank_dir / name, step


def _env(d: Path, run_id: str) -> dict[str, str]:
    return {"PARLAY_RUN_ID": run_id, "PARLAY_SNAPSHOT_DIR": str(d / "shm")}


def _reference(workdir: Path, snapshots: bool, cache: dict[bool, Any]) -> Any:
    """Final parameters of an uninterrupted run of the same configuration (rank 0)."""
    if snapshots not in cache:
        d = workdir / f"reference-{'snap' if snapshots else 'ckpt'}"
        p = launch(d / "out", 2, ["--steps", str(STEPS), "--ckpt", str(d / "ckpt"),
                                  *_CONFIG[snapshots]], _env(d, f"{d.name}-{id(cache)}"))
        got = finals(d / "out", 2)
        if p.returncode or got is None:
            raise RuntimeError(f"the uninterrupted reference run failed:\n{p.stderr[-3000:]}")
        cache[snapshots] = got[0]
    return cache[snapshots]


def one(i: int, workdir: Path, cache: dict[bool, Any]) -> dict[str, Any]:
    """Try ``i`` (its random choices are drawn from ``random.Random(i)``: reproducible)."""
    rng = random.Random(i)
    target = rng.choice(TARGETS)
    snapshots = target != "checkpoint"
    killer, victim = rng.randrange(2), rng.randrange(2)
    # Snapshot targets: a kill at step K with K % 5 >= 2 leaves snapshots newer than the
    # checkpoint of step 5 * (K // 5), so the restart tries the flipped snapshot first.
    kill = rng.choice([k for k in range(6, 15) if not snapshots or k % 5 >= 2])
    case = target.replace(" ", "_")
    d = workdir / f"try{i:03d}"
    ref = _reference(workdir, snapshots, cache)
    args = ["--steps", str(STEPS), "--ckpt", str(d / "ckpt"), *_CONFIG[snapshots]]
    env = _env(d, f"faults-corrupt-{i}-{id(cache)}")
    first = launch(d / "first", 2, [*args, "--kill", f"{kill}:{killer}"], env)
    found = _victim_file(d, target, victim)
    if first.returncode == 0 or found is None:
        return {"case": case, "ok": False, "detail": f"setup: the killed run (rc "
                f"{first.returncode}) left no {target} every rank holds:\n{first.stderr[-2000:]}"}
    path, step = found
    raw = path.read_bytes()
    is_zip = path.suffix == ".pt"
    off, part = _offset(rng, raw, is_zip)
    n = min(rng.randint(1, 4), len(raw) - off)
    bad = bytearray(raw)
    for k in range(off, off + n):
        bad[k] ^= rng.randint(1, 255)
    original = d / f"original{path.suffix}"
    original.write_bytes(raw)
    path.write_bytes(bytes(bad))
    changed = _same_content(original, path) is not True
    what = (f"{target} of rank {victim} (step {step}, killed rank {killer} after step {kill}): "
            f"{n} byte(s) at offset {off} of {len(raw)}, in the {part}")
    second = launch(d / "second", 2, args, env)
    err = second.stderr
    named = any(str(path) in line and re.search(rf"\brank {victim}\b", line)
                for line in err.splitlines())
    got = finals(d / "second", 2)
    recs = [json.loads(p.read_text()) for p in sorted((d / "second").glob("r*.json"))]
    start = f"resumed at step {recs[0]['start']}" if recs else "no resume record"
    if second.returncode or got is None:
        return {"case": case, "ok": False, "detail": f"{what}; the restart failed (rc "
                f"{second.returncode}; warning naming the file: {named}):\n{err[-2000:]}"}
    equal = same(got[0], got[1])
    exact = same(got[0], ref)
    inexact_said = "not bit-exact" in err
    problems = []
    if changed and not named:
        problems.append("LOADED SILENTLY: no warning names the file and the rank"
                        if not exact else "no warning names the file and the rank")
    if not equal:
        problems.append("the replicas' final parameters differ")
    if not exact and not inexact_said:
        problems.append("final parameters differ from the uninterrupted run's, unannounced")
    if not changed:
        used = recs and recs[0]["start"] == step
        seen = ("flagged anyway" if named else "unread bytes: the flipped file holds exactly "
                "the state written (what a reader uses is unchanged), so no check can or need "
                "see it" + ("; it was resumed from" if used else ""))
    else:
        seen = "detected: a warning names the file and the rank, and it was not used"
    detail = (f"{what}; {seen}; {start}; replicas {'equal' if equal else 'DIFFER'}; "
              f"{'bit-exact with' if exact else 'differs from'} the uninterrupted run"
              + (" (the resume said it is not bit-exact)" if not exact and inexact_said else ""))
    if problems:
        detail += "; FAILED: " + "; ".join(problems)
    else:
        shutil.rmtree(d, ignore_errors=True)
    return {"case": case, "ok": not problems, "detail": detail}


def run(repeats: int, workdir: Path) -> list[dict[str, Any]]:
    """``repeats`` tries, one row each."""
    workdir.mkdir(parents=True, exist_ok=True)
    cache: dict[bool, Any] = {}
    return tries(workdir, repeats, lambda i: one(i, workdir, cache))
