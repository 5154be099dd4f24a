"""``DistributedOptimizer``'s checks: its arguments, which parameters it reduces (by name), that
every rank holds the same ones (integer tensors only: no pickled object crosses the network),
and the misuse refused later (at ``step()``, ``zero_grad()``)."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm
from parlay.errors import ConfigError
from parlay.reduce_ops import ReduceOp, reduce_op

__all__ = ["check_arguments", "check_passes", "named_parameters", "check_consistency",
           "check_still_frozen", "check_still_held", "check_untouched"]


def _check_op(op: Any) -> ReduceOp:
    rop = reduce_op(op)
    if rop == ReduceOp.Adasum:
        raise ConfigError("op=Adasum is not supported by parlay's DistributedOptimizer. "
                          "Hint: use op=parlay.Average (with the learning rate scaled "
                          "by parlay.size()), which is what Adasum approximates.")
    if rop not in (ReduceOp.Average, ReduceOp.Sum):
        raise ConfigError(f"DistributedOptimizer supports op=Average or Sum, got {rop.name}.")
    return rop


def check_passes(passes: Any) -> int:
    """``backward_passes_per_step`` as an int >= 1, or a :class:`ConfigError`."""
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {passes!r}.")
    return passes


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf


def check_arguments(optimizer: Any, op: Any, passes: Any, bucket_cap_mb: Any,
                    predivide: Any) -> ReduceOp:
    """Check ``DistributedOptimizer``'s arguments; returns ``op`` as a :class:`ReduceOp`.

    Raises:
        ConfigError: What is wrong, with a hint.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}. Hint: build the optimizer first, "
                          "e.g. torch.optim.SGD(model.parameters(), lr=0.1).")
    rop = _check_op(op)
    check_passes(passes)
    if not _finite_positive(bucket_cap_mb):
        raise ConfigError(f"bucket_cap_mb must be a finite number > 0, got {bucket_cap_mb!r}.")
    if not (_finite_positive(predivide) and math.isfinite(1.0 / predivide)):
        raise ConfigError(f"gradient_predivide_factor must be a finite number > 0 (the "
                          f"gradients are divided by it before the sum), got {predivide!r}.")
    if rop == ReduceOp.Sum and predivide != 1.0:
        raise ConfigError("gradient_predivide_factor only applies to op=Average.")
    if not dist.is_initialized():
        raise ConfigError("DistributedOptimizer needs a process group. "
                          "Hint: call parlay.init() first.")
    return rop


def named_parameters(optimizer: torch.optim.Optimizer,
                     named: Iterable[tuple[str, torch.Tensor]] | None
                     ) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters in its order, each with its name.

    Args:
        optimizer: The wrapped optimizer.
        named: ``model.named_parameters()``, or ``None`` for positional names.

    Raises:
        ConfigError: Not (name, parameter) pairs, names repeat, or parameters are unnamed.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    pairs = list(named)
    if any(not (isinstance(t, tuple) and len(t) == 2) for t in pairs):
        raise ConfigError("named_parameters should be a sequence of (name, parameter) tuples, "
                          "e.g. model.named_parameters().")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"parameter names in named_parameters must be unique; {dup!r} repeats.")
    by_id = {id(p): n for n, p in pairs}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ConfigError(
            f"named_parameters was given, but {len(missing)} of the optimizer's parameters are "
            "not named in it. Hint: pass model.named_parameters() of the model whose "
            "parameters the optimizer holds.")
    return [(by_id[id(p)], p) for p in params]


def check_still_frozen(frozen: list[torch.Tensor]) -> None:
    """``frozen``: the parameters frozen when the optimizer was wrapped, which are never
    reduced; one made trainable since is refused (at each ``synchronize()``) rather than left
    to drift apart on each rank.

    Raises:
        ConfigError: Some became trainable.
    """
    thawed = sum(p.requires_grad for p in frozen)
    if thawed:
        raise ConfigError(
            f"{thawed} parameter(s) frozen when the DistributedOptimizer was built became "
            "trainable; their gradients would never be averaged, so the ranks' weights would "
            "drift apart. Hint: make them trainable before wrapping, or call remove_hooks() on "
            "this optimizer and wrap a new one after unfreezing (with shard='parameters', build "
            "the new one inside `with old.gathered_parameters():`).")


def check_still_held(optimizer: torch.optim.Optimizer, held: int) -> None:
    """``held``: how many parameters the wrapped ``optimizer`` held when it was wrapped; one
    added since (its own ``add_param_group``) would be stepped but never reduced.

    Raises:
        ConfigError: It holds another number now.
    """
    if sum(len(g["params"]) for g in optimizer.param_groups) != held:
        raise ConfigError(
            "parameters were added to the wrapped optimizer (add_param_group) after the "
            "DistributedOptimizer was built: their gradients would not be reduced and the "
            "ranks' weights would drift apart. Fix: add every group before wrapping, or call "
            "remove_hooks() on the DistributedOptimizer and wrap the inner optimizer again.")


def check_untouched(untouched: bool, passes: int) -> None:
    """``zero_grad()``: ``untouched``, no backward pass counted since the last reduction.

    Raises:
        ConfigError: One was (its reduced or accumulated gradients would be lost).
    """
    if not untouched:
        raise ConfigError(
            "optimizer.zero_grad() was called after loss.backward() but before "
            "optimizer.step() or optimizer.synchronize() (with backward_passes_per_step="
            f"{passes}, also between those passes: it would drop the earlier ones). This is "
            "prohibited as it can cause a race condition. Hint: step() or synchronize() first "
            "(as Horovod, which raises here too).")


def _hash(entry: Any) -> int:
    """A 60-bit hash of ``repr(entry)`` that is the same in every process (``hash`` is not)."""
    return int(hashlib.sha256(repr(entry).encode()).hexdigest()[:15], 16)


def _text(text: str, src: int, group: Any, size: int = 512) -> str:
    """Broadcast a short text from group rank ``src`` as UTF-8 bytes in a tensor (decoded as
    text, never unpickled)."""
    raw = text.encode()[:size]
    buf = torch.tensor(list(raw) + [0] * (size - len(raw)), dtype=torch.uint8,
                       device=comm.group_device(group))
    comm.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def check_consistency(named: list[tuple[str, torch.Tensor]], group: Any,
                      settings: dict[str, Any] | None = None,
                      what: str = "wrap their optimizer with") -> None:
    """Check that every rank of ``group`` holds the same trainable parameters and ``settings``
    (those that shape the collectives, e.g. the shard level and bucket size): a collective.

    One allreduce of hashes when the ranks agree; on a mismatch a few more find the first
    difference, and every rank raises the same error describing it.

    Args:
        what: How the error says the ranks got the settings ("the ranks {what} different
            settings: ...").

    Raises:
        ConfigError: The ranks disagree on a setting (each one apart is named), or on names,
            shapes, dtypes or the number of parameters.
    """
    fields = [f"{k}={v!r}" for k, v in sorted((settings or {}).items())]
    said = ", ".join(fields)
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    hs = [_hash(e) for e in mine]
    total = _hash((tuple(hs), said))
    dev = comm.group_device(group)  # a NCCL-only group reduces CUDA tensors only
    t = torch.tensor([len(mine), total, -len(mine), -total], dtype=torch.int64, device=dev)
    comm.allreduce(t, "min", group=group)
    fewest, low, neg_most, neg_high = t.tolist()
    if fewest == -neg_most and low == -neg_high:
        return
    world, me = comm.group_size(group), comm.group_rank(group)
    ref = torch.tensor([_hash(said)], dtype=torch.int64, device=dev)
    comm.broadcast(ref, src=0, group=group)
    key = torch.tensor([me if int(ref) != _hash(said) else world], device=dev)
    comm.allreduce(key, "min", group=group)
    if int(key) < world:
        r, text = comm.to_global_rank(group, int(key)), "\x1f".join(fields)
        at0, atr = (_text(text, src, group, 4096).split("\x1f") for src in (0, int(key)))
        apart = "; ".join(f"{x} on rank 0 but {y} on rank {r}" for x, y in zip(at0, atr)
                          if x != y) or f"{at0} on rank 0 but {atr} on rank {r}"  # (cut short)
        raise ConfigError(f"the ranks {what} different settings: {apart}. Hint: pass the same "
                          "arguments on every rank.")
    longest = -neg_most
    own = torch.tensor(hs + [-1] * (longest - len(hs)), dtype=torch.int64, device=dev)
    ref = own.clone()
    comm.broadcast(ref, src=0, group=group)
    differs = (own != ref).nonzero()
    none = longest * world + world
    key = torch.tensor([int(differs[0]) * world + me if len(differs) else none], device=dev)
    comm.allreduce(key, "min", group=group)
    k, r = divmod(int(key), world)
    entry = f"{mine[k] if k < len(mine) else None}|{len(mine)}"
    a, n0 = _text(entry, 0, group).rsplit("|", 1)
    b, nr = _text(entry, r, group).rsplit("|", 1)
    raise ConfigError(
        f"ranks hold different models: parameter #{k} is {a} on rank 0 but {b} on rank "
        f"{comm.to_global_rank(group, r)} (rank 0 has {n0} trainable parameters, rank {r} "
        f"{nr}). Hint: build the same model on every rank, with the same requires_grad flags, "
        "before wrapping the optimizer.")
