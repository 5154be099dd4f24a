"""The Trainer's plain pieces: its state record, argument checks, the metric reduction, the
printing rank, the start-up line, and ``trainer.session`` (kept out of ``trainer.py`` so the
loop itself reads at a glance)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from parlay import comm, runtime
from parlay.errors import ConfigError

__all__ = ["TrainerState", "TrainerSession", "check_positive", "check_trainer_args",
           "check_strategy_options", "check_built",
           "reduce_metrics", "choose_printer", "start_message", "evaluate", "SCHEDULES"]

SCHEDULES = ("constant", "cosine")


@dataclass
class TrainerState:
    """Where training stands (identical on every training rank).

    Attributes:
        epoch: Current epoch (0-based; equals ``num_epochs`` when training is over).
        step: Optimizer steps taken.
        samples_seen: Training samples consumed over all replicas.
        batch_in_epoch: Batches of the current epoch already consumed by each replica.
        skipped_steps: Steps skipped on every rank (non-finite, fp16 overflow), counted across
            restarts.
    """

    epoch: int = 0
    step: int = 0
    samples_seen: int = 0
    batch_in_epoch: int = 0
    skipped_steps: int = 0


class TrainerSession:
    """``trainer.session``: TensorLayer's training-session handle, a view of its Trainer.

    Args:
        trainer: The Trainer whose loop this session reports on.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def should_stop(self) -> bool:
        """Same as :meth:`Trainer.should_stop` (serves on parameter-server ranks)."""
        return bool(self.trainer.should_stop())


def default_lr(optimizer: type) -> Any:
    """The ``lr`` default of an optimizer class, or None."""
    try:
        p = inspect.signature(optimizer).parameters.get("lr")
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def check_positive(name: str, value: Any, allow_none: bool = True, kind: type = int) -> None:
    """Raise ConfigError unless ``value`` is a positive ``kind`` (or None when allowed)."""
    if value is None and allow_none:
        return
    number = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not number or not value > 0:
        raise ConfigError(f"{name} must be a positive {kind.__name__}"
                          f"{' or None' if allow_none else ''}, got {value!r}.")


def check_trainer_args(build: Any, optimizer: Any, ints: dict[str, Any],
                       optional_ints: dict[str, Any], warmup_epochs: Any, lr_schedule: Any,
                       seed: Any) -> None:
    """The Trainer's argument checks, each naming the argument and what it takes.

    Raises:
        ConfigError: The first bad argument.
    """
    if not callable(build):
        raise ConfigError("build_training_func must be a function returning (model, loss_fn).")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer class (e.g. "
                          f"torch.optim.Adam), got {optimizer!r}.")
    for name, v in ints.items():
        check_positive(name, v, allow_none=False)
    for name, v in optional_ints.items():
        check_positive(name, v)
    if not (isinstance(warmup_epochs, (int, float)) and warmup_epochs >= 0):
        raise ConfigError(f"warmup_epochs must be a number >= 0, got {warmup_epochs!r}.")
    if lr_schedule not in SCHEDULES:
        raise ConfigError(f"lr_schedule must be one of {SCHEDULES}, got {lr_schedule!r}.")
    if seed is not None and (not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"seed must be an int >= 0 or None, got {seed!r}.")


def check_strategy_options(options: dict[str, Any] | None) -> None:
    """``strategy_options`` may not repeat what the Trainer passes to every strategy.

    Raises:
        ConfigError: It sets ``compression``, ``precision`` or ``grad_clip``.
    """
    twice = sorted({"compression", "precision", "grad_clip"} & set(options or {}))
    if twice:
        raise ConfigError(f"strategy_options sets {twice}, which are Trainer arguments. "
                          f"Hint: pass them as Trainer({twice[0]}=...).")


def check_built(built: Any) -> tuple[Any, Callable[..., Any]]:
    """``build_training_func()``'s result as ``(model, loss_fn)``.

    Raises:
        ConfigError: It is not an ``(nn.Module, callable)`` pair.
    """
    if not (isinstance(built, tuple) and len(built) == 2
            and isinstance(built[0], torch.nn.Module) and callable(built[1])):
        raise ConfigError(f"build_training_func() must return (model, loss_fn) with an "
                          f"nn.Module and a callable loss_fn(output, target), got "
                          f"{type(built).__name__}. Hint: return model, nn.CrossEntropyLoss().")
    return built[0], built[1]


def evaluate(strategy: Any, loader: Any, metric_fn: Callable[..., dict[str, Any]]
             ) -> tuple[dict[str, float], int]:
    """Sample-weighted metric sums and the sample count of this rank's share of ``loader``."""
    sums: dict[str, float] = {}
    count = 0
    for x, y in loader:
        out = strategy.eval_forward(x)
        if out is None or not strategy.reports_loss:
            continue
        y = y.to(out.device) if isinstance(y, torch.Tensor) else y
        vals = metric_fn(out, y)
        k = len(y)
        for name, v in vals.items():
            sums[name] = sums.get(name, 0.0) + float(torch.as_tensor(v).double()) * k
        count += k
    return sums, count


def reduce_metrics(sums: dict[str, float], count: int, group: Any) -> dict[str, float]:
    """Sample-weighted means of ``sums`` over ``group``, in tensors only (no peer's bytes are
    unpickled). Ranks without samples take the others' metric names; ranks with samples must
    agree on them (checked with one max over the UTF-8 codes and one over their negation)."""
    names = sorted(sums) if count else []
    dev = comm.group_device(group)  # a NCCL-only group reduces CUDA tensors only
    if comm.group_size(group) > 1:
        code = torch.tensor(list("\0".join(names).encode()), dtype=torch.int64, device=dev)
        width = comm.allreduce(torch.tensor([code.numel()], device=dev), "max", group=group)
        both = torch.full((2, max(1, int(width.item()))), -1, dtype=torch.int64, device=dev)
        if names:
            both[0].fill_(256)  # padding differs from every byte: lengths must agree too
            both[0, : code.numel()] = code
            both[1] = -both[0]
        else:
            both[1].fill_(-1000)  # below any -code: ranks without samples do not vote
        both = comm.allreduce(both, "max", group=group).cpu()
        hi, lo = both[0], -both[1]
        if not torch.equal(hi, lo) and bool((hi >= 0).any()):
            raise ConfigError(f"the replicas computed different validation metrics (this rank: "
                              f"{names}). Hint: build_validation_func must return the same "
                              "keys on every rank.")
        raw = bytes(int(b) for b in hi.tolist() if 0 <= b < 256)
        names = raw.decode().split("\0") if raw else []
    vec = torch.tensor([float(count)] + [sums.get(n, 0.0) for n in names], dtype=torch.float64)
    if comm.group_size(group) > 1:
        vec = comm.allreduce(vec.to(dev), "sum", group=group).cpu()
    total = vec[0].item()
    result = {n: vec[i + 1].item() / max(total, 1.0) for i, n in enumerate(names)}
    result["samples"] = float(total)
    return result


def choose_printer(strategy: Any) -> bool:
    """Whether this rank prints: the lowest training rank that reports a loss (else the lowest
    training rank), agreed with one int64 allreduce."""
    if not strategy.consumes_data:
        return False
    me = runtime.rank()
    low = torch.tensor([me if strategy.reports_loss else 2 ** 62, me], dtype=torch.int64,
                       device=comm.group_device(strategy.train_group))
    if comm.group_size(strategy.train_group) > 1:
        comm.allreduce(low, "min", group=strategy.train_group)
    reporter, lowest = low.tolist()
    return me == (reporter if reporter != 2 ** 62 else lowest)


def start_message(t: Any, mode: str, precision: str, compression: Any, base_lr: Any,
                  warmup_epochs: float) -> str:
    """The one line the printing rank shows when a Trainer starts (or resumes)."""
    s = t.strategy
    return (f"parlay Trainer: mode={mode}, {s.dp_size} replica(s) x batch {t.batch_size} = "
            f"{t.batch_size * s.dp_size} samples/step, {t.steps_per_epoch} steps/epoch, "
            f"{t.total_steps} steps; learning rate x{t.lr_scale:g} "
            + (f"(linear scaling, warm-up over {t.warmup_steps} steps = {warmup_epochs:g} "
               f"epoch(s) from x1; base lr {base_lr})" if t.lr_scale != 1 else "(no scaling)")
            + f"; precision={precision}, compression={compression}"
            + (f"; resumed at step {t.state.step}, epoch {t.state.epoch}" if t.state.step else ""))
