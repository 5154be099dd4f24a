"""Gradient compression on real MNIST: test accuracy and bytes on the wire per compressor.

Trains the 784-800-800-10 MLP on 2 gloo ranks (:func:`parlay.testing.run_world`) with each
compressor for the same epochs, data order and initialisation. Training is interleaved
``chunk`` steps at a time in a rotating order, so load from other processes on the machine hits
every compressor alike. Bytes are what ``DistributedOptimizer.comm_stats()`` measured (top-k:
values + int32 indices; PowerSGD: P, Q and the dense 1-D tensors).

The training core of ``benchmarks/compression.py`` (which adds its targets and table) and of
``parlay bench`` (accuracy vs bytes per step). MNIST comes from ``--data``/``PARLAY_DATA_DIR``
or, failing that, from the copy shipped inside parlay.
"""
from __future__ import annotations

import gzip
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

__all__ = ["read_idx", "load_mnist", "prep", "build_mlp", "train_compressors", "split_specs",
           "run_accuracy", "FILES"]

FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def read_idx(path: Path) -> np.ndarray:
    """Read one (gzipped) IDX file: magic 0x0000080N (uint8 data, N dims), then sizes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        zero, dtype, ndim = struct.unpack(">HBB", f.read(4))
        if zero != 0 or dtype != 0x08:
            raise ValueError(f"{path} is not a uint8 IDX file (magic {zero:#x} {dtype:#x})")
        shape = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    return data.reshape(shape)


def load_mnist(root: str | None, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 (n, 784) and labels as int64, from the four standard IDX .gz files in
    ``root`` (``None``: the copy shipped inside parlay)."""
    if root is None:
        from parlay.data.mnist import bundled_root

        root = str(bundled_root())
    img, lbl = (Path(root) / f for f in FILES[split])
    for p in (img, lbl):
        if not p.exists():
            raise SystemExit(f"missing {p}; pass --data DIR (or PARLAY_DATA_DIR) holding the "
                             "four MNIST IDX .gz files")
    x = torch.from_numpy(read_idx(img).reshape(-1, 784).copy())
    return x, torch.from_numpy(read_idx(lbl).astype(np.int64))


def prep(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / 255.0 - 0.1307) / 0.3081


def build_mlp() -> nn.Module:
    """The 784-800-800-10 MLP (same initialisation for every compressor)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 800), nn.ReLU(), nn.Linear(800, 800), nn.ReLU(),
                         nn.Linear(800, 10))


def _runs(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from parlay.compression import get_compressor
    from parlay.horovod import DistributedOptimizer  # what parlay.DistributedOptimizer is

    runs = []
    for name in cfg["compressors"]:
        model = build_mlp()
        comp = get_compressor(name)
        # DGC momentum correction (e.g. "topk:0.001,momentum=0.9") moves the momentum into
        # the compressor, so the optimizer runs without it (Lin et al. 2018).
        dgc = getattr(getattr(comp, "memory", None), "momentum", 0.0)
        base = torch.optim.SGD(model.parameters(), lr=cfg["lr"],
                               momentum=0.0 if dgc else cfg["momentum"],
                               weight_decay=cfg["weight_decay"])
        opt = DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=comp)
        runs.append({"name": name, "model": model, "opt": opt, "time": 0.0})
    return runs


def _train(cfg: dict[str, Any], runs: list[dict[str, Any]], xtr: torch.Tensor,
           ytr: torch.Tensor) -> None:
    import parlay

    rank, world = parlay.rank(), parlay.size()
    gbatch = cfg["batch"] * world
    steps = len(xtr) // gbatch
    loss_fn = nn.CrossEntropyLoss()
    chunk, turn = cfg["chunk"], 0
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
        for run in runs:  # step decay at 2/3 of training
            for g in run["opt"].param_groups:
                g["lr"] = cfg["lr"] * (0.1 if epoch >= cfg["decay_epoch"] else 1.0)
        # Every compressor trains the same steps in turn, `chunk` steps at a time, in a rotating
        # order: load from other processes lands on all of them alike.
        for start in range(0, steps, chunk):
            turn += 1
            shift = turn % len(runs)
            for run in runs[shift:] + runs[:shift]:
                model, opt = run["model"], run["opt"]
                parlay.comm.barrier()
                t0 = time.perf_counter()
                for s in range(start, min(steps, start + chunk)):
                    lo = s * gbatch + rank * cfg["batch"]
                    idx = perm[lo: lo + cfg["batch"]]
                    opt.zero_grad()
                    loss_fn(model(prep(xtr[idx])), ytr[idx]).backward()
                    opt.step()
                parlay.comm.barrier()
                run["time"] += time.perf_counter() - t0
                if cfg.get("curve"):  # untimed: (steps trained, test accuracy) after the chunk
                    done = epoch * steps + min(steps, start + chunk)
                    run.setdefault("curve", []).append((done, _test_acc(model, *cfg["curve"])))


def _test_acc(model: nn.Module, xte: torch.Tensor, yte: torch.Tensor) -> float:
    """Test accuracy in percent, each rank scoring its share of the test set."""
    import parlay

    rank, world = parlay.rank(), parlay.size()
    with torch.no_grad():
        right = (model(prep(xte[rank::world])).argmax(1) == yte[rank::world]).sum()
    total = right.to(torch.float64).reshape(1).to(parlay.comm.group_device())
    parlay.comm.allreduce(total, "sum")
    return float(total) * 100 / len(yte)


def train_compressors(cfg: dict[str, Any]) -> list[dict[str, Any]] | None:
    """On every rank of a process group: train one model per compressor of ``cfg`` side by side.

    With ``cfg["curve"]`` true, the test accuracy is also taken after every ``chunk`` steps
    (untimed), as each row's ``curve``: ``[(steps, accuracy %), ...]``.

    Returns:
        On rank 0, one row per compressor (test accuracy, bytes per step, wall seconds, whether
        it diverged, whether the ranks agree bitwise, the curve); ``None`` on the others.
    """
    import parlay

    xtr, ytr = load_mnist(cfg["data"], "train")
    xte, yte = load_mnist(cfg["data"], "test")
    if cfg["train_samples"]:
        xtr, ytr = xtr[: cfg["train_samples"]], ytr[: cfg["train_samples"]]
    runs = _runs(cfg)
    _train(dict(cfg, curve=(xte, yte) if cfg.get("curve") else None), runs, xtr, ytr)
    rows = []
    for run in runs:
        model, opt = run["model"], run["opt"]
        with torch.no_grad():
            acc = float((model(prep(xte)).argmax(1) == yte).float().mean()) * 100
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            checksum = torch.tensor([sum(float(p.double().sum()) for p in model.parameters())],
                                    dtype=torch.float64, device=parlay.comm.group_device())
        sums = parlay.comm.allgather(checksum).view(torch.int64)  # bitwise: NaN == NaN here
        st = opt.comm_stats()
        rows.append({"compressor": run["name"], "test_acc": acc, "wall_s": run["time"],
                     "diverged": not finite,
                     "dense_bytes_per_step": st["dense_bytes_per_step"],
                     "wire_bytes_per_step": st["wire_bytes_per_step"],
                     "reduction": st["ratio"], "steps": st["steps"],
                     "ranks_agree": bool(torch.all(sums == sums[0])),
                     "curve": run.get("curve", [])})
    return rows if parlay.rank() == 0 else None


def split_specs(text: str) -> list[str]:
    """Split ``"none,fp16,topk:0.01,momentum=0.9"`` at commas that start a new compressor."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if out and ("=" in part or part.replace(".", "", 1).isdigit()):
            out[-1] += "," + part  # an option of the previous compressor
        else:
            out.append(part)
    return out


def run_accuracy(compressors: list[str], data: str | None, epochs: int = 1,
                 train_samples: int = 12000, world: int = 2, batch: int = 64,
                 lr: float = 0.05, momentum: float = 0.9) -> list[dict[str, Any]]:
    """The compression benchmark's settings (``--quick``: 1 epoch on 12k samples) on
    ``world`` loopback ranks; rows as :func:`train_compressors`, with accuracy and bytes
    relative to ``none`` (added first when missing)."""
    from parlay.testing import run_world

    names = list(compressors)
    if "none" not in names:
        names.insert(0, "none")
    cfg = {"data": data, "compressors": names, "epochs": epochs, "batch": batch, "lr": lr,
           "momentum": momentum, "weight_decay": 0.0, "train_samples": train_samples,
           "chunk": 25, "decay_epoch": epochs if epochs < 3 else int(round(epochs * 2 / 3))}
    rows = run_world(train_compressors, world, cfg, timeout=7200, comm_timeout=600)[0]
    anchor = next(r for r in rows if r["compressor"] == "none")
    for r in rows:
        r["acc_delta_pts"] = r["test_acc"] - anchor["test_acc"]
        r["bytes_vs_none"] = r["wire_bytes_per_step"] / anchor["wire_bytes_per_step"]
    return rows
