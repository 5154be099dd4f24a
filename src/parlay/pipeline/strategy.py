"""The ``"hybrid"`` strategy: pipeline stages x data-parallel replicas under the Trainer.

``Trainer(..., mode="hybrid", strategy_options={"pp": 2, "chunks": 4})`` on ``dp * pp`` ranks
builds a :class:`~parlay.pipeline.Pipeline` of the model returned by ``build_training_func``
(an ``nn.Sequential``). Global rank ``r`` is stage ``r % pp`` of replica ``r // pp``; every
stage of a replica reads the same batch (``dp_rank`` is the replica index), the last stage
computes and reports the loss, and metrics are reduced over the last stages' ``dp_group``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import comm, runtime
from parlay.errors import ConfigError
from parlay.nonfinite import NonFiniteGuard
from parlay.pipeline.pipe import Pipeline
from parlay.strategies import StepResult, Strategy, register_strategy

__all__ = ["HybridStrategy"]

_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _LossScaler:
    """Dynamic fp16 loss scale shared by every rank (GradScaler's policy: halve on overflow,
    double after ``interval`` clean steps). The overflow decision is a world-wide MAX of every
    rank's inf/NaN flag, so all stages of all replicas skip the same steps."""

    def __init__(self, init: float = 2.0 ** 16, interval: int = 2000) -> None:
        self.scale, self.interval, self.clean = float(init), interval, 0

    def found_inf(self, grads: list[torch.Tensor]) -> bool:
        flag = torch.zeros(1)
        for g in grads:
            if not torch.isfinite(g).all():
                flag.fill_(1.0)
                break
        comm.allreduce(flag, "max")
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean = self.scale * 0.5, 0
        else:
            self.clean += 1
            if self.clean >= self.interval:
                self.scale, self.clean = self.scale * 2.0, 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean = float(state["scale"]), int(state["clean"])


class HybridStrategy(Strategy):
    """Pipeline parallel within a replica, data parallel across replicas.

    Args:
        compression: Compressor for the data-parallel gradient allreduce (``"fp16"``, ...).
        precision: ``"fp32"``, ``"bf16"`` (autocast inside every stage) or ``"fp16"``
            (autocast plus a dynamic loss scale whose overflow/skip decision is agreed by
            every rank, so all stages skip the same steps).
        grad_clip: Clip the whole model's gradient norm (over every stage) after averaging.
        pp: Ranks per pipeline. Default: the stage count the launch was given
            (``parlay run --pp P``, i.e. ``runtime.cluster().pipeline_stages``), else 2.
        chunks: Micro-batches per batch.
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
        balance / split_points / by / virtual_stages / activation_dtype: See
            :class:`~parlay.pipeline.Pipeline`.
        bucket_cap_mb: Gradient bucket size of the data-parallel engine.
        loss_scale: Initial fp16 loss scale (default 2**16).

    Raises:
        ConfigError: Unknown options or values this mode cannot honour.
    """

    name = "hybrid"

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, pp: int | None = None, chunks: int = 4,
                 schedule: str = "1f1b", balance: list[int] | None = None,
                 split_points: list[str] | None = None, by: str = "auto",
                 virtual_stages: int | None = None, activation_dtype: Any = None,
                 bucket_cap_mb: float = 25.0, loss_scale: float | None = None,
                 **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"mode 'hybrid' got unknown option(s) {sorted(unknown)}; it takes "
                              "compression, precision, grad_clip, pp, chunks, schedule, balance, "
                              "split_points, by, virtual_stages, activation_dtype, bucket_cap_mb, "
                              "loss_scale.")
        if precision not in _PRECISIONS:
            raise ConfigError(f"precision must be one of {sorted(_PRECISIONS)}, got "
                              f"{precision!r}. Hint: 'bf16' needs no loss scaling.")
        if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
            raise ConfigError(f"grad_clip must be a positive number or None, got {grad_clip!r}.")
        self.compression, self.precision, self.grad_clip = compression, precision, grad_clip
        self._pp = pp
        self.options = dict(chunks=chunks, schedule=schedule, balance=balance,
                            split_points=split_points, by=by, virtual_stages=virtual_stages,
                            activation_dtype=activation_dtype)
        self.bucket_cap_mb = bucket_cap_mb
        self.scaler = (_LossScaler(2.0 ** 16 if loss_scale is None else float(loss_scale))
                       if precision == "fp16" else None)
        self.pipe: Pipeline | None = None
        self.optimizer: Any = None
        self._base_lrs: list[float] = []
        #: The non-finite policy (set by ``Trainer(nonfinite=...)``); fp16 keeps its own
        #: agreed overflow skipping.
        self.guard = NonFiniteGuard("raise")
        self._bytes = {"fwd_bytes": 0, "bwd_bytes": 0, "fwd_dense_bytes": 0,
                       "bwd_dense_bytes": 0, "steps": 0}

    # ------------------------------------------------------------------ topology
    @property
    def pp(self) -> int:
        """Ranks per pipeline: the ``pp`` option, else the launch's ``--pp``, else 2."""
        if self._pp is not None:
            return self._pp
        launched = runtime.cluster().pipeline_stages if runtime.is_initialized() else None
        return launched or 2

    def _world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_size(self) -> int:
        return self.pipe.mesh.dp if self.pipe else max(1, self._world() // max(1, self.pp))

    @property
    def dp_rank(self) -> int:
        if self.pipe:
            return self.pipe.mesh.dp_rank
        return (dist.get_rank() if dist.is_initialized() else 0) // max(1, self.pp)

    @property
    def dp_group(self) -> Any:
        return self._ready().mesh.dp_group

    @property
    def reports_loss(self) -> bool:
        return self._ready().is_last

    @property
    def model(self) -> nn.Module | None:
        """This rank's stage modules (an ``nn.ModuleList``), once set up."""
        return nn.ModuleList(self.pipe.modules) if self.pipe else None

    def _ready(self) -> Pipeline:
        if self.pipe is None:
            raise ConfigError("HybridStrategy.setup(...) must run before training.")
        return self.pipe

    # ------------------------------------------------------------------ life cycle
    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        if runtime.is_initialized() and runtime.cluster().num_ps:
            raise ConfigError("mode 'hybrid' does not use parameter servers, but the cluster has "
                              f"{runtime.cluster().num_ps}. Hint: launch without --ps.")
        self.pipe = Pipeline(model, loss_fn, stages=self.pp,
                             autocast_dtype=_PRECISIONS[self.precision], **self.options)
        try:
            opt = optimizer_cls(self.pipe.parameters(), **optimizer_args)
        except TypeError as e:
            raise ConfigError(f"could not build {getattr(optimizer_cls, '__name__', optimizer_cls)}"
                              f" with optimizer_args={optimizer_args}: {e}") from e
        self.optimizer = self.pipe.distributed_optimizer(
            opt, compression=self.compression, bucket_cap_mb=self.bucket_cap_mb)
        self._base_lrs = [float(g["lr"]) for g in opt.param_groups]

    def _to(self, t: Any) -> Any:
        dev = self._ready().device
        if isinstance(t, torch.Tensor):
            return t.to(dev, non_blocking=True)
        if isinstance(t, (list, tuple)):
            return type(t)(self._to(v) for v in t)
        return t

    def train_step(self, x: Any, y: Any) -> StepResult:
        pipe, opt = self._ready(), self.optimizer
        pipe.train(True)
        opt.zero_grad(set_to_none=True)
        skipped = False
        if self.scaler is not None:
            pipe.loss_scale = self.scaler.scale
            out = pipe.step(self._to(x), self._to(y))
            opt.synchronize()                       # average over replicas first
            grads = [p.grad for p in pipe.parameters() if p.grad is not None]
            skipped = self.scaler.found_inf(grads)  # agreed by every rank
            if not skipped:
                for g in grads:
                    g.div_(self.scaler.scale)
                if self.grad_clip is not None:
                    pipe.clip_grad_norm_(float(self.grad_clip))
                with opt.skip_synchronize():
                    opt.step()
            self.scaler.update(skipped)
        else:
            saved = self.guard.snapshot(opt.compression)
            out = pipe.step(self._to(x), self._to(y))
            opt.synchronize()                       # average over replicas first
            skipped = self._nonfinite(out, saved)
            if not skipped:
                if self.grad_clip is not None:
                    pipe.clip_grad_norm_(float(self.grad_clip))
                with opt.skip_synchronize():
                    opt.step()
        b = self._bytes
        for k in ("fwd_bytes", "bwd_bytes", "fwd_dense_bytes", "bwd_dense_bytes"):
            b[k] += getattr(out, k)
        b["steps"] += 1
        n = len(y) if hasattr(y, "__len__") else 1
        loss = float(out.loss.item()) if out.loss is not None else None
        return StepResult(loss=loss, samples=n, skipped=skipped)

    def _nonfinite(self, out: Any, saved: dict[str, Any] | None) -> bool:
        """Agree over every stage of every replica (the world) whether the step went
        non-finite; raise, or undo it (compression state back, gradients zeroed)."""
        pipe, opt = self._ready(), self.optimizer
        named = [(n, p.grad) for n, p in pipe.named_parameters() if p.grad is not None]
        loss = float(out.loss.detach().float().item()) if out.loss is not None else None
        if not self.guard.must_skip(loss, named):
            return False
        if saved is not None:
            opt.compression.load_state_dict(saved)
        opt.zero_grad(set_to_none=True)
        return True

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor | None:
        pipe = self._ready()
        was = [m.training for m in pipe.modules]
        pipe.train(False)
        try:
            return pipe.forward(self._to(x))
        finally:
            for m, w in zip(pipe.modules, was):
                m.train(w)

    def set_lr_factor(self, factor: float) -> None:
        for g, base in zip(self.optimizer.param_groups, self._base_lrs):
            g["lr"] = base * factor

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        pipe = self._ready()
        sd = {"model": pipe.state_dict(), "optimizer": self.optimizer.state_dict(),
              "stages": list(pipe.stage_ids), "balance": list(pipe.partition.balance)}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pipe = self._ready()
        got = (list(state.get("stages", [])), list(state.get("balance", [])))
        want = (list(pipe.stage_ids), list(pipe.partition.balance))
        if got != want:
            raise ConfigError(f"checkpoint holds stages {got[0]} with balance {got[1]}, this rank "
                              f"runs stages {want[0]} with balance {want[1]}. Hint: resume with "
                              "the same pp, schedule and balance.")
        pipe.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def comm_stats(self) -> dict[str, float]:
        """Bytes between stages per step (wire and dense) and the data-parallel gradient bytes."""
        b = self._bytes
        steps = max(1, b["steps"])
        out: dict[str, float] = {f"pipeline_{k}_per_step": v / steps for k, v in b.items()
                                 if k != "steps"}
        out.update({f"dp_{k}": v for k, v in self.optimizer.comm_stats().items()})
        return out


register_strategy("hybrid", HybridStrategy)
