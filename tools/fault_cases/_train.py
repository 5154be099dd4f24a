"""The training script the fault cases launch under ``parlay run``, and how they launch it.

A small MLP (784-32-10, Adam) on MNIST-shaped synthetic data, deterministic on CPU, so that a
run resumed after a fault can be compared with an uninterrupted one bit for bit. On request a
rank SIGKILLs itself after a step (``--kill STEP:RANK``) or flips one bit of one parameter
(``--flip STEP:RANK:SEED``). Each rank writes ``<out>/r<rank>.json`` (where it resumed, the
divergence it saw) and, when training ends, ``<out>/final-r<rank>.pt`` (its parameters).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def launch(out: Path, nproc: int, args: list[str], env: dict[str, str],
           timeout: float = 180, script: str = __file__,
           max_restarts: int = 0) -> subprocess.CompletedProcess[str]:
    """``parlay run -n nproc --max-restarts N`` ``script`` (default: this one) with ``args``,
    writing to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'src'}:{ROOT}", **env)
    cmd = [sys.executable, "-m", "parlay.cli", "run", "-n", str(nproc), "--max-restarts",
           str(max_restarts), script, "--out", str(out), *args]
    try:
        return subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # a hang: the caller reports it
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return subprocess.CompletedProcess(cmd, 124, "", f"{err}\nTIMEOUT after {timeout} s")


def tries(workdir: Path, repeats: int,
          one: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
    """``one(i)`` for each of ``repeats`` tries, one row each, saying on stderr how each went."""
    rows = []
    for i in range(repeats):
        rows.append(one(i))
        print(f"  {workdir.name} {i + 1}/{repeats}: {'ok' if rows[-1]['ok'] else 'FAIL'}",
              file=sys.stderr, flush=True)
    return rows


def finals(out: Path, nproc: int) -> list[dict[str, Any]] | None:
    """Every rank's final parameters, or ``None`` when some rank did not finish."""
    import torch

    paths = [out / f"final-r{r}.pt" for r in range(nproc)]
    if not all(p.is_file() for p in paths):
        return None
    return [torch.load(p, weights_only=True) for p in paths]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-identical parameter dicts (NaN payloads compared as bits)."""
    import torch

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
        for k in a)


def flip_bit(t: Any, rng: random.Random) -> tuple[int, int]:
    """Flip one random bit of the float32 tensor ``t`` in place; returns (element, bit)."""
    import torch

    i, bit = rng.randrange(t.numel()), rng.randrange(32)
    mask = torch.tensor([1 << bit if bit < 31 else -(1 << 31)], dtype=torch.int32)
    with torch.no_grad():
        t.view(-1)[i:i + 1].view(torch.int32).bitwise_xor_(mask)
    return i, bit


def _build() -> Any:
    import torch.nn as nn

    return (nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10)),
            nn.CrossEntropyLoss())


def _data() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1, 28, 28, generator=g)
    return TensorDataset(x, x.flatten(1)[:, :10].argmax(1))


def _pair(text: str | None, n: int) -> list[int] | None:
    return [int(v) for v in text.split(":")][:n] if text else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--snapshot-every", default="1")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--replica-check", default="auto")
    p.add_argument("--kill", help="STEP:RANK")
    p.add_argument("--flip", help="STEP:RANK:SEED")
    a = p.parse_args()
    import torch

    import parlay
    from parlay.errors import NonFiniteError, ReplicaDivergence

    torch.set_num_threads(1)
    every = a.snapshot_every if a.snapshot_every == "auto" else int(a.snapshot_every)
    check = a.replica_check if a.replica_check == "auto" else int(a.replica_check)
    t = parlay.Trainer(_build, _data(), optimizer_args={"lr": 1e-3}, batch_size=32,
                       max_iteration=a.steps, checkpoint_dir=a.ckpt,
                       checkpoint_every=a.checkpoint_every or None, snapshot_every=every,
                       replica_check=check, progress=False, log_step_size=10**9)
    rank, out = parlay.rank(), Path(a.out)
    rec: dict[str, Any] = {"rank": rank, "start": t.state.step,
                           "snapshot": t.resumed_from_snapshot}
    kill, flip = _pair(a.kill, 2), _pair(a.flip, 3)
    try:
        while not t.should_stop():
            t.train_on_batch()
            step = t.state.step
            if kill and kill == [step, rank]:
                os.kill(os.getpid(), signal.SIGKILL)
            if flip and flip[:2] == [step, rank]:
                rng = random.Random(flip[2])
                params = list(t.model.parameters())
                k = rng.randrange(len(params))
                i, bit = flip_bit(params[k].data, rng)
                rc = t.persistence.replicas
                rec["flip"] = {"step": step, "param": k, "element": i, "bit": bit,
                               "every": rc.every, "next_check": rc.next}
    except ReplicaDivergence as e:
        rec.update(diverged=e.step, ranks=e.ranks, agreed_at=e.agreed_at)
        raise
    except NonFiniteError as e:
        rec.update(nonfinite=e.step, nonfinite_rank=e.rank)
        raise
    finally:
        rec["end"] = t.state.step
        (out / f"r{rank}.json").write_text(json.dumps(rec))
    torch.save({k: v.detach().clone() for k, v in t.model.state_dict().items()},
               out / f"final-r{rank}.pt")


if __name__ == "__main__":
    main()
