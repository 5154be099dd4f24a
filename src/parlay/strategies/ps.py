"""The ``"ps"`` strategy: the Trainer's parameter-server mode, a thin shell over
:class:`~parlay.ps.session.DistributedSession`.

Parameter-server ranks consume no data: :meth:`serve_until_done` serves until every worker
finished, closes the session and returns True. Workers form the data-parallel replicas
(``dp_size`` = number of workers, ``dp_rank`` = worker index).

Faults and restarts: at the Trainer's checkpoint steps every server saves its shards when
every live worker asks for the same step. In ``sync`` every server also snapshots its shards in
host memory right after each update while the workers snapshot theirs through the Trainer
(``snapshot_every``), so a restart resumes from the newest step every server and worker holds,
in memory (at most one step back) or on disk, never mixing steps. ``async``/``stale`` keep to
disk checkpoints (no step exists at which servers and workers stand together; see
:mod:`parlay.ps.shard_io`): a lost worker is dropped and the others keep checkpointing
(:attr:`ParameterServerStrategy.checkpoint_group`); a restart resumes the newest step every
server and every still-training worker holds, and workers lost before it sit out.

No data is dropped with a lost worker in ``async``/``stale``: at each epoch end the live
workers meet at the servers (:meth:`ParameterServerStrategy.end_epoch`), which count what every
worker trained and tell each the workers that train on, and the next epoch is sharded over
those. The epoch in which a worker is lost misses the part of its shard it had not trained.
"""
from __future__ import annotations

import logging
import os
from typing import Any
from collections.abc import Callable

import torch
import torch.nn as nn

from parlay import comm, runtime
from parlay.checkpoint import CheckpointManager, load
from parlay.errors import CheckpointError, ConfigError
from parlay.nonfinite import NonFiniteGuard
from parlay.ps.consistency import get_consistency
from parlay.ps.plan import DEFAULT_SPLIT_BYTES
from parlay.ps.recovery import verified_steps
from parlay.ps.session import DistributedSession
from parlay.strategies.base import (EpochEnd, StepResult, Strategy, register_strategy,
                                    reject_unknown)
from parlay.strategies.template import autocast_context, batch_size_of, check_precision

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("parlay.ps")


class ParameterServerStrategy(Strategy):
    """Train with parameter servers (ranks ``0..K-1`` under ``parlay run --ps K``).

    Args:
        compression: Compressor of worker -> server pushes (name or object).
        precision: ``"fp32"`` or ``"bf16"`` (autocast on workers). ``"fp16"`` is refused: loss
            scaling would need every server to agree on skipped steps.
        grad_clip: Must be ``None``: a global gradient norm is not available to any one rank
            when gradients are averaged on servers holding different shards.
        consistency: ``"sync"``, ``"async"`` or ``"stale:s"``.
        checkpoint_dir: Where servers save and resume their shards (see DistributedSession),
            with the Trainer's ``checkpoint_dir`` (default: its ``ps/`` folder).
        placement, split_bytes, timeout, checkpoint_every, max_steps: As for
            :class:`DistributedSession`.

    Raises:
        ConfigError: An option it cannot honour, or an unknown option.
    """

    name = "ps"
    #: Servers snapshot in step with the workers; the ranks agree the step before the Trainer.
    agrees_snapshots_early = True

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, consistency: str = "sync",
                 checkpoint_dir: str | None = None, placement: str = "balanced",
                 split_bytes: int | None = DEFAULT_SPLIT_BYTES, timeout: float | None = None,
                 checkpoint_every: int | None = 100, max_steps: int | None = None,
                 **unknown: Any) -> None:
        if "shard" in unknown:
            raise ConfigError("mode 'ps' shards the parameters and optimizer state over its "
                              "servers already; shard= is for modes 'allreduce', 'hybrid' and "
                              "'diloco'.")
        reject_unknown(ParameterServerStrategy, unknown)
        check_precision(precision, "ps", supported=("fp32", "bf16"))
        if grad_clip is not None:
            raise ConfigError("mode 'ps' cannot clip the global gradient norm (gradients are "
                              "averaged on the servers, each holding a different shard). Hint: "
                              "use mode='allreduce' for grad_clip, or clip in the loss.")
        self.precision = precision
        get_consistency(consistency)  # an unknown one fails here, naming the valid ones
        self.options = dict(consistency=consistency, compression=compression,
                            checkpoint_dir=checkpoint_dir, max_steps=max_steps,
                            placement=placement, split_bytes=split_bytes, timeout=timeout,
                            checkpoint_every=checkpoint_every)
        #: Non-finite policy (set by ``Trainer(nonfinite=...)``): workers check before pushing.
        self.guard: NonFiniteGuard = NonFiniteGuard("raise")
        self.session: DistributedSession | None = None
        self._ckpt_dir: str | None = None
        self._metrics_group: Any = None
        self._train_group: Any = None
        self._live: list[int] = []  # global ranks of the workers the data is sharded over
        self.model: nn.Module | None = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ topology
    def _cluster(self) -> Any:
        return runtime.cluster()

    @property
    def dp_size(self) -> int:
        c = self._cluster()
        return c.world_size - c.num_ps

    @property
    def dp_rank(self) -> int:
        c = self._cluster()
        return max(0, c.rank - c.num_ps)

    @property
    def update_replicas(self) -> int:
        """``async``/``stale``: a server applies each worker's push alone (base learning
        rate); ``sync``: one update averages every worker's."""
        return self.dp_size if get_consistency(self.options["consistency"]).aggregate else 1

    @property
    def supports_snapshots(self) -> bool:
        """``sync`` only: servers snapshot after every update and the workers' Trainer
        snapshots describe the same step."""
        return get_consistency(self.options["consistency"]).aggregate

    @property
    def layout_world_size(self) -> int:
        """Ranks a checkpoint's layout counts: every worker, also while some sit out."""
        return self.dp_size

    @property
    def consumes_data(self) -> bool:
        """Workers, except one that sits a resume out (lost before the resumed step)."""
        c = self._cluster()
        return c.rank >= c.num_ps and not (self.session is not None and self.session.sits_out)

    @property
    def reports_loss(self) -> bool:
        return self.consumes_data

    @property
    def dp_group(self) -> Any:
        """The workers in ``sync``; in ``async``/``stale`` each worker alone, so losing a
        worker never breaks the others' metrics (they are per worker there)."""
        return self._metrics_group

    @property
    def train_group(self) -> Any:
        """Every worker that trains in this run (all of them, except those that sit out a
        resume): the Trainer's resume and directory lock. Kept after the servers left, for
        validation."""
        return self._train_group

    @property
    def checkpoint_group(self) -> Any:
        """The workers that agree on each checkpoint once training runs.

        ``sync``: every worker (they step together; losing one stops the job anyway).
        ``async``/``stale``: each worker alone, so a lost worker never fails the survivors'
        next checkpoint. Nothing is lost by not agreeing there: the servers' save barrier
        (:meth:`state_dict`) already holds every live worker and every server at the same
        step, and a checkpoint the servers did not confirm raises before the worker's file is
        written. A restart picks the newest step every server and every worker still
        training holds (:func:`~parlay.ps.recovery.agree_resume`); workers lost before it sit
        the run out.
        """
        return self._train_group if get_consistency(
            self.options["consistency"]).aggregate else self._metrics_group

    # ------------------------------------------------------------------ life cycle
    def use_checkpoint_dir(self, path: str) -> None:
        """Servers save and resume their shards under ``<path>/ps`` unless the strategy was
        given its own ``checkpoint_dir``.

        Raises:
            ConfigError: ``max_steps`` in ``async``/``stale``: the workers stop at different
                steps of their own, and a checkpoint needs every live worker at one step.
        """
        o = self.options
        if o["max_steps"] is not None and not get_consistency(o["consistency"]).aggregate:
            raise ConfigError(
                f"strategy_options max_steps with the Trainer's checkpoint_dir in "
                f"{o['consistency']!r}: the workers reach max_steps (updates over all workers) "
                "at different steps of their own, and the final checkpoint needs every worker "
                "at the same step. Fix: bound each worker's steps with "
                "Trainer(max_iteration=N) instead, or use consistency='sync'.")
        self._ckpt_dir = path
        if self.options.get("checkpoint_dir") is None:
            self.options["checkpoint_dir"] = os.path.join(path, "ps")

    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        resume, runs = None, {}
        if self._ckpt_dir is None and self.options["checkpoint_dir"] is not None:
            raise ConfigError("strategy_options checkpoint_dir without the Trainer's: the servers "
                              "would resume their shards while the workers start at step 0. "
                              "Hint: Trainer(checkpoint_dir=...) (the servers' shards go to its "
                              "ps/ folder).")
        if self.consumes_data:
            self._device = runtime.device()
            model = model.to(self._device)
            if self._ckpt_dir is not None:  # the Trainer's checkpoints of this worker
                mgr = CheckpointManager(self._ckpt_dir, rank=runtime.rank())

                def read(t: int) -> None:  # and the session's run id the file recorded
                    runs[t] = int((load(mgr.path(t), t).get("strategy") or {}).get("ps_run", 0))

                resume = verified_steps(mgr.steps(), read, runtime.rank())
        self.model, self._loss_fn = model, loss_fn
        self.session = DistributedSession(None, model, optimizer_cls, optimizer_args,
                                          resume_steps=resume, snapshots=self.supports_snapshots,
                                          resume_runs=runs, **self.options)
        # Before a worker joins (its start waits for serving), once the training workers are
        # known (those that sit out a resume belong to no group).
        self.session.on_agreed = self._make_groups
        if self.guard.policy != "raise":
            raise ConfigError("mode 'ps' supports nonfinite='raise' only: workers do not step "
                              "together, so no step can be skipped on every worker alike. "
                              "Hint: use mode='allreduce' for nonfinite='skip'.")
        self.session.start()
        if self.session.worker is not None:  # raise before a NaN reaches the servers
            self.session.worker.before_push = self.guard.check_local
        if self.session.worker is not None and self.precision == "bf16":
            dev = self._device
            self.session.worker.forward_context = lambda: autocast_context("bf16", dev)

    def _make_groups(self) -> None:
        # Owned here, not by the session: validate() still reduces over the workers after the
        # session closed (the servers have left by then). Every rank creates them, in order.
        c = self._cluster()
        workers = self._ready().training_workers
        self._live = list(range(c.num_ps, c.world_size))
        with comm.comm_errors("ps strategy groups"):
            self._train_group = runtime.new_group(workers)
            self._metrics_group = self._train_group
            if not get_consistency(self.options["consistency"]).aggregate:
                for r in workers:
                    g = runtime.new_group([r])
                    if r == c.rank:
                        self._metrics_group = g

    def _ready(self) -> DistributedSession:
        if self.session is None:
            raise ConfigError("ParameterServerStrategy.setup(...) must run before training.")
        return self.session

    def serve_until_done(self) -> bool:
        s = self._ready()
        if s.is_worker and not s.sits_out:
            return False
        s.serve()
        s.close()
        return True

    def train_step(self, x: Any, y: Any) -> StepResult:
        s = self._ready()
        assert self._loss_fn is not None
        loss = s.train_step((x, y), self._loss_fn)
        return StepResult(loss=loss, samples=batch_size_of(y))

    def end_epoch(self, epoch: int, samples: int) -> EpochEnd | None:
        """``async``/``stale`` workers: wait at the servers until every live worker ended
        ``epoch``; the next epoch is sharded over the workers that train on, so a lost
        worker's share is taken over (a warning names it). ``None`` in ``sync``, where every
        worker steps together and a lost one stops the job."""
        s = self._ready()
        if get_consistency(self.options["consistency"]).aggregate or not s.is_worker:
            return None
        total, live = s.end_epoch(epoch, samples)
        c = self._cluster()
        gone = [r for r in self._live if r not in live]
        done = {c.num_ps + w for w in s.worker.finished} if s.worker is not None else set()
        if gone:
            why = ("finished" if done.issuperset(gone) else "lost or finished"
                   if done.intersection(gone) else "lost")
            log.warning("epoch %d: worker(s) %s no longer train (%s); from epoch %d on, their "
                        "share of the data is taken over by the %d other worker(s) %s (%d samples "
                        "counted in epoch %d, by the workers that finished it)", epoch,
                        ", ".join(f"{r - c.num_ps} (rank {r})" for r in gone), why, epoch + 1,
                        len(live), [r - c.num_ps for r in live], total, epoch)
        self._live = live
        return EpochEnd(total, len(live), live.index(s.rank))

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor | None:
        s = self._ready()
        if not s.is_worker or self.model is None:
            return None
        was = self.model.training
        self.model.eval()
        try:
            x = x.to(self._device) if isinstance(x, torch.Tensor) else x
            return self._forward(x)
        finally:
            self.model.train(was)

    def _forward(self, x: Any) -> torch.Tensor:
        assert self.model is not None and self.session is not None and self.session.worker
        with self.session.worker.forward_context():
            return self.model(x)

    def set_lr_factor(self, factor: float) -> None:
        self._ready().set_lr_factor(factor)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Worker-side state. With the Trainer's ``checkpoint_dir`` this first has every server
        checkpoint its shard at this worker's step (and waits for it), so the Trainer's file
        and the servers' files always describe the same step; both record the session's run
        id (``ps_run``), so a restart never resumes a server's file of another run with them."""
        s = self._ready()
        if not s.is_worker or self.model is None:
            return {}
        if s.tagged:
            s.save_shards(s.step)
        return {**self.snapshot_state_dict(), "snapshot": False, "ps_run": s.run}

    def snapshot_state_dict(self) -> dict[str, Any]:
        """Worker-side state for an in-memory snapshot: no message to the servers, which
        snapshot their shards themselves after every update (``sync``)."""
        s = self._ready()
        if not s.is_worker or self.model is None:
            return {}
        return {"model": self.model.state_dict(), "compressor": s.compressor.state_dict(),
                "global_step": s.global_step, "ps_step": s.step, "snapshot": True,
                "identity": self.snapshot_identity}

    @property
    def snapshot_store(self) -> Any:
        """This worker's in-memory snapshot store, opened by the session before the resume
        step was agreed (``None`` on servers, off, or without a run id)."""
        s = self.session
        return s.snapshot_store if s is not None and s.is_worker else None

    @property
    def agreed_snapshot_step(self) -> int | None:
        """The in-memory snapshot step every server and worker agreed to resume (the Trainer
        loads exactly it), or ``None`` when they resumed from disk or afresh."""
        s = self.session
        return s.resumed_step if s is not None and s.resumed_from_snapshot else None

    @property
    def newest_checkpoint(self) -> int | None:
        """The step servers and workers agreed on from the files each verified (a worker's
        newer checkpoint is not resumed when a server's file of its step failed)."""
        s = self.session
        if s is None or not s.tagged or s.resumed_from_snapshot:
            return None
        return s.resumed_step  # (None: the workers' own check names what is missing)

    def configure_snapshots(self, every: int) -> None:
        """The Trainer's ``snapshot_every`` (every rank, before training): servers snapshot
        at the same versions as the workers' steps; 0 turns them off everywhere."""
        s = self._ready()
        if not every and s.resumed_from_snapshot:
            raise CheckpointError(f"every rank resumed the in-memory snapshot of step "
                                  f"{s.resumed_step}, but this Trainer has snapshot_every=0 and "
                                  "would not load it. Hint: restart a job with the options it "
                                  "started with.")
        if s.server is not None and s.server.memory is not None:
            s.server.snapshot_every = every
            if not every:
                s.server.drop_memory()
        elif s.is_worker and not every and s.snapshot_store is not None:
            s.snapshot_store.clear()
            s.snapshot_store = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore worker-side state (compressor residuals). Parameters, optimizer state and
        versions come from the servers, which resumed the same step (checked).

        Raises:
            CheckpointError: The servers resumed a different step (or none).
        """
        s = self._ready()
        if not s.is_worker:
            return
        superseded = s.resumed_from_snapshot and not state.get("snapshot")  # a newer one follows
        if (s.tagged or s.resumed_from_snapshot) and not superseded and (
                state.get("ps_step") is None or state["ps_step"] != s.resumed_step):
            held = (f"step {s.resumed_step}" if s.resumed_step is not None
                    else "no checkpoint every rank holds")
            raise CheckpointError(
                f"this worker (rank {s.rank}) resumed the Trainer's checkpoint of step "
                f"{state.get('ps_step')}, but the parameter servers resumed {held}: their "
                f"files in {self.options.get('checkpoint_dir')!r} are missing or older. Hint: "
                "keep the servers' ps-*.step-*.pt files with the workers' checkpoints, or "
                "start with a fresh checkpoint_dir.")
        if "compressor" in state:
            s.compressor.load_state_dict(state["compressor"])

    def finish(self) -> None:
        if self.session is not None:
            self.session.close()

    def reached_end(self) -> bool:
        return self.session is not None and self.session.at_max_steps()

    def abort(self, exc: BaseException) -> None:
        if self.session is not None:
            self.session.close(exc)  # the servers name this worker as failed, not lost


register_strategy("ps", ParameterServerStrategy)
