"""A lost async/stale parameter-server worker drops no data: after a worker is SIGKILLed in
epoch 0 under ``parlay run -n 4 --ps 1``, the survivors train every sample of every later
epoch exactly once (counted from the samples their losses saw) and the epoch summaries in
``metrics.jsonl`` count what was trained; the job ends with exit 0."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

N = 48
JOB = '''
import json, os, signal, sys, torch, torch.nn as nn
from torch.utils.data import TensorDataset
import parlay
out, consistency, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
x = torch.randn(N, 5, generator=torch.Generator().manual_seed(3))
y = torch.cat([torch.arange(N, dtype=torch.float32)[:, None], x[:, :2]], 1)
seen = []
def build():
    def loss(o, t):
        seen.extend(int(i) for i in t[:, 0])  # column 0: the sample's index
        return nn.functional.mse_loss(o, t[:, 1:])
    return nn.Linear(5, 2), loss
t = parlay.Trainer(build, TensorDataset(x, y), optimizer=torch.optim.SGD,
                   optimizer_args={"lr": 0.01}, batch_size=2, num_epochs=3, progress=False,
                   mode="ps", metrics_path=f"{out}/metrics.jsonl",
                   strategy_options={"consistency": consistency})
per_epoch = {}
while not t.should_stop():
    if parlay.rank() == victim and t.state.step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    epoch = t.state.epoch
    t.train_on_batch()
    per_epoch.setdefault(epoch, []).extend(seen)
    seen.clear()
with open(f"{out}/seen-r{parlay.rank()}.json", "w") as f:
    json.dump(per_epoch, f)
'''.replace("N, 5", f"{N}, 5").replace("arange(N", f"arange({N}")


def _try(i: int, workdir: Path, consistency: str) -> dict[str, object]:
    out = workdir / f"try{i}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.py").write_text(JOB)
    victim = 1 + i % 3  # a worker rank (rank 0 is the server)
    env = {**os.environ, "PARLAY_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "parlay.cli", "run", "-n", "4", "--ps", "1",
                        str(out / "job.py"), str(out), consistency, str(victim)], env=env,
                       capture_output=True, text=True, timeout=300)
    survivors = [r for r in (1, 2, 3) if r != victim]
    seen = {r: json.loads((out / f"seen-r{r}.json").read_text())
            for r in survivors if (out / f"seen-r{r}.json").is_file()}
    problems = [] if p.returncode == 0 else [f"exit {p.returncode}: {p.stderr[-300:]}"]
    if len(seen) != len(survivors):
        problems.append(f"survivors that finished: {sorted(seen)} of {survivors}")
    for e in ("1", "2"):
        counts = collections.Counter(s for r in seen.values() for s in r.get(e, []))
        if sorted(counts) != list(range(N)) or set(counts.values()) != {1}:
            problems.append(f"epoch {e}: {len(counts)} distinct of {N} samples, "
                            f"{sum(counts.values())} trained")
    summaries = {}
    if (out / "metrics.jsonl").is_file():
        rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        summaries = {r["epoch"]: r.get("samples") for r in rows if r["event"] == "epoch"}
    if summaries.get(1) != N or summaries.get(2) != N:
        problems.append(f"summaries count {summaries}, want {N} in epochs 1 and 2")
    return {"case": consistency, "ok": not problems,
            "detail": "; ".join(problems) or f"worker rank {victim} killed at step 3; epochs 1-2 "
            f"trained all {N} samples once each; summaries {summaries}"}


def run(repeats: int, workdir: Path) -> list[dict[str, object]]:
    return [_try(i, workdir, c) for i in range(repeats) for c in ("async", "stale:2")]
