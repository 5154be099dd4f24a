"""GPU smoke check: every training mode and shard level on CUDA tensors, in a few minutes.

Usage (from the checkout; ``tools/gpu_check.sh`` sets ``PYTHONPATH=src``)::

    tools/gpu_check.sh            # on a machine with a CUDA device
    tools/gpu_check.sh --cpu      # the same checks on CPU tensors and gloo (NCCL ones skip)
    tools/gpu_check.sh --only shard=parameters

Each "world" is a real launch (``python -m parlay.cli run -n N``) whose ranks run several short
Trainer runs of a small MLP in turn:

* ``nccl1``: one rank, ``backend="auto"`` (CUDA tensors over NCCL); ``nccl1-only``: ``"nccl"``.
* ``gloo2``: two ranks on one GPU over gloo with CUDA tensors (NCCL refuses two ranks per GPU):
  the ranks create the gloo default group themselves and ``parlay.init()`` adopts it, which puts
  them on ``cuda:<local_rank % device_count>``.
* ``ps2``: one parameter server and one worker (``--ps 1``), the worker on CUDA.
* ``restart2-*``: ``--max-restarts 1``; rank 1 SIGKILLs itself at step 5 of the first attempt,
  the second resumes from the in-memory snapshot (``snapshot_every=1``) and must end bit for
  bit where ``gloo2``'s uninterrupted run of the same recipe ended.

One line per check: PASS/FAIL/SKIP, seconds, and what was seen or why. A world whose rank dies
or hangs marks the check it was in as FAIL and is relaunched with the checks left.
Exit status: 0 when nothing failed (also without a CUDA device and without ``--cpu``: then it
prints "no CUDA device: nothing to check"), 1 when a check failed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 230.0  # the whole run stays under 4 minutes
STEPS = 6

# world -> (ranks, extra `parlay run` flags, backend: "auto"/"nccl" or "gloo" = adopted group)
WORLDS: dict[str, tuple[int, list[str], str]] = {
    "nccl1": (1, [], "auto"),
    "nccl1-only": (1, [], "nccl"),
    "gloo2": (2, [], "gloo"),
    "ps2": (2, ["--ps", "1"], "gloo"),
    "restart2-none": (2, ["--max-restarts", "1"], "gloo"),
    "restart2-parameters": (2, ["--max-restarts", "1"], "gloo"),
}
LEVELS = (None, "optimizer", "gradients", "parameters")


def plan() -> list[tuple[str, str]]:
    """Every (world, check) in run order; a check name is ``kind[:option=value,...]``."""
    out: list[tuple[str, str]] = []
    for world in ("nccl1", "gloo2"):
        out += [(world, f"allreduce:shard={lv}") for lv in LEVELS]
        out += [(world, f"allreduce:shard={lv},precision={p}")
                for p in ("bf16", "fp16") for lv in (None, "gradients")]
    out += [("nccl1-only", f"allreduce:shard={lv}") for lv in (None, "parameters")]
    out += [(world, f"diloco:shard=None,precision={p}") for world in ("nccl1", "gloo2")
            for p in ("fp32", "bf16")]
    out += [("gloo2", f"hybrid:shard={lv}") for lv in (None, "gradients")]
    out += [("gloo2", "hybrid:shard=None,precision=bf16"),
            ("gloo2", "equivalence:shard=parameters")]
    out += [("gloo2", f"restart_ref:shard={lv}") for lv in (None, "parameters")]
    out += [("ps2", "ps:shard=None"), ("ps2", "ps:shard=None,precision=bf16")]
    out += [(f"restart2-{lv}", f"restart:shard={lv}") for lv in ("none", "parameters")]
    return out


def _options(name: str) -> tuple[str, dict[str, Any]]:
    kind, _, rest = name.partition(":")
    opts: dict[str, Any] = {"shard": None, "precision": "fp32"}
    for item in filter(None, rest.split(",")):
        k, v = item.split("=")
        opts[k] = None if v in ("None", "none") else v
    return kind, opts


# ------------------------------------------------------------------------ on every rank
def _build() -> Any:
    import torch.nn as nn
    return (nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64),
                          nn.ReLU(), nn.Linear(64, 4)), nn.CrossEntropyLoss())


def _dataset() -> Any:
    import torch
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 16, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1)))


def _trainer(mode: str, shard: str | None, precision: str, **kw: Any) -> Any:
    import torch

    import parlay
    opts = {"hybrid": {"pp": 2, "chunks": 2},
            "diloco": {"sync_every": 4, "fragments": 2, "overlap": 1}}.get(mode)
    kw.setdefault("snapshot_every", 0)
    return parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                          optimizer_args={"lr": 0.05, "momentum": 0.9}, batch_size=8,
                          max_iteration=STEPS, warmup_epochs=0, mode=mode, shard=shard,
                          precision=precision, strategy_options=opts, replica_check=0,
                          progress=False, **kw)


def _full_params(t: Any) -> list[Any]:
    """This rank's model parameters, whole (gathered when sharded), on the CPU."""
    opt = getattr(t.strategy, "optimizer", None)
    gather = getattr(opt, "gathered_parameters", None)
    if t.model is None:
        return []
    if gather is None:
        return [p.detach().cpu().clone() for p in t.model.parameters()]
    with gather():
        return [p.detach().cpu().clone() for p in t.model.parameters()]


def _run(t: Any, ctx: dict[str, Any]) -> list[float]:
    """Train to the end; check the losses, the devices and that the parameters moved."""
    import torch
    losses = []
    while not t.should_stop():
        loss = t.train_on_batch()
        if loss is not None:
            losses.append(loss)
    assert all(torch.isfinite(torch.tensor(losses))), f"non-finite loss in {losses}"
    held = [p for p in (t.model.parameters() if t.model is not None else ()) if p.numel()]
    opt = getattr(t.strategy, "optimizer", None)
    held += [p for g in getattr(opt, "param_groups", ()) for p in g["params"]]
    wrong = {str(p.device) for p in held if p.device.type != ctx["device"]}
    assert not wrong, f"parameters or chunks on {wrong}, expected {ctx['device']}"
    if t.model is not None:
        torch.manual_seed(0)  # the Trainer's seed: the initial parameters
        first = list(_build()[0].parameters())
        final = _full_params(t)
        if len(final) == len(first):
            assert any(not torch.equal(a, b) for a, b in zip(final, first)), "nothing trained"
    return losses


def check_allreduce(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    import torch
    t = _trainer("allreduce", shard, precision)
    losses = _run(t, ctx)
    msg = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, skipped {t.skipped_steps}"
    if precision == "fp32":  # every level ends where the replicated run ended
        final, key = _full_params(t), ("ref", ctx["world"])
        if shard is None:
            ctx[key] = final
        elif key in ctx:
            worst = max(float((a - b).abs().max()) for a, b in zip(final, ctx[key]))
            assert worst <= 1e-5, f"differs from shard=None by {worst:.2e}"
            msg += f", max |diff| vs shard=None {worst:.1e}"
    assert t.skipped_steps < STEPS, "every step skipped"
    t.close()
    return msg + f", device {torch.tensor(0).to(ctx['device']).device}"


def _losses(mode: str, ctx: dict[str, Any], shard: str | None, precision: str,
            **kw: Any) -> list[float]:
    """A short Trainer run in ``mode`` (checked by ``_run``); its losses on this rank."""
    t = _trainer(mode, shard, precision, **kw)
    losses = _run(t, ctx)
    t.close()
    return losses


def check_hybrid(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    import parlay
    return f"{len(_losses('hybrid', ctx, shard, precision))} losses on rank {parlay.rank()}"


def check_diloco(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    losses = _losses("diloco", ctx, shard, precision, compression="fp16")
    return f"{len(losses)} inner steps, fp16 pseudo-gradients"


def check_ps(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    import parlay
    return f"{parlay.role()}: {len(_losses('ps', ctx, shard, precision))} losses"


def check_equivalence(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    """DistributedOptimizer(shard=...) on each rank's slice equals one process on the batch."""
    import torch
    import torch.nn.functional as F

    import parlay
    dev, r, n = ctx["device"], parlay.rank(), parlay.size()

    def model() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 4)).to(dev)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(STEPS, 8 * n, 16, generator=g).to(dev), None
    y = torch.sin(x[..., :4])
    ref = model()
    ro = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for s in range(STEPS):
        ro.zero_grad()
        F.mse_loss(ref(x[s]), y[s]).backward()
        ro.step()
    m = model()
    o = parlay.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2),
                                    named_parameters=m.named_parameters(), shard=shard, model=m,
                                    bucket_cap_mb=0.01)
    mine = slice(8 * r, 8 * (r + 1))
    for s in range(STEPS):
        o.zero_grad()
        F.mse_loss(m(x[s, mine]), y[s, mine]).backward()
        o.step()
    with o.gathered_parameters():
        got = [p.detach().clone() for p in m.parameters()]
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref.parameters()))
    assert worst <= 1e-5, f"max |diff| vs one process {worst:.2e}"
    assert all(p.device.type == dev for p in got)
    return f"{n} ranks, Adam, max |diff| {worst:.1e}"


def _state_file(ctx: dict[str, Any], shard: str | None, rank: int) -> Path:
    return Path(ctx["out"]) / f"restart-ref-{shard}-rank{rank}.pt"


def _restart_state(t: Any) -> dict[str, Any]:
    """This rank's parameters (its chunks when sharded) and optimizer state, on the CPU."""
    opt = t.strategy.optimizer
    if not t.strategy.shard:
        sd = {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}
    else:
        chunks = [c for g in opt.param_groups for c in g["params"]]
        sd = {f"chunk{i}": c.detach().cpu().clone() for i, c in enumerate(chunks)}
    sd.update({f"state{i}.{k}": v.cpu().clone() for i, s in enumerate(opt.optimizer.state.values())
               for k, v in s.items() if hasattr(v, "cpu")})
    return sd


def check_restart_ref(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    import torch

    import parlay
    t = _trainer("allreduce", shard, precision)  # check_restart's recipe, uninterrupted
    _run(t, ctx)
    torch.save(_restart_state(t), _state_file(ctx, shard, parlay.rank()))
    t.close()
    return "reference written"


def check_restart(ctx: dict[str, Any], shard: str | None, precision: str) -> str:
    import torch

    import parlay
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t = _trainer("allreduce", shard, precision, checkpoint_dir=f"{ctx['out']}/ckpt-{shard}",
                 checkpoint_every=3, snapshot_every=1)
    resumed = t.state.step
    while not t.should_stop():
        if attempt == 0 and parlay.rank() == 1 and t.state.step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        t.train_on_batch()
    got = _restart_state(t)
    want = torch.load(_state_file(ctx, shard, parlay.rank()), weights_only=True)
    assert attempt == 1, "the first attempt was not killed"
    assert resumed > 3 and t.resumed_from_snapshot == resumed, \
        f"resumed at step {resumed} (snapshot {t.resumed_from_snapshot}), not from a snapshot"
    assert got.keys() == want.keys(), f"state keys differ: {sorted(got)} vs {sorted(want)}"
    bad = [k for k in got if not torch.equal(got[k], want[k])]
    assert not bad, f"not bit-identical to the uninterrupted run: {bad}"
    t.close()
    return f"attempt {attempt} resumed from the snapshot of step {resumed}, bit-identical"


CHECKS = {"allreduce": check_allreduce, "hybrid": check_hybrid, "ps": check_ps,
          "diloco": check_diloco,
          "equivalence": check_equivalence, "restart_ref": check_restart_ref,
          "restart": check_restart}


def worker(world: str, names: list[str], out: str, cpu: bool) -> None:
    """One rank of a world: set the group up, run ``names`` in turn, record each."""
    import torch.distributed as dist

    from parlay import runtime
    _, flags, backend = WORLDS[world]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restarts_left = int(flags[flags.index("--max-restarts") + 1]) - attempt \
        if "--max-restarts" in flags else 0
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "gloo":  # our own gloo group: parlay adopts it, on CUDA when there is one
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}?rank={rank}" \
              f"&world_size={n}"
        store = next(dist.rendezvous(url, timeout=datetime.timedelta(seconds=60)))[0]
        prefix = f"gpu_check/attempt{attempt}"
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank,
                                world_size=n)
    runtime.init(backend="gloo" if cpu and backend != "gloo" else backend)
    ctx: dict[str, Any] = {"device": "cpu" if cpu else "cuda", "world": world, "out": out}
    with open(f"{out}/{world}.rank{rank}.jsonl", "a") as log:
        for name in names:
            t0, rec = time.perf_counter(), {"check": name, "rank": rank}
            try:
                assert runtime.device().type == ctx["device"], f"rank on {runtime.device()}"
                kind, opts = _options(name)
                rec.update(ok=True, msg=CHECKS[kind](ctx, **opts))
            except BaseException as e:  # noqa: BLE001 - recorded, then this world ends
                where = traceback.extract_tb(e.__traceback__)[-1]
                first = (str(e).splitlines() or [""])[0][:300]
                rec.update(ok=False, msg=f"{type(e).__name__}: {first} "
                           f"({Path(where.filename).name}:{where.lineno})")
            rec["s"] = time.perf_counter() - t0
            if not rec["ok"] and restarts_left:  # a peer killed itself: the launcher restarts
                os._exit(1)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if not rec["ok"]:
                os._exit(1)
    if backend == "gloo":
        runtime.shutdown()
        dist.destroy_process_group()


# ------------------------------------------------------------------------ the driver
def _launch(world: str, names: list[str], out: str, cpu: bool, limit: float) -> tuple[int, str]:
    n, flags, _ = WORLDS[world]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                        env.get("PYTHONPATH")])),
               PARLAY_TIMEOUT="60", OMP_NUM_THREADS="1")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "parlay.cli", "run", "-n", str(n), *flags, __file__,
           "--worker", world, "--out", out, "--checks", ";".join(names), *(["--cpu"] * cpu)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        text, _ = p.communicate(timeout=limit)
        return p.returncode, text
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate()
        return -9, f"timed out after {limit:.0f} s\n{text}"


def _results(out: str, world: str) -> dict[str, list[dict[str, Any]]]:
    recs: dict[str, list[dict[str, Any]]] = {}
    for f in Path(out).glob(f"{world}.rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            recs.setdefault(rec["check"], []).append(rec)
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="CPU tensors and gloo (checks the script)")
    ap.add_argument("--only", default="", help="run only checks whose world/name contains this")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--checks", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.checks.split(";"), a.out, a.cpu)
        return 0
    import torch
    if not a.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (torch "
              f"{torch.__version__}; run with --cpu to check the script on CPU tensors)")
        return 0
    where = "CPU tensors (--cpu)" if a.cpu else \
        f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    print(f"gpu_check: torch {torch.__version__}, {where}", flush=True)
    todo = [(w, c) for w, c in plan() if a.only in f"{w}/{c}"]
    start, failed = time.monotonic(), 0

    def say(world: str, name: str, verdict: str, secs: float, msg: str) -> None:
        print(f"{verdict:4} {secs:6.1f}s  {world:<20} {name:<40} {msg}", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpu_check-") as out:
        for world in dict.fromkeys(w for w, _ in todo):
            left = [c for w, c in todo if w == world]
            if a.cpu and WORLDS[world][2] == "nccl":
                for c in left:
                    say(world, c, "SKIP", 0, "NCCL needs CUDA (--cpu)")
                continue
            while left:
                budget = BUDGET_S - (time.monotonic() - start)
                if budget < 10:
                    for c in left:
                        say(world, c, "FAIL", 0, "not run: over the time budget")
                    failed += len(left)
                    break
                rc, text = _launch(world, left, out, a.cpu, budget)
                recs, nranks, ended = _results(out, world), WORLDS[world][0], False
                for c in list(left):
                    rs = recs.get(c, [])
                    bad = [r for r in rs if not r["ok"]]
                    if bad or len(rs) == nranks:
                        left.remove(c)
                        msg = f"rank {bad[0]['rank']}: {bad[0]['msg']}" if bad else " | ".join(
                            dict.fromkeys(r["msg"] for r in sorted(rs, key=lambda r: r["rank"])))
                        say(world, c, "FAIL" if bad else "PASS", max(r["s"] for r in rs), msg)
                        failed += bool(bad)
                        ended = ended or bool(bad)
                    elif not ended:  # the world ended inside this check without a word from it
                        left.remove(c)
                        tail = " | ".join(text.strip().splitlines()[-6:])
                        say(world, c, "FAIL", 0, f"launch rc {rc} during this check: {tail}")
                        failed, ended = failed + 1, True
                    else:
                        break  # relaunch with the checks not run yet
                for f in Path(out).glob(f"{world}.rank*.jsonl"):
                    f.unlink()
    total = time.monotonic() - start
    print(f"gpu_check: {len(todo)} checks, {failed} failed, {total:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
