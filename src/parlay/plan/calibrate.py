"""Measure this machine's constants for the cost model, once, and cache them.

:func:`calibrate` runs three microbenchmarks (a few seconds in all):

* two local gloo processes on loopback (:func:`parlay.testing.run_world`) time allreduces of a
  tiny and a large fp32 buffer (alpha: the per-step software cost; beta: loopback bandwidth,
  with the ring's local sums included) and of a large fp16 buffer (gloo sums half precision
  element by element in software, far slower than fp32);
* every compressor encodes and decodes a gradient in this process (per-element costs);
* a matrix multiply gives the CPU's FLOP rate (the compute estimate when none is given) and
  an SGD update the parameter servers' per-element cost.

Results are cached as JSON in ``$PARLAY_CACHE_DIR`` (default ``~/.cache/parlay``) under
``plan-<hash>.json``, the hash covering torch's version, the CPU count and the host name, so a
different machine or torch never reuses them. :func:`load_costs` reads the cache (calibrating
when it is missing).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import socket
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parlay.plan.model import Costs, Link

__all__ = ["Calibration", "calibrate", "load_costs", "cache_path", "local_overlap",
           "codec_timer", "retime_codecs"]

_VERSION = 2  # bump when what is measured changes: older caches are re-measured


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured.

    Attributes:
        costs: Constants for :func:`parlay.plan.predict`.
        loopback: Two local processes' link (gloo over loopback), payload goodput.
        flops: Single-thread fp32 matrix-multiply rate, FLOP/s.
        seconds: Time the calibration took.
        links_measured: False when the loopback link was not measured (defaults kept).
    """

    costs: Costs
    loopback: Link
    flops: float
    seconds: float = 0.0
    links_measured: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"version": _VERSION, "costs": dataclasses.asdict(self.costs),
                "loopback": {"bandwidth_bps": self.loopback.bandwidth_bps,
                             "latency_s": self.loopback.latency_s},
                "flops": self.flops, "seconds": self.seconds,
                "links_measured": self.links_measured}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Calibration:
        known = {f.name for f in dataclasses.fields(Costs)}
        costs = Costs(**{k: float(v) for k, v in doc["costs"].items() if k in known})
        lb = doc["loopback"]
        return cls(costs, Link(float(lb["bandwidth_bps"]), float(lb["latency_s"]), 1.0),
                   float(doc["flops"]), float(doc.get("seconds", 0.0)),
                   bool(doc.get("links_measured", True)))


def cache_path() -> Path:
    """Where this machine's calibration is cached (``$PARLAY_CACHE_DIR`` overrides the
    folder)."""
    import torch

    key = f"{torch.__version__}|{os.cpu_count()}|{socket.gethostname()}|{platform.machine()}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = os.environ.get("PARLAY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "parlay")
    return Path(folder) / f"plan-{digest}.json"


def local_overlap(ranks_on_machine: int, cpu_count: int | None = None) -> float:
    """``ClusterSpec.overlap`` for CPU ranks on this machine: 1.0 when a core is left for
    communication, else 0.0 (communication then waits for compute)."""
    cores = cpu_count or os.cpu_count() or 1
    return 1.0 if cores > ranks_on_machine else 0.0


def _typical(fn: Callable[[], Any], repeats: int, budget_s: float) -> float:
    """Median of up to ``repeats`` timed calls, stopping early past ``budget_s``.

    The median, not the minimum: on a shared machine the minimum is the rare moment the
    process had a core to itself, while training steps pay the typical cost.
    """
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def _link_rank(numel: int, repeats: int, budget_s: float) -> dict[str, float]:
    """Runs on each of two gloo ranks: time tiny, large fp32 and large fp16 allreduces, then
    the compressors and CPU costs, with both ranks busy at once (as in training)."""
    import torch
    import torch.distributed as dist

    def timed(t: torch.Tensor) -> float:
        dist.all_reduce(t)  # warm-up (connection, buffers)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = {"tiny": timed(torch.ones(1)), "f32": timed(torch.ones(numel)),
           "f16": timed(torch.ones(numel, dtype=torch.float16))}
    dist.barrier()
    out.update(_codec_costs(numel, repeats, budget_s * 0.7))
    out.update(_cpu_costs(numel, repeats, budget_s * 0.3))
    return out


def _measure_link(numel: int, repeats: int, budget_s: float) -> dict[str, float]:
    """Costs fields, loopback bytes/s and FLOP/s from two local gloo ranks."""
    from parlay.testing import run_world

    res = run_world(_link_rank, 2, numel, repeats, budget_s, timeout=180, threads=1)
    t = {k: max(r[k] for r in res) for k in res[0]}  # the slower rank sets the pace
    t["flops"] = min(r["flops"] for r in res)
    out = {k: v for k, v in t.items() if k not in ("tiny", "f32", "f16")}
    out["alpha_s"] = t["tiny"] / 2             # 2 ring steps of n = 2
    # 2 ranks: each sends half the buffer twice (reduce-scatter, allgather) and sums a half
    per_byte = max(t["f32"] - t["tiny"], 1e-9) / (numel * 4)
    out["loopback_bps"] = 8.0 / per_byte
    half_extra = max(0.0, t["f16"] - t["tiny"] - per_byte * numel * 2)
    out["half_sum_s_per_elem"] = half_extra / (numel / 2)
    return out


def codec_timer(spec: str, shapes: Sequence[Sequence[int]], world: int = 2,
                grad: Any = None) -> Callable[[], None]:
    """A callable doing one encode and decode of a gradient bucket with compressor ``spec``:
    what one rank's step spends on compression (run once here, so the first call is warm).

    Args:
        spec: A compression string (``"topk:0.01"``).
        shapes: The bucket's parameter shapes (PowerSGD factors each matrix).
        world: Ranks whose payloads a non-summable compressor aggregates.
        grad: The flat gradient to encode (default: random, of the shapes' size).
    """
    import math

    import torch

    from parlay.compress.base import get_compressor
    from parlay.compress.reduce import local_round_trip

    g = grad if grad is not None else torch.randn(sum(math.prod(s) for s in shapes))
    comp = get_compressor(spec)
    comp.set_layout("b", [tuple(s) for s in shapes])

    scratch = torch.empty_like(g)  # decoded into, as the optimizer's bucket is

    def once() -> None:
        local_round_trip(comp, g, "b", world, into=scratch)
    once()
    return once


def retime_codecs(costs: Costs, shapes: Sequence[Sequence[int]], compressors: Sequence[str],
                  world: int = 2, sample_numel: int = 1 << 22, repeats: int = 3) -> Costs:
    """``costs`` with each compressor's encode and decode re-timed now, on this model's own
    parameter shapes (up to ``sample_numel`` elements of them: the cost is per element), so
    the machine's load at this moment, not at calibration, sets the codec terms.

    Args:
        costs: Constants to update (see :func:`parlay.plan.insitu.with_codec_time`).
        shapes: The model's parameter shapes.
        compressors: Compression strings; those without a codec cost (``none``) are skipped,
            and so is a second one priced by the same constant (``bf16`` after ``fp16``).
        world: Ranks whose payloads top-k aggregates.
        sample_numel: Most elements timed.
        repeats: Timed runs each (the median counts).
    """
    import math

    from parlay.plan.insitu import with_codec_time
    from parlay.plan.model import compressor_of

    sample: list[Sequence[int]] = []
    for s in shapes:
        if sum(math.prod(x) for x in sample) + math.prod(s) > sample_numel and sample:
            break
        sample.append(s)
    numel = sum(math.prod(x) for x in sample)
    if not numel:
        return costs
    seen: set[str] = set()
    for spec in compressors:
        fields = compressor_of(spec).cost_fields
        if not fields or fields[0] in seen:  # (fp16 and bf16 share one constant)
            continue
        seen.add(fields[0])
        t = _typical(codec_timer(spec, sample, world), repeats, 2.0)
        costs = with_codec_time(costs, spec, numel, world, t)
    return costs


def _codec_costs(numel: int, repeats: int, budget_s: float) -> dict[str, float]:
    """Per-element encode + decode costs of every compressor, timed in this process."""
    import torch

    side = max(8, int((numel // 4) ** 0.5))
    shapes = [(side, side)] * 4
    n = side * side * 4
    g = torch.randn(n)
    each = budget_s / 6
    t = {s: _typical(codec_timer(s, shapes, 2, g), repeats, each)
         for s in ("fp16", "topk:0.01", "randomk:0.01", "powersgd:1", "powersgd:8")}
    vals = torch.randn(max(1, n // 100))
    idx = torch.randint(n, vals.shape)
    out = torch.zeros(n)
    scatter = _typical(lambda: out.scatter_add_(0, idx, vals), repeats, each) / vals.numel()
    p1, p8 = t["powersgd:1"] / n, t["powersgd:8"] / n
    per_rank = max(0.0, (p8 - p1) / 7)
    return {"cast_s_per_elem": t["fp16"] / n, "topk_s_per_elem": t["topk:0.01"] / n,
            "scatter_s_per_elem": scatter, "randomk_s_per_elem": t["randomk:0.01"] / n,
            "powersgd_s_per_elem": max(0.0, p1 - per_rank),
            "powersgd_s_per_elem_rank": per_rank}


def _cpu_costs(numel: int, repeats: int, budget_s: float) -> dict[str, float]:
    """FLOP/s of a single-thread matmul, SGD update s/elem, fp32 sum s/elem, copy s/byte."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256)
        mm = _typical(lambda: a @ a, repeats * 4, budget_s / 4)
        p, d = torch.zeros(numel), torch.randn(numel)
        apply = _typical(lambda: p.add_(d, alpha=-0.1), repeats, budget_s / 4) / numel
        acc = torch.zeros(numel)
        add = _typical(lambda: acc.add_(d), repeats, budget_s / 4) / numel
        copy = _typical(lambda: acc.copy_(d), repeats, budget_s / 4) / (4 * numel)
    finally:
        torch.set_num_threads(threads)
    return {"flops": 2 * 256 ** 3 / mm, "apply_s_per_elem": apply, "sum_s_per_elem": add,
            "copy_s_per_byte": copy}


def calibrate(budget_s: float = 4.0, links: bool = True, numel: int = 1 << 22,
              save: bool = True) -> Calibration:
    """Measure this machine's constants (see the module docstring) and cache them.

    Args:
        budget_s: Rough time allowed for the timings (starting the two processes adds a
            second or two).
        links: Measure with two gloo processes on loopback, both busy at once as ranks are
            in training (else one process times the compressors and the link keeps its
            default).
        numel: Elements of the buffers timed (smaller is faster and noisier).
        save: Write the cache file.

    Returns:
        The calibration (also written to :func:`cache_path` when ``save``).
    """
    t0 = time.perf_counter()
    repeats = 5 if budget_s >= 1 else 1
    loop = Link(20e9, 0.0, 1.0)
    if links:
        fields = _measure_link(numel, repeats, budget_s)
        loop = Link(fields.pop("loopback_bps"), 0.0, 1.0)
    else:
        fields = _codec_costs(numel, repeats, budget_s * 0.7)
        fields.update(_cpu_costs(numel, repeats, budget_s * 0.3))
    flops = fields.pop("flops")
    costs = dataclasses.replace(Costs(), **fields)
    cal = Calibration(costs, loop, flops, time.perf_counter() - t0, links)
    if save:
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cal.to_json(), indent=1))
            os.replace(tmp, path)
        except OSError as e:  # measured all the same: the plan goes on, uncached
            warnings.warn(f"cannot cache the calibration in {path.parent} ({e}); it is measured "
                          "again next time. Hint: PARLAY_CACHE_DIR=<a writable folder>.",
                          stacklevel=2)
    return cal


def load_costs(calibrate_if_missing: bool = True, **kwargs: Any) -> Calibration | None:
    """This machine's cached calibration; calibrate now if there is none (and allowed).

    Returns:
        The calibration, or ``None`` when none is cached and ``calibrate_if_missing`` is off.
    """
    path = cache_path()
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") == _VERSION:
            return Calibration.from_json(doc)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return calibrate(**kwargs) if calibrate_if_missing else None
