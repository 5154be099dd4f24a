"""Two jobs under one run id: a second live job refuses to start, naming the holder; a job with
another recipe under the id of a killed one refuses its snapshots, naming the settings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

JOB = '''
import sys, torch, torch.nn as nn
from pathlib import Path
from torch.utils.data import TensorDataset
import parlay
lr, steps, marker = float(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=g)
t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)),
                            nn.CrossEntropyLoss()),
                   TensorDataset(x, (x[:, 0] > 0).long()), optimizer_args={"lr": lr},
                   batch_size=16, num_epochs=1000, snapshot_every=1, progress=False)
while t.state.step < steps:
    t.train_on_batch()
    if t.state.step == 3 and parlay.rank() == 0:
        marker.write_text("live")
'''


def _launch(script: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "parlay.cli", "run", "-n", "2", str(script),
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -999, out
    return p.returncode, out


def _try(i: int, workdir: Path) -> list[dict[str, object]]:
    script = workdir / "job.py"
    script.write_text(JOB)
    marker = workdir / f"live-{i}"
    env = {**os.environ, "PARLAY_RUN_ID": f"same-{i}", "PARLAY_SNAPSHOT_DIR": str(workdir / "shm"),
           "PARLAY_TIMEOUT": "30"}
    first = _launch(script, env, "0.01", "1000000", str(marker))
    rows: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # a driver waiting for the first job to be live, not a test
        if not marker.exists():
            return [{"case": "live", "ok": False, "detail": "the first job never got going: "
                     + _finish(first, 5)[1][-300:]}]
        rc, out = _finish(_launch(script, env, "0.01", "20", str(workdir / "x")))
        ok = rc != 0 and "is in use by a live job on this host" in out and "holds rank" in out
        rows.append({"case": "second live job refused", "ok": ok,
                     "detail": f"exit {rc}: " + _line(out, "in use by a live job")})
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: its snapshots stay
        first.wait()
    rc, out = _finish(_launch(script, env, "0.02", "20", str(workdir / "x")))
    ok = rc != 0 and "other training settings" in out and "'lr': 0.02} now" in out \
        and "resumed at step" not in out
    rows.append({"case": "other recipe after the first ended refused", "ok": ok,
                 "detail": f"exit {rc}: " + _line(out, "other training settings")})
    return rows


def _line(out: str, needle: str) -> str:
    hits = [ln for ln in out.splitlines() if needle in ln]
    return (hits[0] if hits else out.strip().splitlines()[-1] if out.strip() else "")[:300]


def run(repeats: int, workdir: Path) -> list[dict[str, object]]:
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    for i in range(repeats):
        rows += _try(i, workdir)
    return rows
