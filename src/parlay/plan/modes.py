"""One training step of each mode, term by term (pure; see :mod:`parlay.plan.model`).

Every function returns ``{term: seconds}`` whose values add up to the predicted step time, so
the largest term is what a user should attack. Terms: ``compute`` (forward and backward),
``codec`` (compression's CPU work), ``copies`` (gradients into buckets or push buffers),
``comm`` / ``comm-intra`` / ``comm-inter`` (communication left exposed after overlapping
backward), ``push`` / ``pull`` / ``apply`` (parameter servers), ``bubble`` and
``activations`` (pipelines).

``diloco`` is priced per inner step: each replica computes alone, and one fragment of the model
(``1/P`` of it) is exchanged every ``H/P`` inner steps, so a step carries ``wire(model) / H``
bytes; an exchange may run behind ``tau`` inner steps (``overlap``) before it must be merged.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from parlay.errors import ConfigError
from parlay.compress import NoneCompressor
from parlay.plan.model import (DEFAULT_BUCKET_BYTES, ClusterSpec, Costs, Link, Workload,
                               allreduce_s, compressor_of, link_bytes, rounds_s, wire_rounds)
from parlay.plan.pipesim import pipeline_s

__all__ = ["allreduce_terms", "hierarchical_terms", "ps_terms", "hybrid_terms", "diloco_terms",
           "default_chunks", "diloco_h", "diloco_link_bytes", "exposed", "bottleneck_share",
           "stage_shares", "DILOCO_H", "DILOCO_TARGET"]

FORWARD_SHARE = 1.0 / 3.0   # forward ~ 1/3 of forward + backward (backward ~ 2x forward)
COPY_PASSES = 2  # gradient into the bucket (or push buffer), then averaged (or pulled back)
#: Inner steps per round ``diloco_h`` tries, smallest first, and the utilisation it looks for.
DILOCO_H = (10, 25, 50, 100, 250, 500)
DILOCO_TARGET = 0.9


def exposed(comm_s: float, backward_s: float, buckets: int, overlap: float) -> float:
    """Communication left after hiding it behind backward.

    Buckets launch as backward fills them, so at best everything but the last bucket's
    reduction hides behind the backward that follows the first bucket (DDP's and Horovod's
    overlap); ``overlap`` scales how much of that the machine achieves.
    """
    if comm_s <= 0:
        return 0.0
    nb = max(1, buckets)
    ideal = max(comm_s / nb, comm_s - backward_s * (nb - 1) / nb)
    return comm_s - overlap * (comm_s - ideal)


def stage_shares(layer_costs: Sequence[float] | None, stages: int) -> list[float]:
    """Each stage's share of the total cost when ``layer_costs`` are cut into ``stages``
    contiguous runs making the largest as small as possible (parlay's balance); equal shares
    when the costs are unknown or fewer than the stages."""
    c = [max(0.0, float(x)) for x in (layer_costs or ())]
    total, n = sum(c), len(c)
    if stages <= 1 or n < stages or total <= 0:
        return [1.0 / max(1, stages)] * max(1, stages)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    # best[s][i]: the smallest bottleneck of the first i layers cut into s runs; cut: where
    # the last of those runs starts
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    shares, i = [], n
    for s in range(stages, 0, -1):
        shares.append((prefix[i] - prefix[cut[s][i]]) / total)
        i = cut[s][i]
    return shares[::-1]


def bottleneck_share(layer_costs: Sequence[float] | None, stages: int) -> float:
    """The costliest stage's share of the total (see :func:`stage_shares`)."""
    return max(stage_shares(layer_costs, stages))


def _buckets(w: Workload, bucket_bytes: float) -> int:
    return max(1, math.ceil(w.grad_bytes / bucket_bytes))


def _split_compute(w: Workload, codec: float, costs: Costs | None = None) -> dict[str, float]:
    """compute, codec and (with ``costs``) copies: the gradient copied into a bucket or push
    buffer and one more pass over it (the bucket's average; a server's pulled parameters)."""
    terms = {"compute": w.compute_s}
    if codec:
        terms["codec"] = codec
    if costs is not None and costs.copy_s_per_byte:
        terms["copies"] = _copies_s(w, costs)
    return terms


def _copies_s(w: Workload, costs: Costs) -> float:
    return COPY_PASSES * w.grad_bytes * costs.copy_s_per_byte


def allreduce_terms(w: Workload, c: ClusterSpec, compressor: str, costs: Costs,
                    bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Flat ring allreduce (``DistributedOptimizer``): buckets overlap backward.

    The ring over ranks numbered host by host crosses each host link once per direction, so
    the slowest edge is the host link whenever there are several hosts.
    """
    comp = compressor_of(compressor)
    n = c.world
    link = c.inter if c.nodes > 1 else c.local
    nb = _buckets(w, bucket_bytes)
    rounds = wire_rounds(comp, w.params, n, w.layout, w.bytes_per_element, bucket_bytes)
    comm = rounds_s(rounds, n, link, costs, messages=nb, rested_s=w.compute_s)
    terms = _split_compute(w, comp.codec_s(w.params, n, costs) if n > 1 else 0.0,
                           costs if n > 1 else None)
    terms["comm"] = exposed(comm, w.compute_s * (1 - FORWARD_SHARE), nb, c.overlap)
    return terms


def hierarchical_terms(w: Workload, c: ClusterSpec, compressor: str, costs: Costs,
                       bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Allreduce inside each host, allreduce of one shard per local rank across hosts (the
    rings sharing the host link), allreduce inside the host again to share the shards
    (:mod:`parlay.dp.hierarchical`).

    Raises:
        ConfigError: A compressor that is not summable (top-k allgathers instead).
    """
    comp = compressor_of(compressor)
    if not comp.summable:
        raise ConfigError(f"hierarchical allreduce needs a summable compressor; {comp!r} is "
                          "allgathered. Hint: use the flat ring, or none, fp16, bf16, randomk "
                          "or powersgd.")
    n, loc = c.nodes, c.ranks_per_node
    nb = _buckets(w, bucket_bytes)
    rounds = wire_rounds(comp, w.params, c.world, w.layout, w.bytes_per_element, bucket_bytes)
    payload = sum(r.nbytes for r in rounds)
    # steps 1 and 3 are each an allreduce of the whole payload among the host's ranks
    intra = 2 * allreduce_s(payload, loc, c.local, costs.alpha_s * nb)
    # l parallel rings of payload/l each: together 2(n-1)/n of the payload on the host link
    inter = (rounds_s(rounds, n, c.inter, costs, messages=nb, rested_s=w.compute_s)
             if n > 1 else 0.0)
    terms = _split_compute(w, comp.codec_s(w.params, c.world, costs) if c.world > 1 else 0.0,
                           costs if c.world > 1 else None)
    total = intra + inter
    left = exposed(total, w.compute_s * (1 - FORWARD_SHARE), nb, c.overlap)
    if total > 0:
        terms["comm-intra"] = left * intra / total
        terms["comm-inter"] = left * inter / total
    return terms


def ps_terms(w: Workload, c: ClusterSpec, compressor: str, costs: Costs,
             consistency: str = "sync", servers: int | None = None,
             server_link: Link | None = None, chunk_bytes: float = 0.0) -> dict[str, float]:
    """Sharded parameter servers: each worker pushes its (compressed) gradient split over the
    servers and pulls the dense parameters back (:mod:`parlay.ps`).

    ``sync`` pushes, waits until every worker's push has arrived, then pulls: two transfers in
    sequence, each bounded by the busier of a worker's link (one model) and a server's link
    (``workers / servers`` models). ``async`` and ``stale`` (with equal workers the staleness
    bound rarely binds) run workers independently: a worker's own push-then-pull chain, or the
    servers' links if all workers together keep them busier. With ``chunk_bytes`` (``sync``,
    dense pushes: parlay's pipelined pushes, ``PARLAY_PS_CHUNK_BYTES``) each server returns a
    chunk as soon as every worker's copy of it is in, so pulls overlap pushes and only the
    last chunk's return and update follow the longer of the two (on a network link: on one
    machine both directions are the same cores' copies).

    Raises:
        ConfigError: PowerSGD (it needs collective rounds) or an unknown consistency.
    """
    comp = compressor_of(compressor)
    if not comp.point_to_point:
        raise ConfigError(f"{comp!r} needs collective rounds, so parameter-server pushes "
                          "cannot use it. Hint: topk, randomk or fp16.")
    mode = consistency.split(":")[0]
    if mode not in ("sync", "async", "stale"):
        raise ConfigError(f"consistency must be sync, async or stale:s, got {consistency!r}.")
    nw = c.world
    ns = servers or c.nodes
    if ns < 1:
        raise ConfigError(f"servers must be >= 1, got {ns}.")
    slink = server_link or c.inter
    wlink = c.inter if c.nodes > 1 or server_link is not None else c.local
    push_b = sum(r.nbytes for r in comp.wire_rounds(int(w.params), w.shapes,
                                                    w.bytes_per_element))
    pull_b = w.grad_bytes
    # Several senders converging on one link overflow its queue: TCP incast. Every worker's
    # push lands on a server at once (sync workers leave their barrier together), so the
    # pushes overrun the queue once together they exceed it (measured: docs/benchmarks.md,
    # "Design measurements"). The servers' replies to a worker go out as each push (or chunk)
    # is served, staggered, and overrun it only when each is larger than the queue.
    into_server = _incast(nw, push_b / ns, slink, costs, together=True)
    into_worker = _incast(ns, pull_b / ns, wlink, costs)
    msgs = costs.ps_request_s + ns * wlink.latency_s
    push_w, pull_w = push_b * wlink.beta, pull_b * wlink.beta / into_worker
    push = max(push_w, nw * push_b / ns * slink.beta / into_server) + msgs
    pull = max(pull_w, nw * pull_b / ns * slink.beta) + msgs
    dense = isinstance(comp, NoneCompressor)
    enc = 0.0 if dense else comp.codec_s(w.params, 1, costs)
    apply = w.params / ns * (costs.apply_s_per_elem + nw * costs.sum_s_per_elem)
    terms = _split_compute(w, enc, costs)
    if mode == "sync":
        # On one machine (the measured loopback, efficiency 1) both directions are copies on
        # the same shared cores: chunks cannot overlap them.
        piped = chunk_bytes and dense and wlink.efficiency < 1.0
        chunks = math.ceil(pull_b / ns / chunk_bytes) if piped else 1
        terms.update(_sync_terms(push, pull, apply, chunks))
        return terms
    # Workers drift apart: one's push into a server meets another's pull out of it, the two
    # directions of a full-duplex link, so a worker's own chain pays no incast (measured
    # throughput beat the prediction with it: docs/benchmarks.md, "Design measurements"); the
    # servers' links still bound all workers together below.
    own = sum(terms.values()) + push_w + pull_w + 2 * msgs + apply
    servers_busy = nw * max(push_b / into_server, pull_b) / ns * slink.beta
    terms.update(push=push_w + msgs, apply=apply, pull=pull_w + msgs)
    if servers_busy > own:
        terms["server-links"] = servers_busy - own
    return terms


def _sync_terms(push: float, pull: float, apply: float, chunks: int) -> dict[str, float]:
    """Push, apply, pull of a sync step; in ``chunks`` pipelined chunks both directions are
    busy at once and only the last chunk's update and return follow the longer one."""
    if chunks <= 1:
        return {"push": push, "apply": apply, "pull": pull}
    last = min(push, pull) / chunks
    return {"push": push, "apply": apply / chunks, "pull": max(0.0, pull - push) + last}


def _incast(senders: int, per_sender_bytes: float, link: Link, costs: Costs,
            together: bool = False) -> float:
    """Efficiency left on ``link`` when ``senders`` send ``per_sender_bytes`` each into it:
    the queue overflows when one sender's bytes exceed it, or (``together``: they all start
    at once) when their bytes together do."""
    if senders <= 1 or math.isinf(link.bandwidth_bps):
        return 1.0
    queue_bytes = link.bandwidth_bps / 8 * costs.queue_s
    burst = per_sender_bytes * (senders if together else 1)
    return costs.incast_efficiency if burst > queue_bytes else 1.0


def _pipeline_terms(compute_s: float, p: int, m: int, transfer: float, schedule: str,
                    layer_costs: Sequence[float] | None,
                    shaper: tuple[float, float, float] | None = None
                    ) -> tuple[dict[str, float], float]:
    """compute, bubble and activations of one pipeline replica, and its slowest slot.

    Replayed op by op: unequal stages and transfers slower than a micro-batch change the
    pace, not only the fill and drain (GPipe sends its m activations, then its m gradients;
    1F1B interleaves them, so the two directions of a link carry them at once).
    """
    # one micro-batch on each stage: forward + backward
    slots = [compute_s * share * p / m for share in stage_shares(layer_costs, p)]
    slot = max(slots)
    fwd = [x * FORWARD_SHARE for x in slots]
    bwd = [x * (1 - FORWARD_SHARE) for x in slots]
    free = pipeline_s(fwd, bwd, m, 0.0, schedule)
    return {"compute": m * slot, "bubble": max(0.0, free - m * slot),
            "activations": max(0.0, pipeline_s(fwd, bwd, m, transfer, schedule, shaper)
                               - free)}, slot


def default_chunks(w: Workload, stages: int) -> int:
    """Micro-batches per step priced when none are given: the Trainer's 4 per stage, at most
    one sample each (a replica's batch is ``batch x stages``)."""
    return min(w.batch * stages, 4 * stages)


def hybrid_terms(w: Workload, c: ClusterSpec, compressor: str, costs: Costs, stages: int = 2,
                 chunks: int | None = None, schedule: str = "1f1b",
                 bucket_bytes: float = DEFAULT_BUCKET_BYTES,
                 layer_costs: Sequence[float] | None = None,
                 transfer_s: float | None = None) -> dict[str, float]:
    """``stages`` pipeline stages x ``world / stages`` replicas over the same global batch.

    The step is replayed op by op (:func:`parlay.plan.pipesim.pipeline_s`): with equal
    stages and free links GPipe and 1F1B leave the same bubble, ``(p-1)/(m+p-1)`` of the
    pipeline's time; transfers between stages (one activation or its gradient per
    micro-batch, plus ``pipe_op_s``) add what they cannot hide. With ``layer_costs`` (compute
    per layer, e.g. parameters: how parlay balances stages by default) each stage gets its
    share, and the slowest sets the pace. Each stage averages its ``1/p`` of the gradients
    over its replicas after the drain. A replica's stages share a host when they fit
    (parlay's default placement). ``transfer_s`` (measured: one activation between two
    stages, software costs included) replaces the link's estimate; on a link with a burst
    (a token-bucket shaper) it is a transfer's cost besides the shaper's pacing, which the
    replay adds.

    Raises:
        ConfigError: More stages than layers or ranks, ranks not a multiple of stages, more
            micro-batches than samples per replica.
    """
    p, world = int(stages), c.world
    if p < 1 or world % p:
        raise ConfigError(f"hybrid with {p} stages needs a rank count that is a multiple of "
                          f"{p}, got {world} ranks. Hint: stages dividing {world}.")
    if w.layers is not None and p > w.layers:
        raise ConfigError(f"{p} pipeline stages need at least {p} layers, the model has "
                          f"{w.layers} layers. Hint: --stages {w.layers} or fewer.")
    if schedule not in ("gpipe", "1f1b"):
        raise ConfigError(f"the cost model covers schedules gpipe and 1f1b, got {schedule!r}.")
    replicas = world // p
    per_replica = w.batch * p            # the same global batch, over fewer replicas
    m = int(chunks or default_chunks(w, p))
    if m < 1 or m > per_replica:
        raise ConfigError(f"{m} micro-batches need at least {m} samples per pipeline, got "
                          f"{per_replica} (batch {w.batch} x {p} stages). Hint: --chunks "
                          f"{default_chunks(w, p)}.")
    comp = compressor_of(compressor)
    loc = c.ranks_per_node
    pp_local = loc % p == 0 or c.nodes == 1
    act_link = c.local if pp_local else c.inter
    act_bytes = w.act_numel * per_replica / m * w.bytes_per_element
    transfer = costs.pipe_op_s + act_link.transfer_s(act_bytes) if p > 1 else 0.0
    shaper = None
    if act_link.burst_bytes and p > 1:  # the shaper paces the bytes; the rest is per message
        shaper = (act_bytes, act_link.bandwidth_bps * act_link.efficiency / 8,
                  act_link.burst_bytes)
        transfer = costs.pipe_op_s + act_link.latency_s
    if transfer_s is not None and p > 1:
        transfer = float(transfer_s)
    terms, slot = _pipeline_terms(w.compute_s, p, m, transfer, schedule, layer_costs, shaper)
    if replicas > 1:
        stage = Workload(w.params / p, w.batch, w.compute_s_per_sample,
                         shapes=w.stage_layout(p), bytes_per_element=w.bytes_per_element)
        spans = c.nodes > 1 and (not pp_local or replicas > loc // p)
        link = c.inter if spans else c.local
        rings = p if pp_local else loc  # rings sharing one host link
        nb = _buckets(stage, bucket_bytes)
        rounds = wire_rounds(comp, stage.params, replicas, stage.shapes, w.bytes_per_element,
                             bucket_bytes)
        comm = rounds_s(rounds, replicas, link, costs, nb, rested_s=terms["compute"])
        comm *= rings if spans else 1
        terms["codec"] = comp.codec_s(stage.params, replicas, costs)
        terms["copies"] = _copies_s(stage, costs)
        terms["comm"] = exposed(comm, slot * (1 - FORWARD_SHARE), nb, c.overlap)
    return {k: v for k, v in terms.items() if v or k == "compute"}


def _diloco_check(sync_every: int, fragments: int, overlap: int) -> None:
    """The bounds ``DiLoCoOptimizer`` puts on ``H``, ``P`` and ``tau``."""
    if sync_every < 1 or not 1 <= fragments <= sync_every:
        raise ConfigError(f"diloco needs sync_every >= 1 and 1 <= fragments <= sync_every, got "
                          f"sync_every={sync_every}, fragments={fragments}.")
    if not 0 <= overlap * fragments < sync_every:
        raise ConfigError(f"diloco overlap must be in [0, sync_every / fragments) = [0, "
                          f"{sync_every / fragments:g}), got {overlap}. Hint: a larger "
                          "sync_every or fewer fragments.")


def diloco_terms(w: Workload, c: ClusterSpec, compressor: str, costs: Costs,
                 sync_every: int | None = None, fragments: int = 1,
                 overlap: int = 0) -> dict[str, float]:
    """One inner step of local-update data parallel (:class:`parlay.DiLoCoOptimizer`).

    A fragment (``1/fragments`` of the model) is reduced every ``sync_every / fragments``
    inner steps over the flat ring of every rank; the ``overlap`` inner steps after it starts
    hide that much of it, the rest is exposed and spread over the steps between exchanges. The
    pseudo-gradient and the outer step are two passes over the model per round (``copies``).
    ``sync_every=None`` prices the smallest of :data:`DILOCO_H` that :func:`diloco_h` picks.

    Raises:
        ConfigError: ``sync_every``, ``fragments`` or ``overlap`` out of the optimizer's bounds.
    """
    h = diloco_h(w, c, compressor, costs, fragments, overlap) if sync_every is None \
        else int(sync_every)
    _diloco_check(h, int(fragments), int(overlap))
    if w.shapes is not None and fragments > len(w.shapes):  # as DiLoCoOptimizer refuses it
        raise ConfigError(f"diloco fragments={fragments} needs at least as many parameter "
                          f"tensors; the model has {len(w.shapes)}. Hint: --diloco-fragments "
                          f"{len(w.shapes)} or fewer.")
    terms = {"compute": w.compute_s}
    if c.world <= 1:
        return terms
    comp = compressor_of(compressor)
    every = h / fragments  # inner steps between two exchanges
    frag = w.params / fragments
    one = rounds_s(wire_rounds(comp, frag, c.world, None, w.bytes_per_element), c.world,
                   c.inter if c.nodes > 1 else c.local, costs, rested_s=w.compute_s * every)
    terms["codec"] = comp.codec_s(frag, c.world, costs) / every
    terms["copies"] = _copies_s(w, costs) / h
    # (tau < H/P, so an exposed exchange also keeps the link's pace: one fragment per H/P steps)
    terms["comm"] = max(0.0, one - overlap * w.compute_s) / every
    return {k: v for k, v in terms.items() if v or k == "compute"}


def diloco_h(w: Workload, c: ClusterSpec, compressor: str, costs: Costs, fragments: int = 1,
             overlap: int = 0, choices: Sequence[int] = DILOCO_H,
             target: float = DILOCO_TARGET) -> int:
    """The smallest ``H`` of ``choices`` (that takes these fragments and overlap) whose
    predicted compute utilisation (compute / step) reaches ``target``; the largest otherwise.

    Raises:
        ConfigError: No choice takes ``fragments`` and ``overlap``.
    """
    ok = [h for h in sorted(choices) if fragments <= h and 0 <= overlap * fragments < h]
    if not ok:
        raise ConfigError(f"no sync_every of {tuple(choices)} takes fragments={fragments} and "
                          f"overlap={overlap}. Hint: fewer fragments or a smaller overlap.")
    for h in ok:
        terms = diloco_terms(w, c, compressor, costs, h, fragments, overlap)
        if terms["compute"] >= target * sum(terms.values()):
            return h
    return ok[-1]


def diloco_link_bytes(w: Workload, c: ClusterSpec, compressor: str, sync_every: int,
                      fragments: int = 1) -> float:
    """Bytes one rank sends over its link per inner step: ``P wire(model / P) / H`` (the
    ``P`` fragments of a round, each reduced in one piece, together carry the model once)."""
    return fragments * link_bytes(compressor, w.params / fragments, c.world) / sync_every
