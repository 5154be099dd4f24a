"""TaskSpec: one task of a TensorFlow-style cluster (parameter servers, chief, workers).

Rank convention, relied on by the launcher and every parlay module: parameter servers first
(ranks ``0..K-1``, rank = ps index), then the chief when there is one, then the workers. The first
non-ps rank (``K``) is the chief: the chief task, or worker 0 when there is none (TF's rule).
Evaluators (TF semantics) stand outside the training world and have no rank.

This module imports neither torch nor any other parlay module except :mod:`parlay.errors`
(and :mod:`parlay.env`, lazily, to read the launcher's environment).
"""
from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parlay.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["TASK_TYPES", "DEFAULT_MASTER_PORT", "TaskSpec", "TaskSpecDef", "create_task_spec_def"]

#: Task types in rank order (evaluators last: they have no rank).
TASK_TYPES = ("ps", "chief", "worker", "evaluator")
#: torchrun's default rendezvous port; the base of the ports :meth:`TaskSpec.from_env` makes up.
DEFAULT_MASTER_PORT = 29500
_INT = re.compile(r"\s*(-?[0-9]{1,18})\s*")  # bounded: int() refuses 4300+ digit strings
_PORT = re.compile(r"[0-9]{1,5}")
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
_NODE = re.compile(r"(?:[^\[\],\s]+|\[[^\[\]]*\])+")  # one hostlist name: text and [groups]
_SYNTH_PORTS = 65536 - 1024  # unprivileged ports available to synthesized host lists


def _show(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:  # a deeply nested TF_CONFIG value
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(subject: str, expected: str, got: str, hint: str) -> ConfigError:
    return ConfigError(f"{subject}: expected {expected}, got {got}. Hint: {hint}")


def _check_host(host: str, subject: str) -> str:
    """Validate a bare host name or address (``[::1]`` is unbracketed); return it."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "[]/,@" or not c.isprintable() for c in host):
        raise _fail(subject, "a host name or IP address", _show(host),
                    "use a name such as 'node0', an IPv4 address or an IPv6 address")
    return host


def _parse_address(address: object, subject: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6addr]:port"``) into host and port, validating both."""
    if not isinstance(address, str):
        raise _fail(subject, "a 'host:port' string", f"{type(address).__name__} {_show(address)}",
                    "write each address as a string such as 'node0:2222'")
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise _fail(subject, "'[ipv6]:port'", _show(address), "write e.g. '[::1]:2222'")
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            raise _fail(subject, "'host:port'", _show(address), "add the port, e.g. 'node0:2222'")
        if ":" in host:
            raise _fail(subject, "'host:port'", _show(address),
                        "put IPv6 addresses in brackets, e.g. '[::1]:2222'")
    host = _check_host(host, f"{subject} {_show(address)}")
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise _fail(subject, "a port number in 1..65535 after the last ':'", _show(address),
                    "write e.g. 'node0:2222'")
    return host, int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _as_index(value: object, subject: str) -> int:
    if isinstance(value, bool) or isinstance(value, float):
        raise _fail(subject, "an int", f"{type(value).__name__} {_show(value)}", "pass e.g. 0")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise _fail(subject, "an int", f"{type(value).__name__} {_show(value)}",
                    "pass e.g. 0") from None


def _check_below(name: str, value: int, bound_name: str, bound: int, hint: str) -> None:
    if not 0 <= value < bound:
        raise _fail(name, f"0 <= {name} < {bound_name} ({bound})", str(value), hint)


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

    def __post_init__(self) -> None:
        if not isinstance(self.task_type, str) or self.task_type not in TASK_TYPES:
            hint = ("TF1's 'master' is called 'chief' here" if self.task_type == "master"
                    else "use one of " + ", ".join(repr(t) for t in TASK_TYPES))
            raise _fail("task_type", "one of " + ", ".join(TASK_TYPES), _show(self.task_type), hint)
        seen: dict[tuple[str, int], str] = {}
        for job in TASK_TYPES:
            name = f"{job}_hosts"
            hosts = getattr(self, name)
            if isinstance(hosts, (str, bytes)) or not isinstance(hosts, Sequence):
                raise _fail(name, "a list of 'host:port' strings",
                            f"{type(hosts).__name__} {_show(hosts)}",
                            f"wrap a single address in a list: {name}=['node0:2222']")
            hosts = tuple(hosts)
            object.__setattr__(self, name, hosts)
            for i, address in enumerate(hosts):
                host, port = _parse_address(address, f"{name}[{i}]")
                key = (host.lower(), port)
                if key in seen:
                    raise _fail(f"{name}[{i}]", "every address used once",
                                f"{_show(address)} again (already {seen[key]})",
                                "give each task its own host:port")
                seen[key] = f"{name}[{i}]"
        if len(self.chief_hosts) > 1:
            raise _fail("chief_hosts", "at most one chief", f"{len(self.chief_hosts)} hosts",
                        "list the extra hosts in worker_hosts")
        if not self.worker_hosts and not self.chief_hosts:
            raise _fail("worker_hosts", "at least one worker (or a chief)", "none",
                        "list the training hosts in worker_hosts")
        index = _as_index(self.index, "index")
        object.__setattr__(self, "index", index)
        count = len(getattr(self, f"{self.task_type}_hosts"))
        if self.task_type == "evaluator" and count == 0:
            count = 1  # TF evaluators may stand outside the cluster spec entirely
        _check_below("index", index, f"len({self.task_type}_hosts)", count,
                     f"a {self.task_type} index counts from 0 within {self.task_type}_hosts")

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
        return (*self.ps_hosts, *self.chief_hosts, *self.worker_hosts)

    @property
    def rank(self) -> int | None:
        """Global rank of this task, or ``None`` for an evaluator."""
        if self.task_type == "evaluator":
            return None
        offset = {"ps": 0, "chief": self.num_ps, "worker": self.num_ps + len(self.chief_hosts)}
        return offset[self.task_type] + self.index

    @property
    def is_ps(self) -> bool:
        """Whether this task is a parameter server."""
        return self.task_type == "ps"

    @property
    def is_worker(self) -> bool:
        """Whether this task trains: a worker or the chief (TF's chief trains too)."""
        return self.task_type in ("worker", "chief")

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief (TF convention)."""
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.index == 0 and not self.chief_hosts

    @property
    def is_evaluator(self) -> bool:
        """Whether this task is an evaluator (outside the training world)."""
        return self.task_type == "evaluator"

    @property
    def master_addr(self) -> str:
        """Host of rank 0 (the first ps, else the chief, else worker 0), unbracketed."""
        return _parse_address(self.cluster_hosts[0], "rank 0")[0]

    @property
    def master_port(self) -> int:
        """Port of rank 0."""
        return _parse_address(self.cluster_hosts[0], "rank 0")[1]

    def local_index(self) -> int:
        """How many training tasks (chief or workers) before this one, in rank order, run on
        the same host: the accelerator this task uses on a multi-GPU host."""
        if not self.is_worker:
            return 0
        me = _parse_address(self.cluster_hosts[self.rank or 0], "this task")[0].lower()
        earlier = (*self.chief_hosts, *self.worker_hosts)[:(self.rank or 0) - self.num_ps]
        return sum(_parse_address(a, "a task")[0].lower() == me for a in earlier)

    def device_fn(self) -> "torch.device":
        """Where this task's computation belongs, e.g. ``model.to(task_spec.device_fn())``.

        TensorLayer's ``device_fn()`` returned a TensorFlow device setter that pinned variables
        to the parameter servers; in parlay the :class:`~parlay.DistributedSession` already
        shards parameters over the servers, so what is left to place is the task's own compute:

        - ``ps``: ``cpu``. A parameter server keeps its parameter shards and optimizer state in
          host memory and serves them over gloo (as BytePS's summation servers do); it never
          needs a GPU.
        - ``chief`` / ``worker`` / ``evaluator``: the device parlay's runtime uses when this
          process is that task and is initialised (``cuda:<local rank>`` with NCCL, else CPU);
          otherwise ``cuda:<k>`` where ``k`` is :meth:`local_index` modulo the GPUs on this
          host, or ``cpu`` without CUDA.

        Returns:
            A ``torch.device``.
        """
        import torch

        if self.is_ps or not torch.cuda.is_available():
            return torch.device("cpu")
        from parlay import runtime

        if runtime.is_initialized() and runtime.rank() == self.rank:
            return runtime.device()
        return torch.device("cuda", self.local_index() % torch.cuda.device_count())

    @classmethod
    def from_tf_config(cls, text: str) -> TaskSpec:
        """Parse a ``TF_CONFIG`` JSON document.

        Args:
            text: ``{"cluster": {"ps": [...], "chief": [...], "worker": [...]},
                "task": {"type": "worker", "index": 0}}``; a missing index means 0.

        Returns:
            The task it describes.

        Raises:
            ConfigError: Invalid JSON, a wrong structure or an invalid cluster.
        """
        hint = ('write e.g. {"cluster": {"worker": ["w0:2222"]}, '
                '"task": {"type": "worker", "index": 0}}')
        try:
            config = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise _fail("TF_CONFIG", "a JSON object", f"{_show(text)} ({exc})", hint) from None
        if not isinstance(config, dict):
            raise _fail("TF_CONFIG", "a JSON object", _show(config), hint)
        cluster, task = config.get("cluster"), config.get("task")
        if not isinstance(cluster, dict):
            raise _fail("TF_CONFIG['cluster']", "an object of host lists", _show(cluster), hint)
        if not isinstance(task, dict):
            raise _fail("TF_CONFIG['task']", "an object with 'type' and 'index'", _show(task), hint)
        jobs: dict[str, list[str]] = {}
        for job, hosts in cluster.items():
            if job not in TASK_TYPES:
                raise _fail("TF_CONFIG['cluster']", "jobs among " + ", ".join(TASK_TYPES),
                            f"job {_show(job)}",
                            "TF1's 'master' is called 'chief'" if job == "master" else hint)
            if not isinstance(hosts, list):
                raise _fail(f"TF_CONFIG['cluster'][{job!r}]", "a list of 'host:port' strings",
                            _show(hosts), hint)
            jobs[f"{job}_hosts"] = hosts
        try:
            return cls(task.get("type"), task.get("index", 0), **jobs)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise ConfigError(f"TF_CONFIG: {exc}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TaskSpec:
        """Describe this process as a task, from ``TF_CONFIG`` or the launcher's environment.

        A non-blank ``TF_CONFIG`` is authoritative (its rank must agree with any launcher
        variables also present). Otherwise :func:`detect` runs and ranks below ``num_ps``
        (``PARLAY_NUM_PS``, set by ``parlay run --ps K``) become ps with index = rank, the
        others workers with index = rank - K. Those host lists are informational: rank ``r`` is
        given ``f"{master_addr}:{master_port + r}"`` (master port default
        :data:`DEFAULT_MASTER_PORT`, master host default ``localhost``, ports past 65535 wrap to
        1024 and up). With no environment at all this is worker 0 of ``("localhost:29500",)``.

        Args:
            environ: Environment mapping; ``None`` reads ``os.environ``.

        Returns:
            The task of this process.

        Raises:
            ConfigError: Whatever :func:`detect` or :meth:`from_tf_config` rejects, a world too
                large for distinct made-up ports, or ``TF_CONFIG`` disagreeing with the launcher.
        """
        from parlay.env import detect  # env builds on this module

        env = os.environ if environ is None else environ
        text = env.get("TF_CONFIG", "")
        if text.strip():
            spec = cls.from_tf_config(text)
            if spec.rank is not None:
                found = detect(env)
                if (found.rank, found.world_size) != (spec.rank, spec.world_size):
                    raise _fail("TF_CONFIG", f"the rank the launcher gives ({found.source}: rank "
                                f"{found.rank} of {found.world_size})",
                                f"rank {spec.rank} of {spec.world_size}",
                                "unset TF_CONFIG or the launcher's variables")
            return spec
        found = detect(env)
        if found.world_size > _SYNTH_PORTS:
            raise _fail("world size", f"at most {_SYNTH_PORTS} ranks to make up distinct ports",
                        str(found.world_size), "set TF_CONFIG with real addresses instead")
        host = "localhost" if found.source == "single" else found.master_addr or "localhost"
        base = found.master_port or DEFAULT_MASTER_PORT
        hosts = []
        for r in range(found.world_size):
            port = base + r if base + r <= 65535 else 1024 + (base + r - 65536) % _SYNTH_PORTS
            hosts.append(_join(host, port))
        k = found.num_ps
        if found.rank < k:
            return cls("ps", found.rank, ps_hosts=hosts[:k], worker_hosts=hosts[k:])
        return cls("worker", found.rank - k, ps_hosts=hosts[:k], worker_hosts=hosts[k:])


#: TensorLayer's name for the same class (``tl.distributed.TaskSpecDef``).
TaskSpecDef = TaskSpec


def create_task_spec_def(environ: Mapping[str, str] | None = None) -> TaskSpec:
    """TensorLayer's ``create_task_spec_def()``: this process's task, from ``TF_CONFIG`` or
    the launcher's environment (torchrun, SLURM, MPI). Same as :meth:`TaskSpec.from_env`."""
    return TaskSpec.from_env(environ)
