"""The clear messages issue 25 asks for, each tried for real once per repeat: a full checkpoint
disk and a full snapshot folder (64 KiB tmpfs mounts; root only), an unwritable
PARLAY_SNAPSHOT_DIR, a SIGSTOPped rank, a restart's one line, and out-of-range inputs to
``parlay plan`` and ``parlay bench``."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

JOB = '''
import os, signal, sys, torch, torch.nn as nn
from torch.utils.data import TensorDataset
import parlay
ckpt, stop = sys.argv[1] or None, sys.argv[2]
x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2)),
                            nn.CrossEntropyLoss()),
                   TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, max_iteration=12,
                   checkpoint_dir=ckpt, checkpoint_every=4, snapshot_every=1, progress=False)
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
while not t.should_stop():
    t.train_on_batch()
    if t.state.step == 5 and parlay.rank() == 1 and attempt == "0" and stop != "none":
        os.kill(os.getpid(), getattr(signal, stop))
print(f"rank {parlay.rank()} done at step {t.state.step}", flush=True)
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PARLAY_TIMEOUT": "10",
                "PARLAY_RUN_ID": f"errors-{time.time_ns()}", **extra})
    return env


def _run(cmd: list[str], env: dict[str, str] | None = None,
         timeout: float = 180) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        return -999, f"no end within {timeout} s", time.perf_counter() - t0


@contextlib.contextmanager
def _tiny_fs(base: Path) -> Iterator[Path | None]:
    """A 64 KiB tmpfs under ``base`` (``None`` without root or mount), unmounted after."""
    mnt = Path(tempfile.mkdtemp(dir=base))
    ok = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
        capture_output=True).returncode == 0
    try:
        yield mnt if ok else None
    finally:
        if ok:
            subprocess.run(["umount", str(mnt)], check=False)


def _row(case: str, ok: bool, out: str, needle: str) -> dict[str, object]:
    hits = [ln.strip() for ln in out.splitlines() if needle in ln]
    return {"case": case, "ok": ok, "detail": (hits[0] if hits else out.strip()[-300:])[:300]}


def _disks(job: Path, base: Path) -> list[dict[str, object]]:
    rows = []
    py = [sys.executable, str(job)]
    with _tiny_fs(base) as mnt:
        if mnt is None:
            return [{"case": "full disks", "ok": True, "detail": "skipped: needs root and mount"}]
        rc, out, _ = _run(py + [str(mnt), "none"], _env(PARLAY_SNAPSHOT_DIR=str(base / "shm")))
        said = [ln for ln in out.splitlines() if "CheckpointError: could not write" in ln]
        rows.append(_row("full checkpoint disk", rc != 0 and len(said) == 1 and "no space left "
                         "on device" in said[0] and "unexpected pos" not in said[0], out,
                         "no space left"))
    with _tiny_fs(base) as mnt:
        rc, out, _ = _run(py + ["", "none"], _env(PARLAY_SNAPSHOT_DIR=str(mnt or base)))
        rows.append(_row("full snapshot folder", rc == 0 and "no space left on device" in out
                         and f"free space in {mnt}" in out and "/dev/shm" not in out, out,
                         "no space left"))
    return rows


def _once(base: Path) -> list[dict[str, object]]:
    job = base / "job.py"
    job.write_text(JOB)
    rows = _disks(job, base)
    blocker = base / "a-file"
    blocker.write_text("not a folder")
    rc, out, _ = _run([sys.executable, str(job), "", "none"],
                      _env(PARLAY_SNAPSHOT_DIR=str(blocker / "shm")))
    rows.append(_row("unwritable PARLAY_SNAPSHOT_DIR warns", rc == 0 and "in-memory snapshots "
                     "off" in out and str(blocker / "shm") in out and "done at step 12" in out,
                     out, "snapshots off"))
    run = [sys.executable, "-m", "parlay.cli", "run", "-n", "2"]
    rc, out, secs = _run(run + [str(job), "", "SIGSTOP"], _env(PARLAY_TIMEOUT="5"))
    rows.append(_row(f"stopped rank ends the job ({secs:.0f} s, timeout 5 s)",
                     rc != 0 and secs < 60 and "parlay run: rank" in out, out, "parlay run:"))
    rc, out, _ = _run(run + ["--max-restarts", "1", str(job), "", "SIGKILL"])
    lines = [ln for ln in out.splitlines() if ln.startswith("parlay run:")]
    want = "parlay run: rank 1 failed (killed by SIGKILL); restart attempt 1 of 1 starting"
    rows.append(_row("one line per restart", rc == 0 and lines == [want]
                     and "Traceback" not in out and out.count("done at step 12") == 2,
                     out, "parlay run:"))
    return rows + _inputs(base) + [_randomk()]


#: Out-of-range inputs to ``parlay plan`` / ``parlay bench`` and a word their one line holds.
INPUTS = [
    (["plan", "--model-params", "1e30", "--bandwidth", "10gbit"], "model-params"),
    (["plan", "--model-params", "1e6", "--nodes", "100000000", "--bandwidth", "10gbit"],
     "nodes"),
    (["bench", "--quick", "--net", "0mbit", "--out", "OUT"], "0mbit"),
    (["bench", "--from", "/nonexistent/results.json", "--out", "OUT"],
     "/nonexistent/results.json"),
]


def _inputs(base: Path) -> list[dict[str, object]]:
    rows = []
    for args, word in INPUTS:
        args = [str(base / "bench-out") if a == "OUT" else a for a in args]
        rc, out, _ = _run([sys.executable, "-m", "parlay.cli", *args], timeout=120)
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        ok = rc == 2 and len(lines) <= 2 and "Traceback" not in out and \
            re.search(re.escape(word), out, re.I) is not None
        rows.append({"case": f"parlay {' '.join(args)}", "ok": ok,
                     "detail": f"exit {rc}: {lines[-1][:250] if lines else ''}"})
    return rows


def _randomk() -> dict[str, object]:
    """``parlay plan`` ranks by time to accuracy: random-k, fastest per step on a slow link but
    short of the accuracy target, is never recommended."""
    rc, out, _ = _run([sys.executable, "-m", "parlay.cli", "plan", "--model-params", "25e6",
                       "--batch", "64", "--compute-ms", "50", "--bandwidth", "100mbit",
                       "--nodes", "4", "--modes", "allreduce", "--compressors",
                       "randomk:0.01,topk:0.01,none"], timeout=120)
    rec = [ln for ln in out.splitlines() if ln.startswith("recommended:")]
    return _row("parlay plan never recommends random-k", rc == 0 and len(rec) == 1
                and "randomk" not in rec[0] and "not recommended: randomk:0.01" in out, out,
                "not recommended")


def run(repeats: int, workdir: Path) -> list[dict[str, object]]:
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    for i in range(repeats):
        base = workdir / f"try{i}"
        base.mkdir()
        rows += _once(base)
    return rows
