"""TaskSpec: one task of a TensorFlow-style cluster (parameter servers, chief, workers).

Rank convention, relied on by the launcher and every parlay module: parameter servers first
(ranks ``0..K-1``, rank = ps index), then the chief when there is one, then the workers. The first
non-ps rank (``K``) is the chief: the chief task, or worker 0 when there is none (TF's rule).
Evaluators (TF semantics) stand outside the training world and have no rank.

Imports run one way: this module builds on :mod:`parlay.discovery` (to read the launcher's
environment) and the shared validators of :mod:`parlay._validate`; neither imports it back
(:mod:`parlay.env` re-exports ``TaskSpec`` from here). Torch and the runtime, which sit below
this module too, are imported only when :meth:`TaskSpec.device_fn` is called, so parsing a
cluster description needs no torch.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from parlay._validate import (DEFAULT_MASTER_PORT, TASK_TYPES, check_int, check_task,
                              cluster_order, digits_as_int, fail, join_address, parse_address,
                              rank_of, read_tf_config)
from parlay.discovery import detect, read_task

if TYPE_CHECKING:
    import torch

__all__ = ["TASK_TYPES", "DEFAULT_MASTER_PORT", "TaskSpec", "TaskSpecDef", "create_task_spec_def"]

_SYNTH_PORTS = 65536 - 1024  # unprivileged ports available to synthesized host lists


class _Flag(int):
    """A yes/no that also answers TensorLayer's method form: ``spec.is_ps`` and
    ``spec.is_ps()`` both work."""

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


@dataclass(frozen=True)
class TaskSpec:
    """One task of a TensorFlow-style cluster of parameter servers, a chief and workers.

    Host lists are stored as tuples of ``"host:port"`` strings (IPv6 as ``"[::1]:2222"``).

    Attributes:
        task_type: ``"ps"``, ``"chief"``, ``"worker"`` or ``"evaluator"``.
        index: Index of this task in the host list of its type. An evaluator may have an empty
            ``evaluator_hosts`` (TF puts evaluators outside the cluster); its index is then 0.
        ps_hosts: Parameter servers; they take ranks ``0..num_ps-1``.
        worker_hosts: Workers; they take the ranks after the ps and the chief.
        chief_hosts: At most one chief; it takes rank ``num_ps``.
        evaluator_hosts: Evaluators; not part of the training world.
        master: TensorLayer's ``TaskSpecDef(master=host)``: the chief's host (a training task,
            before the workers); ``task_type="master"`` is then that chief.
        trial: TensorLayer's ``trial``, kept as given (it does not change the cluster).
        local_rank: This process's rank on its node as its launcher gives it (``LOCAL_RANK``,
            ``SLURM_LOCALID``, ...), set by :meth:`from_env`, the one :mod:`parlay.runtime`
            picks its GPU by; ``None`` (a spec built by hand) when unknown.

    Raises:
        ConfigError: At construction, for an unknown task type, a bad or out-of-range index, a
            malformed or duplicated address, more than one chief, or no worker and no chief.
    """

    task_type: str
    index: int
    ps_hosts: Sequence[str] = ()
    worker_hosts: Sequence[str] = ()
    chief_hosts: Sequence[str] = ()
    evaluator_hosts: Sequence[str] = ()
    master: InitVar[str | Sequence[str] | None] = None
    trial: Any = field(default=None, compare=False, repr=False)
    local_rank: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self, master: str | Sequence[str] | None) -> None:
        if master:
            if self.chief_hosts:
                raise fail("master", "either master= (TensorLayer) or chief_hosts=",
                           "both", "pass the chief's host once")
            object.__setattr__(self, "chief_hosts", master)
        if self.task_type == "master":  # TensorLayer's (TF1's) chief
            if not self.chief_hosts:
                raise fail("master", "the master's host:port with task_type='master'", "none",
                           "pass master='host:port' (TensorLayer's MASTER_HOST), or make the "
                           "task a worker")
            object.__setattr__(self, "task_type", "chief")
        index, hosts = check_task(self.task_type, self.index,
                                  {job: getattr(self, f"{job}_hosts") for job in TASK_TYPES})
        object.__setattr__(self, "index", index)
        for job, given in hosts.items():
            object.__setattr__(self, f"{job}_hosts", given)
        if self.local_rank is not None:
            object.__setattr__(self, "local_rank", check_int("local_rank", self.local_rank, 0))

    def _hosts(self) -> dict[str, tuple[str, ...]]:
        return {job: tuple(getattr(self, f"{job}_hosts")) for job in TASK_TYPES}

    @property
    def num_ps(self) -> int:
        """Number of parameter servers."""
        return len(self.ps_hosts)

    @property
    def num_workers(self) -> int:
        """Number of training (non-ps) tasks: the workers plus the chief, if any."""
        return len(self.chief_hosts) + len(self.worker_hosts)

    @property
    def world_size(self) -> int:
        """Number of ranks in the training world (ps, chief and workers; no evaluators)."""
        return self.num_ps + self.num_workers

    @property
    def cluster_hosts(self) -> tuple[str, ...]:
        """Addresses of the training world in rank order: ps, chief, workers."""
        return cluster_order(self._hosts())

    @property
    def rank(self) -> int | None:
        """Global rank of this task, or ``None`` for an evaluator."""
        return rank_of(self.task_type, self.index, self._hosts())

    @property
    def is_ps(self) -> _Flag:
        """Whether this task is a parameter server."""
        return _Flag(self.task_type == "ps")

    @property
    def is_worker(self) -> _Flag:
        """Whether this task trains: a worker or the chief (TF's chief trains too)."""
        return _Flag(self.task_type in ("worker", "chief"))

    @property
    def is_chief(self) -> _Flag:
        """The chief task, or worker 0 when the cluster has no chief (TF convention)."""
        return _Flag(self.task_type == "chief" or (self.task_type == "worker" and self.index == 0
                                                   and not self.chief_hosts))

    #: TensorLayer's name for :attr:`is_chief` (``spec.is_master()``).
    is_master = is_chief

    @property
    def shard_index(self) -> int | None:
        """This task's share of the data among the :attr:`num_workers` training tasks
        (TensorLayer's ``dataset.shard(spec.num_workers, spec.shard_index)``); ``None`` for
        parameter servers and evaluators."""
        return None if self.rank is None or not self.is_worker else self.rank - self.num_ps

    @property
    def is_evaluator(self) -> _Flag:
        """Whether this task is an evaluator (outside the training world)."""
        return _Flag(self.task_type == "evaluator")

    @property
    def master_addr(self) -> str:
        """Host of rank 0 (the first ps, else the chief, else worker 0), unbracketed."""
        return parse_address(self.cluster_hosts[0], "rank 0")[0]

    @property
    def master_port(self) -> int:
        """Port of rank 0."""
        return parse_address(self.cluster_hosts[0], "rank 0")[1]

    def use_last_worker_as_evaluator(self) -> TaskSpec:
        """TensorLayer's: the same cluster with its last worker taken out of training to
        evaluate (an evaluator, outside the training world), as seen by this task.

        Raises:
            ConfigError: No worker to spare (one training task at least must remain).
        """
        if self.num_workers < 2 or not self.worker_hosts:
            raise fail("use_last_worker_as_evaluator()", "two training tasks or more",
                       f"{self.num_workers}", "add a worker: one must still train")
        *keep, last = self.worker_hosts
        me = self.task_type == "worker" and self.index == len(keep)
        return dataclasses.replace(
            self, task_type="evaluator" if me else self.task_type,
            index=len(self.evaluator_hosts) if me else self.index, worker_hosts=tuple(keep),
            evaluator_hosts=(*self.evaluator_hosts, last))

    def local_index(self) -> int:
        """The accelerator this task uses on a multi-GPU host: :attr:`local_rank` when known
        (as :mod:`parlay.runtime` uses it), else how many training tasks (chief or workers)
        before this one, in rank order, run on the same host."""
        if self.local_rank is not None:
            return self.local_rank
        if not self.is_worker:
            return 0
        me = parse_address(self.cluster_hosts[self.rank or 0], "this task")[0].lower()
        earlier = (*self.chief_hosts, *self.worker_hosts)[:(self.rank or 0) - self.num_ps]
        return sum(parse_address(a, "a task")[0].lower() == me for a in earlier)

    def device_fn(self) -> torch.device:
        """Where this task's computation belongs, e.g. ``model.to(task_spec.device_fn())``.

        TensorLayer's ``device_fn()`` returned a TensorFlow device setter that pinned variables
        to the parameter servers; in parlay the :class:`~parlay.DistributedSession` already
        shards parameters over the servers, so what is left to place is the task's own compute:

        - ``ps``: ``cpu``. A parameter server keeps its parameter shards and optimizer state in
          host memory and serves them over gloo (as BytePS's summation servers do); it never
          needs a GPU.
        - ``chief`` / ``worker`` / ``evaluator``: the device parlay's runtime uses when this
          process is that task and is initialised; before, the one it will pick by default
          (:func:`parlay.runtime.resolve_backend`): ``cuda:<k>`` with CUDA and NCCL, where
          ``k`` is :meth:`local_index` (the launcher's local rank for a spec read by
          :meth:`from_env`) modulo the GPUs on this host, else ``cpu``.

        Returns:
            A ``torch.device``.
        """
        import torch

        if self.is_ps:
            return torch.device("cpu")
        from parlay import runtime

        if runtime.is_initialized() and runtime.rank() == self.rank:
            return runtime.device()
        return runtime.resolve_backend("auto", self.local_index())[1]

    @classmethod
    def from_tf_config(cls, text: str) -> TaskSpec:
        """Parse a ``TF_CONFIG`` JSON document.

        Args:
            text: ``{"cluster": {"ps": [...], "chief": [...], "worker": [...]},
                "task": {"type": "worker", "index": 0}}``; a missing index means 0.

        Returns:
            The task it describes; without a cluster (TensorFlow's local mode), worker 0 of
            one local process as :meth:`from_env` gives it with no environment.

        Raises:
            ConfigError: Invalid JSON, a wrong structure or an invalid cluster.
        """
        task = read_task({"TF_CONFIG": text}) or read_tf_config(text)  # (blank: raises)
        return cls._of(task) if task else cls.from_env({})  # no cluster: one local process

    @classmethod
    def _of(cls, task: tuple[Any, ...]) -> TaskSpec:
        task_type, index, hosts, trial = task
        return cls(task_type, index, trial=trial, **{f"{j}_hosts": h for j, h in hosts.items()})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TaskSpec:
        """Describe this process as a task, from ``TF_CONFIG`` or the launcher's environment.

        A ``TF_CONFIG`` with a cluster (or TensorLayer's ``JOB_NAME``, ``TASK_INDEX`` and host
        lists, read as one: :func:`~parlay.discovery.tf_config_text`) is authoritative (its rank
        must agree with any launcher variables also present). Otherwise :func:`detect` runs and
        ranks below ``num_ps`` (``PARLAY_NUM_PS``, set by ``parlay run --ps K``) become ps with
        index = rank, the others workers with index = rank - K. Those host lists are
        informational: rank ``r`` is given ``f"{master_addr}:{master_port + r}"`` (master
        port default :data:`DEFAULT_MASTER_PORT`, master host default ``localhost``, ports past
        65535 wrap to 1024 and up); only :attr:`local_rank`, the launcher's, says which
        tasks share a host. With no environment at all this is worker 0 of
        ``("localhost:29500",)``.

        Args:
            environ: Environment mapping; ``None`` reads ``os.environ``.

        Returns:
            The task of this process.

        Raises:
            ConfigError: Whatever :func:`detect` or :meth:`from_tf_config` rejects, a world too
                large for distinct made-up ports, or ``TF_CONFIG`` disagreeing with the launcher.
        """
        env = os.environ if environ is None else environ
        task = read_task(env)
        if task is not None:
            spec = cls._of(task)
            if spec.rank is not None:
                found = detect(env)
                if (found.rank, found.world_size) != (spec.rank, spec.world_size):
                    raise fail("TF_CONFIG", f"the rank the launcher gives ({found.source}: rank "
                               f"{found.rank} of {found.world_size})",
                               f"rank {spec.rank} of {spec.world_size}",
                               "unset TF_CONFIG or the launcher's variables")
                spec = dataclasses.replace(spec, local_rank=found.local_rank)
            return spec
        found = detect(env)
        if found.world_size > _SYNTH_PORTS:
            raise fail("world size", f"at most {_SYNTH_PORTS} ranks to make up distinct ports",
                       str(found.world_size), "set TF_CONFIG with real addresses instead")
        host = "localhost" if found.source == "single" else found.master_addr or "localhost"
        base = found.master_port or DEFAULT_MASTER_PORT
        hosts = []
        for r in range(found.world_size):
            port = base + r if base + r <= 65535 else 1024 + (base + r - 65536) % _SYNTH_PORTS
            hosts.append(join_address(host, port))
        k = found.num_ps
        task_type, index = ("ps", found.rank) if found.rank < k else ("worker", found.rank - k)
        return cls(task_type, index, ps_hosts=hosts[:k], worker_hosts=hosts[k:],
                   local_rank=found.local_rank)


class TaskSpecDef(TaskSpec):
    """TensorLayer's ``tl.distributed.TaskSpecDef``: a :class:`TaskSpec` taking TensorLayer's
    positional order ``(task_type, index, trial, ps_hosts, worker_hosts, master)`` and an index
    given as text (``"1"``, as read from an environment variable), as TensorLayer does.
    ``TaskSpecDef()`` is TensorLayer's default, one local master task."""

    def __init__(self, task_type: str = "master", index: int | str = 0, trial: Any = None,
                 ps_hosts: Sequence[str] = (), worker_hosts: Sequence[str] = (),
                 master: str | Sequence[str] | None = None, **more: Any) -> None:
        idx: Any = digits_as_int(index)
        if task_type == "master" and not (ps_hosts or worker_hosts or master or more):
            master = f"localhost:{DEFAULT_MASTER_PORT}"  # TensorLayer's single local task
        super().__init__(task_type, idx, ps_hosts or (), worker_hosts or (), master=master,
                         trial=trial, **more)


def create_task_spec_def(environ: Mapping[str, str] | None = None) -> TaskSpec:
    """TensorLayer's ``create_task_spec_def()``: this process's task, from ``TF_CONFIG``,
    TensorLayer's ``JOB_NAME``/``TASK_INDEX``/``PS_HOSTS``/``WORKER_HOSTS``/``MASTER_HOST``, or
    the launcher's environment (torchrun, SLURM, MPI); else as :meth:`TaskSpec.from_env`."""
    return TaskSpec.from_env(environ)
