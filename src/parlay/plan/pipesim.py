"""One pipeline step, replayed op by op (pure): how long GPipe or 1F1B takes when stages
differ in cost and every activation and gradient crosses a link that takes time.

The closed form ``(m + p - 1)`` slots holds for equal stages and free links. Neither holds on
a real cluster: parameter-balanced stages differ in compute, and on a slow link a transfer
can take longer than the micro-batch that produced it, so the link, not the stages, sets the
pace. The replay follows ``torch.distributed.pipelining``'s schedules over gloo: each stage
runs its ops in order and waits for an op's input; a transfer starts when its producer is
done and its receiver has posted the receive (one at a time per link and direction).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["stage_order", "pipeline_s"]


def stage_order(schedule: str, stage: int, stages: int, chunks: int) -> list[tuple[str, int]]:
    """The ops one stage runs, in order: ``("F", i)`` forward and ``("B", i)`` backward of
    micro-batch ``i``. GPipe: every forward, then every backward. 1F1B: ``stages - stage``
    forwards, then one backward and one forward in turn, then the remaining backwards."""
    if schedule == "gpipe":
        return [("F", i) for i in range(chunks)] + [("B", i) for i in range(chunks)]
    warm = min(chunks, stages - stage)
    order = [("F", i) for i in range(warm)]
    for i in range(chunks):
        order.append(("B", i))
        if warm + i < chunks:
            order.append(("F", warm + i))
    return order


def _input_ready(kind: str, s: int, i: int, p: int, st: dict[str, Any]) -> float | None:
    """When op (kind, s, i) can start computing, or ``None`` while a producer has not run.
    A transfer starts once its producer is done, its receiver is waiting for it (gloo sends
    a message when the other side has posted the matching receive) and the link is free."""
    if kind == "F" and s == 0:
        return 0.0
    if kind == "B" and s == st["p"] - 1:
        done: float | None = st["done"].get(("F", s, i))
        return done
    src = s - 1 if kind == "F" else s + 1
    sent = st["done"].get((kind, src, i))
    if sent is None:
        return None
    key = (kind, min(s, src))
    start = max(sent, st["free"][s], st["link"].get(key, 0.0))
    end = start + st["t"] + _token_wait(st, key, start)
    st["link"][key] = end
    st["arrive"][(kind, s, i)] = end
    return float(end)


def _token_wait(st: dict[str, Any], key: tuple[Any, ...], start: float) -> float:
    """Extra seconds a message starting at ``start`` waits for a token-bucket shaper on its
    link and direction (0 without one): the bucket refills at the rate while the link rests
    and holds at most the burst."""
    if st["tb"] is None:
        return 0.0
    size, rate, burst = st["tb"]
    have, since = st["tokens"].get(key, (burst, start))
    have = min(burst, have + (start - since) * rate)
    wait = max(0.0, size - have) / rate
    st["tokens"][key] = (0.0, start + wait) if wait else (have - size, start)
    return float(wait)


def pipeline_s(fwd: Sequence[float], bwd: Sequence[float], chunks: int, transfer_s: float,
               schedule: str = "1f1b",
               shaper: tuple[float, float, float] | None = None) -> float:
    """Seconds for one step of ``len(fwd)`` stages over ``chunks`` micro-batches.

    Args:
        fwd: Forward time of one micro-batch on each stage.
        bwd: Backward time of one micro-batch on each stage.
        chunks: Micro-batches.
        transfer_s: One activation (or its gradient) from one stage to the next.
        schedule: ``"gpipe"`` or ``"1f1b"`` (whose backward also waits until the forward
            sent just before it has arrived: torch posts them as one batch).
        shaper: ``(message bytes, bytes/s, burst bytes)`` of a token-bucket shaped link
            (each direction its own bucket, full at the start): a message also waits for
            the tokens it lacks. ``transfer_s`` is then the rest of a transfer's cost.
    """
    p = len(fwd)
    orders = [stage_order(schedule, s, p, chunks) for s in range(p)]
    nxt = [0] * p
    st: dict[str, Any] = {"p": p, "t": transfer_s, "free": [0.0] * p, "done": {}, "arrive": {},
                "link": {}, "tb": shaper, "tokens": {}}
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for s in range(p):
            if nxt[s] >= len(orders[s]):
                continue
            kind, i = orders[s][nxt[s]]
            wait = 0.0
            if schedule == "1f1b" and kind == "B" and s < p - 1 and nxt[s] > 0:
                prev = orders[s][nxt[s] - 1]
                if prev[0] == "F":  # the fused send: its receiver must have taken it
                    got = st["arrive"].get(("F", s + 1, prev[1]))
                    if got is None:
                        continue
                    wait = got
            ready = st["arrive"].get((kind, s, i))
            if ready is None:
                ready = _input_ready(kind, s, i, p, st)
            if ready is None:
                continue
            end = max(st["free"][s], ready, wait) + (fwd[s] if kind == "F" else bwd[s])
            st["free"][s] = st["done"][(kind, s, i)] = end
            nxt[s] += 1
            left -= 1
            progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocked (a bug in stage_order)")
    return float(max(st["free"]))
