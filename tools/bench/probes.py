"""What :mod:`tools.bench.worker` times next to each measured step, so the cost model
predicts from the machine's state at that moment rather than from a calibration cached at
another time and load: the contestant's compressor encoding and decoding a gradient of the
model's shapes, an activation-sized message between pipeline stages, and (ranks on one
machine, where the "link" is CPU work) a tiny and a gradient-sized allreduce. None of them
is the step itself: a point's own step time never feeds its prediction.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

from tools.bench.harness import MODELS, model_params

__all__ = ["timed_next_to", "codec_spec", "ps_exchange", "spec_widths"]


def spec_widths(spec: dict[str, Any]) -> tuple[list[int], int]:
    """(layer widths, per-rank batch) of a worker spec's model: a MODELS name or widths."""
    m = spec.get("model", "suite")
    widths, batch = MODELS[m] if isinstance(m, str) else (list(m), 0)
    return widths, int(spec.get("batch") or batch)


_UNCOMPRESSED = ("compute", "ddp", "none", "parlay", "flat", "hier")


def codec_spec(name: str, opt: Any) -> str | None:
    """The compressor whose encode/decode this contestant's step runs (auto: what it chose,
    when it chose one compressor for every bucket), or ``None``."""
    if name in _UNCOMPRESSED or name.startswith("pipe:"):
        return None
    if name == "auto":
        choices = set(getattr(opt.compression, "choices", {}).values()) if opt else set()
        name = choices.pop() if len(choices) == 1 else "none"
    return None if name == "none" else name


def timed_next_to(name: str, spec: dict[str, Any], opt: Any, cstep: Callable, x: Any,
            y: Any) -> dict[str, Callable]:
    """What to time next to each step of ``name``: its compute-only step, its compressor's
    encode and decode on a gradient of the model's shapes, a copy of the gradient, and
    (``probe_link``: ranks on one machine, where the link is CPU work) a tiny and a
    gradient-sized allreduce."""
    import torch
    import torch.distributed as dist

    from parlay.plan.calibrate import codec_timer

    widths, _ = spec_widths(spec)
    out: dict[str, Callable] = {"compute": lambda: cstep(x, y)}
    comp = codec_spec(name, opt)
    if comp is not None:
        shapes = [s for a, b in zip(widths[:-1], widths[1:]) for s in ([b, a], [b])]
        out["codec"] = codec_timer(comp, shapes[::-1], dist.get_world_size())
    if name.startswith("pipe:"):
        out["act"] = _act_ping(widths, spec)
    else:  # the gradient's copies into a bucket (memory bandwidth now)
        src = torch.ones(model_params(widths))
        dst = torch.empty_like(src)
        out["copy"] = lambda: dst.copy_(src)
    if spec.get("probe_link") and not name.startswith("pipe:"):
        tiny = torch.zeros(1)
        dense = torch.zeros(model_params(widths))
        dist.all_reduce(dense)  # warm: buffers of this size
        out["tiny"] = lambda: dist.all_reduce(tiny)
        out["dense"] = lambda: dist.all_reduce(dense)
        if comp in ("fp16", "bf16"):  # gloo sums half precision in software: its own cost
            half = dense.to(torch.float16 if comp == "fp16" else torch.bfloat16)
            out["half"] = lambda: dist.all_reduce(half)
    return out


def _act_ping(widths: list[int], spec: dict[str, Any]) -> Callable:
    """One activation-sized message to the neighbouring stage and back (ranks paired 0-1,
    2-3...): the stage-to-stage transfer a pipeline step waits for, timed on its link now."""
    import torch
    import torch.distributed as dist

    _, batch = spec_widths(spec)
    r, n = dist.get_rank(), dist.get_world_size()
    micro = max(1, batch * n // int(spec.get("chunks", 4)))
    buf = torch.zeros(micro * max(widths[1:-1], default=widths[-1]))
    peer = r + 1 if r % 2 == 0 else r - 1

    def ping() -> None:
        if peer >= n:
            return
        if r % 2 == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    ping()  # warm: the connection between this pair
    return ping


def ps_exchange(is_server: bool, params: int) -> Callable:
    """One dense push and one dense pull between every worker and every parameter server, all
    at once (an unchunked parameter-server step's traffic, without its requests): on one
    machine, where the "link" is CPU copies shared by every process, the rate the
    parameter-server terms should use now. Every rank of the launch calls it together."""
    import torch
    import torch.distributed as dist

    roles: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(roles, bool(is_server))
    servers = [r for r, s in enumerate(roles) if s]
    peers = [r for r, s in enumerate(roles) if s != is_server]
    bufs = [torch.zeros(max(1, params // max(1, len(servers)))) for _ in peers]

    def post(op: Callable) -> None:
        for w in [op(b, p) for b, p in zip(bufs, peers)]:
            w.wait()

    def exchange() -> None:
        post(dist.irecv if is_server else dist.isend)  # the pushes
        post(dist.isend if is_server else dist.irecv)  # the pulls
    exchange()  # warm: the connections between every worker and server
    return exchange
