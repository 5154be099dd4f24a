"""parlay's DiLoCo against torchft's, side by side on CPU/gloo over loopback (issue 27's anchor).

Two replicas (one process each, :func:`parlay.testing.run_world`) train the 784-800-800-10 MLP
on real MNIST, batch 64 per replica, inner Adam (lr 1e-3), for 2 epochs (468 steps an epoch),
same initialisation and data order for every contestant:

* ``ddp``: torch ``DistributedDataParallel`` over the world's gloo group (the anchor).
* ``parlay``: :class:`parlay.local.diloco.DiLoCoOptimizer` around the Adam, ``sync_every=50``,
  its default outer Nesterov SGD (lr 0.7, momentum 0.9), no compression.
* ``torchft``: ``torchft.local_sgd.DiLoCo`` with the same H and outer optimizer, as torchft
  runs on CPU: one lighthouse (on rank 0), one ``Manager(ProcessGroupGloo, ...)`` per
  replica group with its own ``TCPStore``, ``use_async_quorum=False``; ``init_sync=False``
  (every replica starts from the same seeded weights, as parlay's broadcast ensures).
  torchft's quantiser needs a GPU, so neither DiLoCo quantises.
* Extra rows (``--rows``): ``parlay-fp16``/``parlay-int8``, parlay with fp16/int8
  pseudo-gradients; ``torchft-stream``, ``parlay-stream``, ``parlay-fp16-stream``,
  ``parlay-int8-stream``: Streaming DiLoCo, 2 fragments
  (torchft: the first Linear, the rest; parlay: its even split, the same here), each merged
  ``--tau`` inner steps after its exchange left (torchft's ``fragment_sync_delay``).
* ``compute-only``: the ceiling, the same inner steps with no exchange (parlay's optimizer
  with a round longer than the run; its accuracy is the start's): no DiLoCo at this H and
  inner optimizer can beat its samples/s.

The same hand-written loop drives every contestant (zero_grad, forward, backward, step).
Training is interleaved one round (H steps) at a time, in an order drawn afresh each round
(:func:`tools.bench.harness.round_order`), between barriers, so the load of other processes on
this shared machine hits every contestant alike; samples/s is samples over the summed round
times (``steady``: without the first round, which holds torchft's first quorum), and
``paired_median`` the median over rounds of one contestant's speed over the other's in the
same round (the ratio least moved by load that drifts between rounds).

Accuracy is on the 10,000 test images after 2 epochs: for the DiLoCo contestants the shared
weights of the last outer step (step 900; ``local``: each replica's own weights at step 936,
averaged over the replicas). Bytes are the payload each replica handed to its allreduces
(parlay: ``comm_stats()["wire_bytes"]``; torchft: the tensors given to ``Manager.allreduce``;
DDP: its buckets, through a comm hook); gloo's framing, torchft's quorum and heartbeat RPCs
are not counted. The loopback NIC counters also carry other processes' traffic: not used.

torchft is not a parlay dependency: ``pip install --no-deps torchft==0.2.0`` and then its
non-torch requirements (``pip install opentelemetry-api opentelemetry-sdk
opentelemetry-exporter-otlp-proto-http``); without it this script exits with status 2.

    PARLAY_DATA_DIR=../shared/data/mnist python benchmarks/diloco_torchft.py [--quick] [--json F]
    ... --rows parlay,torchft,compute-only,parlay-fp16 --rate 100mbit   # shaped links (root)
    ... --kill                     # what torchft discards when a replica dies in an outer sync
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import round_order, table, write_json  # noqa: E402

from parlay.testing import run_world  # noqa: E402
from tools.bench.accuracy import _test_acc, build_mlp, load_mnist, prep  # noqa: E402

INSTALL = ("torchft is not installed. Install it without touching torch:\n"
           "  python3 -m pip install --no-deps torchft==0.2.0\n"
           "  python3 -m pip install opentelemetry-api opentelemetry-sdk "
           "opentelemetry-exporter-otlp-proto-http")


def _torchft(model: Any, inner: Any, cfg: dict[str, Any], rank: int,
             die_in_sync: bool = False, stream: bool = False) -> tuple[Any, dict]:
    """torchft's DiLoCo for this replica group (one process): its store, PG and Manager
    (``die_in_sync``: SIGKILL this process inside its first outer sync, allreduce started)."""
    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    t = timedelta(seconds=cfg["timeout"])
    host = cfg.get("host", "localhost")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)

    def load(sd: dict) -> None:  # a restarted replica heals from a live one
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                      min_replica_size=2, use_async_quorum=False, replica_id=f"replica{rank}",
                      store_addr=host, store_port=store.port, rank=0, world_size=1, hostname=host,
                      lighthouse_addr=cfg["lighthouse"], init_sync=False, timeout=t,
                      quorum_timeout=t, connect_timeout=t)
    sent = {"bytes": 0}
    allreduce = manager.allreduce

    def counted(tensor: Any, *a: Any, **k: Any) -> Any:
        sent["bytes"] += tensor.numel() * tensor.element_size()
        work = allreduce(tensor, *a, **k)
        if die_in_sync:
            os.kill(os.getpid(), signal.SIGKILL)
        return work

    manager.allreduce = counted  # type: ignore[method-assign]
    frags = [model[:2], model[2:]] if stream else [model]  # streaming: 2 fragments
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for f in frags]
    diloco = DiLoCo(manager, frags, inner, outer, sync_every=cfg["H"],
                    fragment_sync_delay=cfg["tau"] if stream else 0)
    diloco.__enter__()
    return diloco, {"store": store, "manager": manager, "sent": sent}


def _counting_hook(sent, bucket):  # type: ignore[no-untyped-def]  # (DDP reads annotations)
    """DDP's own allreduce of a bucket, its bytes counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    sent["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def _contestants(cfg: dict[str, Any], rank: int) -> dict[str, dict[str, Any]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from parlay.local.diloco import DiLoCoOptimizer

    runs: dict[str, dict[str, Any]] = {}
    for name in cfg["names"]:
        model = build_mlp()
        inner = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
        run: dict[str, Any] = {"model": model, "opt": inner, "time": [], "steps": 0}
        if name == "ddp":
            ddp = DistributedDataParallel(model)
            run.update(net=ddp, sent={"bytes": 0})
            ddp.register_comm_hook(run["sent"], _counting_hook)
        elif name.startswith("parlay") or name == "compute-only":
            h = 10**9 if name == "compute-only" else cfg["H"]
            stream = {"fragments": 2, "overlap": cfg["tau"]} if "stream" in name else {}
            run["opt"] = DiLoCoOptimizer(inner, model.named_parameters(), sync_every=h,
                                         compression=next((c for c in ("fp16", "int8")
                                                           if c in name), None),
                                         **stream)
        elif name.startswith("torchft"):
            mine = dict(cfg, lighthouse=cfg["lighthouses"][name])
            run["diloco"], extra = _torchft(model, inner, mine, rank, stream="stream" in name)
            run.update(extra)
        runs[name] = run
    return runs


def _shared_acc(name: str, run: dict[str, Any], xte: Any, yte: Any) -> float:
    """Test accuracy of the weights every replica shares (DiLoCo: the last outer step's)."""
    import torch

    model = run["model"]
    if name.startswith("parlay") or name == "compute-only":
        with run["opt"].shared_weights():
            return _test_acc(model, xte, yte)
    if name.startswith("torchft"):
        frags = run["diloco"]._fragments
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for f in frags:
                for n, p in f._model_fragment.named_parameters():
                    p.copy_(f.original_parameters[n])
            acc = _test_acc(model, xte, yte)
            for n, p in model.named_parameters():
                p.copy_(mine[n])
        return acc
    return _test_acc(model, xte, yte)


def _local_acc(model: Any, xte: Any, yte: Any) -> float:
    """This replica's own weights on the whole test set, averaged over the replicas."""
    import torch

    import parlay

    with torch.no_grad():
        acc = (model(prep(xte)).argmax(1) == yte).double().mean().reshape(1) * 100
    parlay.comm.allreduce(acc, "sum")
    return float(acc) / parlay.size()


def _worker(cfg: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch
    import torch.nn as nn

    import parlay

    torch.set_num_threads(1)
    rank, world = parlay.rank(), parlay.size()
    # one lighthouse per torchft contestant, on rank 0's host, at its address
    import socket

    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as so:
        so.connect((os.environ["MASTER_ADDR"], 9))
        cfg = dict(cfg, host=so.getsockname()[0])
    lighthouses = {n: LighthouseServer(bind="[::]:0", min_replicas=2)
                   for n in cfg["names"] if n.startswith("torchft") and rank == 0}
    addrs = [{n: f"http://{cfg['host']}:{lh.address().rsplit(':', 1)[1]}"
              for n, lh in lighthouses.items()}]
    dist.broadcast_object_list(addrs, src=0)
    cfg = dict(cfg, lighthouses=addrs[0])
    xtr, ytr = load_mnist(cfg["data"], "train")
    xte, yte = load_mnist(cfg["data"], "test")
    if cfg["train_samples"]:
        xtr, ytr = xtr[:cfg["train_samples"]], ytr[:cfg["train_samples"]]
    runs = _contestants(cfg, rank)
    gbatch = cfg["batch"] * world
    per_epoch = len(xtr) // gbatch
    total = per_epoch * cfg["epochs"]
    perms = [torch.randperm(len(xtr), generator=torch.Generator().manual_seed(e))
             for e in range(cfg["epochs"])]
    loss_fn = nn.CrossEntropyLoss()
    for i, start in enumerate(range(0, total, cfg["H"])):
        for name in round_order(list(runs), i):
            run = runs[name]
            net, opt = run.get("net", run["model"]), run["opt"]
            parlay.comm.barrier()
            t0 = time.perf_counter()
            for s in range(start, min(total, start + cfg["H"])):
                e, k = divmod(s, per_epoch)
                idx = perms[e][k * gbatch + rank * cfg["batch"]:][:cfg["batch"]]
                opt.zero_grad()
                loss_fn(net(prep(xtr[idx])), ytr[idx]).backward()
                opt.step()
            parlay.comm.barrier()
            run["time"].append(time.perf_counter() - t0)
            run["steps"] = min(total, start + cfg["H"])
    rows = []
    for name, run in runs.items():
        secs = torch.tensor(run["time"], dtype=torch.float64)
        parlay.comm.allreduce(secs, "max")
        samples = run["steps"] * gbatch
        per_round = cfg["H"] * gbatch
        sent = run["sent"]["bytes"] if "sent" in run else run["opt"].comm_stats()["wire_bytes"]
        row = {"name": name, "steps": run["steps"], "train_s": float(secs.sum()),
               "samples_per_s": samples / float(secs.sum()),
               "samples_per_s_steady": (samples - per_round) / float(secs[1:].sum()),
               "ms_per_step": 1000 * float(secs.sum()) / run["steps"],
               "accuracy_%": _shared_acc(name, run, xte, yte),
               "local_accuracy_%": _local_acc(run["model"], xte, yte),
               "MB_sent_per_replica": sent / 1e6, "round_s": secs.tolist()}
        if name.startswith("torchft"):
            row["committed_outer_steps"] = run["manager"].current_step()
            run["diloco"].__exit__(None, None, None)
            run["manager"].shutdown(wait=False)
        rows.append(row)
    parlay.comm.barrier()
    for lh in lighthouses.values():
        lh.shutdown()
    return rows if rank == 0 else []


def _replica(a: argparse.Namespace) -> None:
    """One torchft replica group of the kill run (a process of its own): ``a.steps`` inner
    steps, then what it trained and what it committed, in ``a.out``."""
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    xtr, ytr = load_mnist(a.data or None, "train")
    model = build_mlp()
    inner = torch.optim.Adam(model.parameters(), lr=a.lr)
    cfg = {"H": a.sync_every, "lighthouse": a.replica[1], "timeout": 120}
    rank = int(a.replica[0])
    diloco, extra = _torchft(model, inner, cfg, rank, die_in_sync=a.die_in_sync)
    for s in range(a.steps):
        idx = torch.arange(64) + (s * 128 + rank * 64) % (len(xtr) - 64)
        inner.zero_grad()
        nn.functional.cross_entropy(model(prep(xtr[idx])), ytr[idx]).backward()
        inner.step()
    commits = extra["manager"].current_step()
    with open(a.out, "w") as f:
        json.dump({"inner_steps": a.steps, "committed_rounds": commits,
                   "discarded_inner_steps": a.steps - a.sync_every * commits}, f)
    diloco.__exit__(None, None, None)
    extra["manager"].shutdown(wait=False)


def _kill_run(a: argparse.Namespace, lighthouse: str) -> dict[str, Any]:
    """torchft: replica 1 SIGKILLs itself inside the first outer sync and is started again;
    replica 0 trains 3 rounds, the restarted replica 1 2 (they meet at their syncs)."""
    import tempfile

    base = [sys.executable, os.path.abspath(__file__), "--data", a.data or "",
            "--sync-every", str(a.sync_every), "--lr", str(a.lr)]
    with tempfile.TemporaryDirectory() as d:
        def start(rank: int, steps: int, *extra: str) -> subprocess.Popen:
            return subprocess.Popen(base + ["--replica", str(rank), lighthouse, "--steps",
                                            str(steps), "--out", f"{d}/r{rank}.json", *extra],
                                    stderr=subprocess.DEVNULL)
        survivor = start(0, 3 * a.sync_every)
        killed = start(1, 3 * a.sync_every, "--die-in-sync").wait()
        again = start(1, 2 * a.sync_every)
        rcs = [survivor.wait(timeout=600), again.wait(timeout=600)]
        out = {f"replica{r}": json.load(open(f"{d}/r{r}.json")) for r in range(2)
               if os.path.exists(f"{d}/r{r}.json")}
    return {"killed_rc": killed, "rcs": rcs, **out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.environ.get("PARLAY_DATA_DIR"),
                   help="folder with the MNIST IDX .gz files (default: $PARLAY_DATA_DIR)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 epoch of 12,800 images")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=50, help="H")
    p.add_argument("--lr", type=float, default=1e-3, help="inner Adam's")
    p.add_argument("--rows", default="ddp,parlay,torchft,compute-only",
                   help="contestants, of: ddp, parlay, torchft, compute-only, parlay-fp16, "
                   "torchft-stream, parlay-stream, parlay-fp16-stream, parlay-int8, "
                   "parlay-int8-stream")
    p.add_argument("--tau", type=int, default=20, help="the streaming rows' overlap")
    p.add_argument("--json", default=None)
    p.add_argument("--kill", action="store_true",
                   help="instead: what torchft discards when a replica dies in an outer sync")
    p.add_argument("--replica", nargs=2, metavar=("RANK", "LIGHTHOUSE"), help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--die-in-sync", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--rate", default=None,
                   help="instead of loopback: 2 simulated hosts (root), links shaped to RATE")
    a = p.parse_args(argv)
    if a.replica:
        _replica(a)
        return 0
    if a.spec:  # one rank on a simulated host (--rate)
        from tools.cluster.spec_run import rank_main
        rank_main(_worker, "diloco_torchft", 600, ["--spec", a.spec, "--out", a.out])
        return 0
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        print(f"{INSTALL}\n({e})", file=sys.stderr)
        return 2
    if a.kill:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
        try:
            res = _kill_run(a, lighthouse.address())
        finally:
            lighthouse.shutdown()
        print(json.dumps(res, indent=1))
        write_json(a.json, "diloco_torchft_kill", {}, [res])
        return 0
    names = a.rows.split(",")
    cfg = {"data": a.data, "names": names, "epochs": 1 if a.quick else a.epochs, "batch": 64,
           "lr": a.lr, "H": a.sync_every, "tau": a.tau, "train_samples": 12800 if a.quick else 0,
           "timeout": 120}
    info: dict[str, Any] = {"link": "loopback"}
    if a.rate:
        from tools.cluster.spec_run import launch
        rows, info = launch("benchmarks.diloco_torchft", cfg, 2, a.rate, 7200, measure_link=True)
    else:
        rows = run_world(_worker, 2, cfg, timeout=7200, comm_timeout=600)[0]
    by = {r["name"]: r for r in rows}
    ratios: dict[str, float] = {}
    for num, den in (("parlay", "torchft"), ("parlay", "ddp"), ("torchft", "ddp"),
                     ("parlay-fp16", "torchft"), ("compute-only", "torchft"),
                     ("parlay-stream", "torchft-stream"), ("parlay-stream", "torchft"),
                     ("parlay-fp16-stream", "torchft-stream"),
                     ("parlay-fp16-stream", "torchft"), ("parlay-int8", "torchft"),
                     ("parlay-int8-stream", "torchft-stream"),
                     ("parlay-int8-stream", "torchft")):
        if num in by and den in by:
            for k in ("samples_per_s", "samples_per_s_steady"):
                ratios[f"{num}/{den}_{k}"] = by[num][k] / by[den][k]
            ratios[f"{num}/{den}_paired_median"] = statistics.median(
                b / a for a, b in zip(by[num]["round_s"], by[den]["round_s"]))
            if num != "compute-only":  # its accuracy is the start's, its bytes none
                ratios[f"{num}-{den}_accuracy_points"] = \
                    by[num]["accuracy_%"] - by[den]["accuracy_%"]
                ratios[f"{den}/{num}_bytes"] = \
                    by[den]["MB_sent_per_replica"] / by[num]["MB_sent_per_replica"]
    print(table(rows, ["name", "steps", "samples_per_s", "samples_per_s_steady", "ms_per_step",
                       "accuracy_%", "local_accuracy_%", "MB_sent_per_replica", "train_s"]))
    print(json.dumps(ratios, indent=1))
    print(json.dumps(info))
    write_json(a.json, "diloco_torchft", ratios, rows, link=info,
               config=cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
