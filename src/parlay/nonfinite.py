"""Non-finite policy: stop (``"raise"``) or drop (``"skip"``) a step whose loss or averaged
gradient holds a NaN or an infinity, on every rank alike and before the update is applied.

One NaN on one rank becomes a NaN in every replica's averaged gradient and, one update later,
in every replica's weights; keep-last-N checkpointing would then replace the last good
checkpoint with poisoned ones. The guard looks at what every rank already has after the
gradient reduction: its own loss and the averaged gradients. The test is one sum per gradient
(a NaN or an infinity anywhere makes the sum non-finite; an element-wise test, ~30x slower on
CPU, only confirms a non-finite sum, since huge finite values may overflow). Where backward ran
on :meth:`NonFiniteGuard.mark`'s loss, a rank's non-finite loss turns every averaged gradient
NaN, and the averaged gradients are bit-identical on every rank, so all ranks reach the same
decision without communicating; otherwise one allreduce (MIN) of two integers agrees on it. A
non-finite step then costs one allreduce that names the lowest rank whose own loss was
non-finite, so a data-parallel job never splits into ranks that stepped and ranks that did not.
"""
from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from parlay import comm
from parlay.errors import ConfigError, NonFiniteError

__all__ = ["POLICIES", "check_policy", "NonFiniteGuard", "first_nonfinite", "all_finite",
           "with_step", "first_nonfinite_entry"]

#: Accepted values of ``Trainer(nonfinite=...)``.
POLICIES = ("raise", "skip")
_NONE = 2 ** 62  # "no rank" in the MIN reduction


def check_policy(policy: Any) -> str:
    """Validate a non-finite policy name.

    Raises:
        ConfigError: Not one of :data:`POLICIES`.
    """
    if policy not in POLICIES:
        raise ConfigError(f"nonfinite must be one of {POLICIES}, got {policy!r}. Hint: 'raise' "
                          "stops at the first NaN/inf step with the weights intact; 'skip' drops "
                          "such steps (identically on every rank) and counts them.")
    return policy


def _values(g: torch.Tensor) -> torch.Tensor:
    return g._values() if g.is_sparse else g


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (a sum per tensor, then a confirmation
    element by element only when a sum is not finite)."""
    if not tensors:
        return True
    sums = torch.stack([_values(t).sum().float() for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(_values(t)).all()) for t in tensors)


def first_nonfinite(named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first tensor holding a NaN or an infinity, or ``None``."""
    for name, t in named:
        if not bool(torch.isfinite(_values(t)).all()):
            return name
    return None


class NonFiniteGuard:
    """The per-step non-finite check of a data-parallel strategy.

    Args:
        policy: ``"raise"`` or ``"skip"``.

    Raises:
        ConfigError: Unknown policy.
    """

    def __init__(self, policy: str = "raise") -> None:
        self.policy = check_policy(policy)
        self.skipped = 0

    def snapshot(self, compressor: Any, *, skips: bool = False) -> dict[str, Any] | None:
        """Under ``"skip"`` (or when the step ``skips`` otherwise: an fp16 loss scale's
        overflow), a copy of ``compressor``'s state (error-feedback residuals, PowerSGD's Q,
        fp16 scales; ``{}`` when it holds none yet) taken before the step, so a skipped step
        leaves it as it was."""
        if not (skips or self.policy == "skip") or compressor is None:
            return None
        return compressor.state_dict()

    @staticmethod
    def mark(loss: torch.Tensor) -> torch.Tensor:
        """``loss`` to call ``backward()`` on: itself (times exactly 1) when finite, else times
        NaN, so every gradient it reaches is NaN and, after averaging, every rank's is too.
        Then the averaged gradients alone tell every rank, identically, whether any rank went
        non-finite: the decision needs no communication (and no host sync here)."""
        d = loss.detach()
        factor = torch.where(torch.isfinite(d), torch.ones_like(d), torch.full_like(d, math.nan))
        return loss * factor

    def must_skip(self, loss: float | None, named_grads: Sequence[tuple[str, torch.Tensor]],
                  group: Any = None, *, marked: bool = False, grads: bool = True) -> bool:
        """Decide, identically on every rank of ``group``, whether this step is non-finite.

        Every rank of ``group`` must call it at the same point of every step. ``named_grads``
        are the gradients after averaging; ``loss`` this rank's loss (``None`` where the rank
        computes none, e.g. an early pipeline stage). With ``marked`` (backward ran on
        :meth:`mark`'s loss and the gradients were averaged over ``group``), a finite step
        costs no communication; otherwise one allreduce of two integers agrees on it. A
        non-finite step costs one allreduce more, to find the rank. ``grads=False`` decides
        on the losses alone (after an fp16 loss-scale overflow, whose gradients are not finite
        anyway; ``named_grads`` then only name the parameter).

        Returns:
            True when the step must be skipped (policy ``"skip"``); False when all is finite.

        Raises:
            NonFiniteError: Policy ``"raise"`` and the step is non-finite (on every rank).
        """
        local_bad = loss is not None and not math.isfinite(loss)
        grads_bad = grads and not all_finite([g for _, g in named_grads])
        dist = torch.distributed.is_initialized() and comm.group_size(group) > 1
        if marked and not grads_bad:
            return False
        me = comm.group_rank(group) if dist else 0
        flags = torch.tensor([me if local_bad else _NONE, -1 if grads_bad else 0],
                             dtype=torch.int64, device=comm.group_device(group))
        if dist:
            comm.allreduce(flags, "min", group=group)
        first, grads_flag = flags.tolist()
        bad = grads_flag < 0 or first != _NONE
        if not bad:
            return False
        rank = None
        if first != _NONE:
            rank = comm.to_global_rank(group, first) if torch.distributed.is_initialized() \
                else first  # (a group of one: this rank, by its global number)
        param = first_nonfinite(named_grads)
        if self.policy == "skip":
            self.skipped += 1
            return True
        raise NonFiniteError(_message(rank, param), rank=rank, parameter=param)


    def check_local(self, loss: torch.Tensor, model: nn.Module) -> None:
        """Before a parameter-server push: raise if this worker's loss or gradients are not
        finite (workers do not step together, so this check is local and needs no
        communication; the push, and so the servers' weights, stay clean).

        Raises:
            NonFiniteError: A NaN or an infinity in the loss or a gradient.
        """
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        loss_bad = not bool(torch.isfinite(loss.detach()).all())
        if loss_bad or not all_finite([g for _, g in named]):
            me = comm.group_rank() if torch.distributed.is_initialized() else 0
            param = first_nonfinite(named)
            raise NonFiniteError(_message(me if loss_bad else None, param), rank=me,
                                 parameter=param)


def _message(rank: int | None, param: str | None, step: int | None = None) -> str:
    where = (f"the loss was first non-finite on rank {rank}" if rank is not None else
             "every rank's loss was finite, so a gradient overflowed in backward")
    grad = (f"the first parameter with a non-finite gradient is {param!r}" if param
            else "no gradient on this rank is non-finite")
    at = f"at step {step} " if step is not None else ""
    return (f"non-finite loss or gradient {at}({where}; {grad}). The update was not applied, "
            "so the weights and the last checkpoint are intact. Hint: check that rank's input "
            "batch and the learning rate (or use grad_clip=... or, in modes allreduce, "
            "hybrid and diloco, Trainer(nonfinite='skip') to drop such steps: a restart on the "
            "same checkpoint_dir resumes with either; or precision='fp32' with a fresh "
            "checkpoint_dir).")


def with_step(err: NonFiniteError, step: int) -> NonFiniteError:
    """``err`` again, with the step it happened at in its message and ``step`` attribute."""
    return NonFiniteError(_message(err.rank, err.parameter, step), step=step, rank=err.rank,
                          parameter=err.parameter)


def first_nonfinite_entry(state: Any, allow_inf: Callable[[torch.Tensor], bool] | None = None,
                          where: str = "state") -> str | None:
    """Where (e.g. ``state['strategy']['model']['0.weight']``) the first floating-point tensor
    holding a NaN, or an infinity that ``allow_inf`` does not accept, sits; ``None`` if none."""
    if isinstance(state, torch.Tensor):
        if not (state.is_floating_point() or state.is_complex()):
            return None
        # A sum first (all_finite): the element-wise test is ~30x slower on CPU.
        if all_finite([state]) if not state.is_complex() else bool(torch.isfinite(state).all()):
            return None
        if allow_inf is not None and allow_inf(state) and not bool(torch.isnan(state).any()):
            return None
        return where
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for k, v in items:
        found = first_nonfinite_entry(v, allow_inf, f"{where}[{k!r}]")
        if found is not None:
            return found
    return None
