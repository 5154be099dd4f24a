"""DistributedSession: the user-facing parameter-server API (TF's MonitoredTrainingSession shape).

The same script runs on every rank::

    with parlay.DistributedSession(task_spec=parlay.TaskSpec.from_env(), model=model,
                                   optimizer=torch.optim.SGD, optimizer_args={"lr": 0.1},
                                   consistency="async") as sess:
        while not sess.should_stop():
            sess.train_step((x, y), loss_fn)     # loss_fn(model(x), y) -> scalar loss

On parameter-server ranks ``should_stop()`` (or ``train_step``, or leaving the ``with`` block)
serves until every worker finished, then returns True: no PS-specific user code is needed.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import comm, runtime
from parlay._validate import check_int, parse_address
from parlay.compress.base import Compressor, get_compressor
from parlay.discovery import ClusterEnv, detect
from parlay.errors import ConfigError
from parlay.nonfinite import NonFiniteGuard
from parlay.ps.chunks import ELEMENTWISE
from parlay.ps.consistency import Consistency, Update, get_consistency
from parlay.ps.options import check_session_args
from parlay.ps.plan import DEFAULT_SPLIT_BYTES, ShardPlan
from parlay.ps.recovery import (load_worker_state, mark_droppable, resume_session,
                                save_worker_state, server_loss_is_fatal)
from parlay.ps.server import Server
from parlay.ps.worker import Worker
from parlay.taskspec import TaskSpec

__all__ = ["DistributedSession"]

log = logging.getLogger("parlay.ps")


def _layout(spec: TaskSpec, found: ClusterEnv) -> dict[str, Any]:
    """Where an explicitly initialised task sits: the local rank its :meth:`TaskSpec.device_fn`
    uses; the launcher's nodes when the spec carries its local rank, else the spec's hosts
    (tasks sharing one are one node, as for ``TF_CONFIG``).

    Raises:
        ConfigError: The launcher started other than the spec's tasks (its evaluators aside).
    """
    if found.source != "single" and not (spec.world_size <= found.world_size
                                         <= spec.world_size + len(spec.evaluator_hosts)):
        raise ConfigError(f"task_spec describes {spec.world_size} training tasks (and "
                          f"{len(spec.evaluator_hosts)} evaluators) but the launcher "
                          f"({found.source}) started {found.world_size} processes. Hint: "
                          "describe the launched processes (parlay.TaskSpec.from_env()), or "
                          f"launch {spec.world_size} (`parlay run -n {spec.world_size}`).")
    local = spec.local_index()
    if spec.local_rank is not None and found.source != "single":
        size, node, nodes = found.local_world_size, found.node_rank, found.num_nodes
    else:
        hosts = [parse_address(a, "task_spec")[0].lower() for a in spec.cluster_hosts]
        mine, names = hosts[spec.rank or 0], list(dict.fromkeys(hosts))
        size, node, nodes = hosts.count(mine), names.index(mine), len(names)
    return dict(local_rank=local, local_world_size=max(min(size, spec.world_size), local + 1),
                node_rank=node, num_nodes=nodes)


class DistributedSession:
    """Parameter-server training session: servers hold sharded parameters and optimizer state,
    workers compute gradients.

    Args:
        task_spec: This process's task (``None``: :meth:`TaskSpec.from_env`), not an
            evaluator. Must agree with the process group when one exists; otherwise the group
            is created from it (with the local rank :meth:`TaskSpec.device_fn` uses).
        model: The model, built identically on every rank (servers take their initial values
            from their copy; workers start from the servers' values).
        optimizer: A ``torch.optim.Optimizer`` class, applied by each server to its shard.
        optimizer_args: Keyword arguments of ``optimizer`` (e.g. ``{"lr": 0.1}``).
        consistency: ``"sync"`` (average one step of every worker, one update: the maths of
            allreduce), ``"async"`` (apply each push on arrival) or ``"stale:s"`` (apply on
            arrival; no worker more than ``s`` steps ahead of the slowest).
        compression: Gradient compression of pushes: a name (``"fp16"``, ``"topk:0.01"``) or a
            :class:`~parlay.compress.Compressor`. Its decode context must depend only on the
            bucket's size, dtype and key (true of parlay's built-in compressors).
        checkpoint_dir: Servers checkpoint here every ``checkpoint_every`` updates and at
            the end (``sync``: ``ps-<k>.step-<version>.pt``, the newest three, and a new
            session resumes the newest version every server holds; ``async``/``stale``:
            ``ps-<k>.pt``), workers ``worker-<i>.pt`` (residuals) at the end; a new session
            with the same directory resumes. See also ``resume_steps``.
        max_steps: Stop when the parameters have been updated this many times (the global
            step, as TF's ``StopAtStepHook``): one update per round of all workers in ``sync``,
            one per applied push otherwise (in ``async`` up to ``workers - 1`` pushes already
            in flight may still land on each server).
        placement: ``"balanced"`` (by bytes) or ``"round_robin"`` (see :class:`ShardPlan`).
        split_bytes: Tensors above this size are split across servers (``None``: never).
        timeout: Seconds a worker may be silent before servers declare it lost (default: the
            process group's timeout). Workers wait up to ``2 * timeout + 5`` s for a reply,
            because a server may itself be waiting out a lost peer; one held by slower workers
            (or at a barrier) is told to wait on every ``timeout / 2`` s.
        checkpoint_every: Server checkpoint interval in updates (``None``: only at the end).
        resume_steps: Workers that keep their own checkpoints (as the Trainer does) pass the
            steps they hold. Servers then checkpoint when the workers ask (:meth:`save_shards`)
            instead of every ``checkpoint_every`` updates, and every rank resumes the newest
            step all servers and workers hold (:attr:`resumed_step`): never mixed steps.
            In ``async``/``stale``, workers lost before that step (dropped while the others
            went on) sit out: they join and finish at once (:attr:`sits_out`).
        resume_runs: The run id (:attr:`run`) each of the workers' ``resume_steps`` recorded:
            a server file of that step that records another one (a file of another run) is
            not resumed (a warning names it; the ranks agree on another step).
        snapshots: This worker keeps in-memory snapshots of its state (the Trainer's, ``sync``
            only). Servers then snapshot their shards after every update in host memory and
            a restart resumes the newest step every rank holds in memory, when newer than
            the disk step (:attr:`resumed_from_snapshot`, :attr:`snapshot_store`).

    Raises:
        ConfigError: Bad arguments (at construction) or a world without parameter servers.

    Notes:
        Workers send batches as ``(inputs, targets)``; ``loss_fn(model(inputs), targets)`` must
        return the batch-mean loss, so ``sync`` equals single-process training on the
        concatenated batch when workers' batches have equal sizes. Parameters without a
        gradient in a step (``grad`` None: unused, or frozen after the start) push zeros
        flagged as such; one that no push of an update has a gradient for is left out of the
        servers' optimizer step, as torch leaves it (no weight decay, momentum or state).
        Buffers (e.g. BatchNorm statistics) stay local to each worker.
    """

    def __init__(self, task_spec: TaskSpec | None = None, model: nn.Module | None = None,
                 optimizer: type[torch.optim.Optimizer] | None = None,
                 optimizer_args: dict[str, Any] | None = None, consistency: str = "sync",
                 compression: str | Compressor | None = None, checkpoint_dir: str | None = None,
                 max_steps: int | None = None, *, placement: str = "balanced",
                 split_bytes: int | None = DEFAULT_SPLIT_BYTES, timeout: float | None = None,
                 checkpoint_every: int | None = 100,
                 resume_steps: Sequence[int] | None = None, snapshots: bool = False,
                 resume_runs: Mapping[int, int] | None = None) -> None:
        check_session_args(task_spec, model, optimizer, optimizer_args, max_steps,
                           checkpoint_every, timeout, checkpoint_dir)
        assert isinstance(model, nn.Module) and optimizer is not None  # checked just above
        self.task_spec = task_spec
        self.model = model
        self.optimizer_cls = optimizer
        self.optimizer_args = dict(optimizer_args or {})
        self.consistency: Consistency = get_consistency(consistency)
        self.compressor: Compressor = get_compressor(compression)
        if not getattr(self.compressor, "point_to_point", True):
            raise ConfigError(f"compression {compression!r} needs collective rounds (PowerSGD, "
                              "int8) and cannot compress parameter-server pushes. Hint: use "
                              "'fp16', 'bf16', 'topk:0.01' or 'randomk:0.01'.")
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self.max_steps = max_steps
        self.checkpoint_every = checkpoint_every
        self._timeout = timeout
        if split_bytes == DEFAULT_SPLIT_BYTES and not issubclass(optimizer, ELEMENTWISE):
            split_bytes = None  # e.g. Adafactor's factored state needs whole tensors
        self.plan = ShardPlan.from_module(model, 1, placement=placement, split_bytes=split_bytes)
        self._plan_args = dict(placement=placement, split_bytes=split_bytes)
        self.server: Server | None = None
        self.worker: Worker | None = None
        self.ps_group: Any = None
        self.dp_group: Any = None
        self.resume_steps = None if resume_steps is None else [
            check_int("resume_steps", t, 0) for t in resume_steps]
        self.resume_runs = dict(resume_runs or {})
        self.resumed_step: int | None = None  # agreed at start (None: fresh, or not sync)
        #: This start's id in the checkpoints (drawn at start; servers' files and Trainer
        #: workers' record it, tying the files of one step together).
        self.run = 0
        self.tagged = False  # servers checkpoint when the workers ask
        self.snapshots = bool(snapshots) and self.consistency.aggregate
        #: This rank's in-memory snapshot store (``sync`` with snapshotting workers), or None.
        self.snapshot_store: Any = None
        self.resumed_from_snapshot = False  # resumed_step came from the in-memory snapshots
        #: Global ranks of the workers that train (the others sit out a resume).
        self.training_workers: list[int] = []
        #: Called on every rank once the resume step is agreed, before servers load and
        #: workers join: where groups that depend on :attr:`training_workers` are made.
        self.on_agreed: Callable[[], None] | None = None
        self._owns_runtime = False
        self._started = self._closed = False

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> DistributedSession:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def start(self) -> None:
        """Join the process group (creating it if needed), build the plan, start serving roles.

        Raises:
            ConfigError: The task spec is an evaluator, disagrees with the process group or
                with the processes the launcher started, or there is no PS.
            CommError: A server did not answer the first pull.
        """
        if self._started:
            return
        try:
            self._start()
        except BaseException as e:
            self.close(e)  # no half-built session: groups and an owned runtime are released
            raise

    def _start(self) -> None:
        spec = self.task_spec if self.task_spec is not None else TaskSpec.from_env()
        if spec.is_evaluator:
            raise ConfigError(f"task_spec is evaluator {spec.index}: expected a ps, chief or "
                              "worker task. Hint: evaluators take no part in a "
                              "DistributedSession (they stand outside the training world); "
                              "check spec.is_evaluator() and evaluate without a session.")
        if not runtime.is_initialized():
            found = detect()
            if (found.rank, found.world_size) == (spec.rank, spec.world_size):
                runtime.init()  # the launcher's environment (keeps local rank, device, ...)
            else:  # an explicit cluster description (TF-style host lists) the env lacks
                runtime.init(rank=spec.rank, world_size=spec.world_size,
                             master_addr=spec.master_addr, master_port=spec.master_port,
                             num_ps=spec.num_ps, **_layout(spec, found))
            self._owns_runtime = True
        self._started = True
        c = runtime.cluster()
        if (spec.rank, spec.world_size, spec.num_ps) != (c.rank, c.world_size, c.num_ps):
            raise ConfigError(f"task_spec ({spec.task_type} {spec.index}: rank {spec.rank} of "
                              f"{spec.world_size}, {spec.num_ps} ps) does not match the process "
                              f"group (rank {c.rank} of {c.world_size}, {c.num_ps} ps). Hint: "
                              "use parlay.TaskSpec.from_env() under `parlay run --ps K`.")
        if c.num_ps < 1:
            raise ConfigError("DistributedSession needs at least one parameter-server rank, got 0. "
                              "Hint: launch with `parlay run -n 3 --ps 1 script.py` "
                              "(PARLAY_NUM_PS=1).")
        self.is_ps = c.rank < c.num_ps
        self.num_servers, self.num_workers = c.num_ps, c.world_size - c.num_ps
        self.rank = c.rank
        self.timeout = float(self._timeout or runtime.timeout().total_seconds())
        self.plan = ShardPlan.from_module(self.model, c.num_ps, **self._plan_args)
        world = list(range(c.world_size))
        workers = world[c.num_ps:]
        # Replies may wait out a lost peer's full timeout at the server first; a rank lost
        # before the start is found by a barrier within one timeout, not while that group forms.
        with comm.comm_errors("DistributedSession start"):
            comm.barrier()
            self.ps_group = runtime.new_group(world, backend="gloo",
                                           timeout=_dt.timedelta(seconds=2 * self.timeout + 5))
            self.dp_group = runtime.new_group(workers)
        for p in self.model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        if self.checkpoint_dir:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
        self._agree_resume()
        if self.on_agreed is not None:
            self.on_agreed()
        self._join(workers, world[: c.num_ps])

    def _join(self, workers: list[int], servers: list[int]) -> None:
        """Servers load the agreed step and wait to serve; workers say hello (and, sitting a
        resume out, goodbye)."""
        c = runtime.cluster()
        if self.is_ps:
            self.server = Server(c.rank, self.plan, self.model, self.optimizer_cls,
                                 self.optimizer_args, self.consistency, self.compressor, workers,
                                 self.ps_group, self.timeout, self.checkpoint_dir,
                                 self.checkpoint_every, tagged=self.tagged,
                                 resume_step=self.resumed_step, memory=self.snapshot_store,
                                 from_memory=self.resumed_from_snapshot, run=self.run)
        else:
            load_worker_state(self.residuals_path, self.compressor,
                              (self.resumed_step or 0) if self.consistency.aggregate else None)
            bind = getattr(self.compressor, "bind", None)
            if callable(bind):  # "auto" decides at the first push, agreed over the workers
                bind(self.dp_group, collective=False)
            self.worker = Worker(c.rank - c.num_ps, c.rank, self.plan, self.model, self.compressor,
                                 servers, self.ps_group, self.timeout, len(workers),
                                 exact=self.consistency.aggregate)
            # a non-finite loss or gradient raises before it reaches the servers (the Trainer
            # puts its own policy's check here)
            self.worker.before_push = NonFiniteGuard("raise").check_local
            self.worker.hello()
            if not self.consistency.aggregate:
                mark_droppable(c.rank)
            if self.sits_out:  # its state at the resumed step was never saved
                log.warning("worker %d (rank %d) was lost before step %s and holds no state of "
                            "it: it sits this run out; the other workers go on",
                            self.worker.index, self.rank, self.resumed_step)
                self.worker.finish()

    def _agree_resume(self) -> None:
        r, self.snapshot_store = resume_session(self)
        self.tagged, self.resumed_step = r.tagged, r.step
        self.resumed_from_snapshot, self.training_workers = r.from_snapshot, r.training
        self.run = r.run

    @property
    def sits_out(self) -> bool:
        """A worker that does not train in this run: lost before the resumed step (``async``
        / ``stale``), it joined and finished at once."""
        return self.worker is not None and self.rank not in self.training_workers

    def close(self, exc: BaseException | None = None) -> None:
        """Workers say goodbye (or report an error), servers serve to the end; idempotent."""
        if self._closed or not self._started:
            return
        self._closed = True
        try:
            if self.worker is not None:
                if exc is None:
                    self.worker.finish()
                    save_worker_state(self.residuals_path, self.compressor, self.worker.step)
                else:
                    self.worker.fail()
            elif self.server is not None and exc is None:
                self.server.serve()
        finally:
            for g in (self.ps_group, self.dp_group):
                if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                    with contextlib.suppress(Exception):  # gone with the default group
                        dist.destroy_process_group(g)
            self.ps_group = self.dp_group = None
            if self._owns_runtime:
                runtime.shutdown()

    # -- training -----------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """Workers: True once ``max_steps`` updates were applied (or the session closed).
        Servers: serve until every worker finished, then True.

        Raises:
            CommError: ``sync`` lost a worker (names it), or a server stopped answering.
        """
        self._need_started("should_stop")
        if self.server is not None:
            self.server.serve()
            return True
        assert self.worker is not None
        return self._closed or self.sits_out or self.at_max_steps()

    def at_max_steps(self) -> bool:
        """A worker: whether a server it last heard from had applied ``max_steps`` updates
        (each push reaches every server, so the newest count any of them reported; their
        smallest lags when servers apply pushes in different orders, and a worker would push
        past the bound)."""
        return bool(self.worker is not None and self.max_steps is not None
                    and max(self.worker.versions) >= self.max_steps)

    def train_step(self, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> float | None:
        """One step on a worker: push this batch's gradients, pull the released parameters.

        Args:
            batch: ``(inputs, targets)``; inputs may be a tuple of model arguments.
            loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar batch-mean loss.

        Returns:
            The worker's loss on ``batch`` (before the update); ``None`` on servers, where this
            call serves until the workers finish.
        """
        self._need_started("train_step", open_=True)
        if self.server is not None:
            self.server.serve()
            return None
        assert self.worker is not None
        if self.at_max_steps():
            raise ConfigError(f"train_step() after max_steps={self.max_steps} updates: training "
                              "is over. Hint: loop `while not sess.should_stop(): ...`.")
        with server_loss_is_fatal(self.rank, self.num_servers):
            loss = self.worker.train_step(batch, loss_fn)
        every = self.checkpoint_every
        if self.consistency.aggregate and every and self.worker.step % every == 0:
            # the servers save this version now: the residuals go with it
            save_worker_state(self.residuals_path, self.compressor, self.worker.step)
        return loss

    def serve(self) -> None:
        """Servers: serve until every worker finished (returns at once on workers and when
        already served).

        Raises:
            CommError: ``sync`` lost a worker (names it), or the transport failed.
        """
        self._need_started("serve")
        if self.server is not None:
            self.server.serve()

    def set_lr_factor(self, factor: float) -> None:
        """Scale every server's base learning rates by ``factor`` from this worker's next push
        on (warm-up schedules run on workers; the factor travels in the push header)."""
        if self.worker is not None:
            self.worker.lr_factor = float(factor)

    def save_shards(self, step: int) -> None:
        """Workers: have every server checkpoint its shard as ``step`` (once every live worker
        asked for that step: the files hold exactly the first ``step`` gradients of every live
        worker; ``sync``: version ``step``) and wait for it. A no-op on servers.

        Raises:
            CommError: A server or (``sync``) a worker was lost meanwhile.
            CheckpointError: The live workers asked for different steps.
        """
        self._need_started("save_shards", open_=True)
        with server_loss_is_fatal(self.rank, self.num_servers):
            if self.worker is not None:
                self.worker.save_shards(step)

    def end_epoch(self, epoch: int, samples: int) -> tuple[int, list[int]]:
        """Workers: say this worker ended ``epoch`` after training ``samples`` of it, and wait
        for every live worker to end it too (the servers' barrier; workers lost meanwhile are
        left out). Servers: ``(0, [])`` at once.

        Returns:
            The samples every worker that ended ``epoch`` trained of it, and the global ranks
            of the workers that train on: the same on every live worker, so the survivors of
            a lost worker can re-shard the data over themselves alike.

        Raises:
            CommError: A server was lost (or, ``sync``, a worker).
            CheckpointError: The live workers waited at different steps.
        """
        self._need_started("end_epoch", open_=True)
        if self.worker is None:
            return 0, []
        with server_loss_is_fatal(self.rank, self.num_servers):
            samples, live = self.worker.end_epoch(epoch, samples)
        return samples, [self.num_servers + w for w in live]

    # -- introspection ------------------------------------------------------------------------
    @property
    def is_worker(self) -> bool:
        """Whether this rank computes gradients."""
        return self.worker is not None

    @property
    def worker_index(self) -> int | None:
        """This worker's index among the workers (``None`` on servers)."""
        return self.worker.index if self.worker is not None else None

    @property
    def global_step(self) -> int:
        """Parameter updates applied so far (servers: own version; workers: as last pulled)."""
        if self.server is not None:
            return self.server.core.version
        return self.worker.global_step if self.worker is not None else 0

    @property
    def step(self) -> int:
        """Workers: this worker's pushes applied so far."""
        return self.worker.step if self.worker is not None else 0

    def staleness_histogram(self) -> dict[int, int]:
        """``{staleness: count}``: on a server over every gradient it applied, on a worker over
        its own pushes (one entry per server). Staleness = updates applied between the read of
        the parameters and the apply of the gradient computed on them (0 in ``sync``)."""
        h = self.server.core.histogram if self.server is not None else (
            self.worker.histogram if self.worker is not None else {})
        return dict(sorted(h.items()))

    def update_log(self) -> list[Update]:
        """Servers: every applied gradient (worker, step, base version, version), in order."""
        return list(self.server.core.log) if self.server is not None else []

    def lost_workers(self) -> list[int]:
        """Servers: global ranks of workers declared lost or failed, in that order."""
        if self.server is None:
            return []
        return [self.server.worker_ranks[w] for w in self.server.core.lost]

    def _need_started(self, what: str, open_: bool = False) -> None:
        if not self._started:
            raise ConfigError(f"{what}() needs a started session. Hint: use "
                              "`with parlay.DistributedSession(...) as sess:` or call start().")
        if open_ and self._closed:
            raise ConfigError(f"{what}() after the session closed: training is over. Hint: "
                              "call it inside the `with parlay.DistributedSession(...)` block.")

    # -- worker-side state (compressor residuals) ---------------------------------------------
    @property
    def residuals_path(self) -> str | None:
        """The file a worker keeps its compression residuals in across restarts (``None`` on a
        server, without ``checkpoint_dir``, or when the caller keeps worker state:
        ``resume_steps``)."""
        if not self.checkpoint_dir or self.tagged or self.is_ps:
            return None
        return os.path.join(self.checkpoint_dir, f"worker-{self.rank - self.num_servers}.pt")
