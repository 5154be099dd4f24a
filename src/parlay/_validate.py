"""Validators shared by :mod:`parlay.discovery` and :mod:`parlay.taskspec` (internal).

Values from the environment and from users' cluster descriptions are checked here once, with
messages that say what was expected, what was found and how to fix it: integers and indices,
``host:port`` addresses, a TensorFlow-style cluster (the rules of
:class:`~parlay.taskspec.TaskSpec`), ``TF_CONFIG`` documents and SLURM hostlists. Both modules
import this one and neither imports the other's internals, so the import graph runs one way:
``taskspec -> discovery -> _validate -> errors``.

This module imports neither torch nor any other parlay module except :mod:`parlay.errors`.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import operator
import re
from collections.abc import Mapping, Sequence

from parlay.errors import ConfigError

__all__ = ["TASK_TYPES", "DEFAULT_MASTER_PORT", "show", "fail", "check_host", "parse_address",
           "join_address", "as_index", "check_int", "check_below", "int_var", "need_var",
           "port_var", "addr_var", "ceil_div", "local_sizes", "check_task", "cluster_order",
           "rank_of", "read_tf_config", "tasks_on", "parse_nodelist", "first_node",
           "expand_nodelist"]

#: Task types in rank order (evaluators last: they have no rank).
TASK_TYPES = ("ps", "chief", "worker", "evaluator")
#: torchrun's default rendezvous port; the base of the ports :meth:`TaskSpec.from_env` makes up.
DEFAULT_MASTER_PORT = 29500
INT = re.compile(r"\s*(-?[0-9]{1,18})\s*")  # bounded: int() refuses 4300+ digit strings
PORT = re.compile(r"[0-9]{1,5}")
RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
NODE = re.compile(r"(?:[^\[\],\s]+|\[[^\[\]]*\])+")  # one hostlist name: text and [groups]

#: The longest timeout parlay takes, seconds (~115 days): beyond it timedelta overflows.
MAX_TIMEOUT_S = 1e7


def show(value: object) -> str:
    """``repr(value)`` cut to 80 characters, for messages (never raises on deep nesting)."""
    try:
        text = repr(value)
    except RecursionError:  # a deeply nested TF_CONFIG value
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def fail(subject: str, expected: str, got: str, hint: str) -> ConfigError:
    """The error every check raises: ``"<subject>: expected ..., got .... Hint: ..."``."""
    return ConfigError(f"{subject}: expected {expected}, got {got}. Hint: {hint}")


def check_host(host: str, subject: str) -> str:
    """Validate a bare host name or address (``[::1]`` is unbracketed); return it."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "[]/,@" or not c.isprintable() for c in host):
        raise fail(subject, "a host name or IP address", show(host),
                   "use a name such as 'node0', an IPv4 address or an IPv6 address")
    if ":" in host:  # only an IPv6 address holds ':'; 'node0:29500' holds a port
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            port = {"MASTER_ADDR": "MASTER_PORT", "master_addr": "master_port"}.get(subject)
            raise fail(subject, "a host without a port (only an IPv6 address holds ':')",
                       show(host), f"put the port in {port}" if port else
                       "drop the port here, or write a valid IPv6 address") from None
    return host


def parse_address(address: object, subject: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6addr]:port"``) into host and port, validating both."""
    if not isinstance(address, str):
        raise fail(subject, "a 'host:port' string", f"{type(address).__name__} {show(address)}",
                   "write each address as a string such as 'node0:2222'")
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise fail(subject, "'[ipv6]:port'", show(address), "write e.g. '[::1]:2222'")
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            raise fail(subject, "'host:port'", show(address), "add the port, e.g. 'node0:2222'")
        if ":" in host:
            raise fail(subject, "'host:port'", show(address),
                       "put IPv6 addresses in brackets, e.g. '[::1]:2222'")
    host = check_host(host, f"{subject} {show(address)}")
    if not PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise fail(subject, "a port number in 1..65535 after the last ':'", show(address),
                   "write e.g. 'node0:2222'")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """``"host:port"``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def as_index(value: object, subject: str) -> int:
    """``value`` as an int (any ``__index__`` type; not bool or float), else a ConfigError."""
    if isinstance(value, bool) or isinstance(value, float):
        raise fail(subject, "an int", f"{type(value).__name__} {show(value)}", "pass e.g. 0")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise fail(subject, "an int", f"{type(value).__name__} {show(value)}",
                   "pass e.g. 0") from None


def digits_as_int(value: object) -> object:
    """An index given as text (``"1"``, as TensorFlow and TensorLayer read it with ``int()``)
    as an int; anything else unchanged, for :func:`check_task` to check and name."""
    return int(value) if isinstance(value, str) and INT.fullmatch(value) else value


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` when it is an int (not a bool) in ``[low, high]`` (no upper bound without
    ``high``); else a ConfigError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name} must be an int {span}, got {value!r}.")
    return value


def check_below(name: str, value: int, bound_name: str, bound: int, hint: str) -> None:
    """Raise a ConfigError unless ``0 <= value < bound``."""
    if not 0 <= value < bound:
        raise fail(name, f"0 <= {name} < {bound_name} ({bound})", str(value), hint)


# -- environment variables -----------------------------------------------------------------------

def int_var(env: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    """The integer value of ``env[name]``, ``None`` when absent."""
    if name not in env:
        return None
    raw = env[name]
    m = INT.fullmatch(raw) if isinstance(raw, str) else None
    if m is None:
        raise fail(name, "an integer", show(raw), f"set {name} to a number or unset it")
    value = int(m.group(1))
    if value < minimum:
        raise fail(name, f"an integer >= {minimum}", str(value), f"fix or unset {name}")
    return value


def need_var(env: Mapping[str, str], name: str, present: Sequence[str], minimum: int = 0) -> int:
    """Like :func:`_int_var` but the variable must be there because ``present`` ones are."""
    value = int_var(env, name, minimum)
    if value is None:
        have = ", ".join(n for n in present if n in env)
        raise ConfigError(f"{name} is missing: expected it because {have} is set. Hint: set "
                          f"{name} too, or unset {have} (a partial environment is never guessed).")
    return value


def port_var(env: Mapping[str, str], name: str = "MASTER_PORT") -> int | None:
    """The port in ``env[name]``, ``None`` when absent."""
    value = int_var(env, name, minimum=1)
    if value is not None and value > 65535:
        raise fail(name, "a port in 1..65535", str(value), f"fix {name}")
    return value


def addr_var(env: Mapping[str, str], name: str = "MASTER_ADDR") -> str | None:
    """The host in ``env[name]``, ``None`` when absent."""
    return check_host(str(env[name]).strip(), name) if name in env else None


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up."""
    return -(-a // b)


def local_sizes(rank: int, world: int, local_rank: int | None, local_world: int | None,
                 where: str) -> tuple[int, int]:
    """Default local rank/size: one process per node without a local rank, else one node."""
    if local_rank is None:
        local_rank, local_world = 0, local_world or 1
    elif local_world is None:
        local_world = world
    if local_world > world:
        raise fail(f"{where} local world size", f"<= world size {world}", str(local_world),
                   "a node cannot hold more processes than the world")
    if local_rank >= local_world:
        raise fail(f"{where} local rank", f"< local world size {local_world}", str(local_rank),
                   "local ranks count from 0 on each node")
    return local_rank, local_world


# -- a TensorFlow-style cluster ------------------------------------------------------------------

def check_task(task_type: object, index: object,
               hosts: Mapping[str, object]) -> tuple[int, dict[str, tuple[str, ...]]]:
    """Check one task of a TF-style cluster: the rules of :class:`~parlay.taskspec.TaskSpec`.

    Args:
        task_type: ``"ps"``, ``"chief"``, ``"worker"`` or ``"evaluator"``.
        index: Index of the task within its type's host list.
        hosts: Host lists by task type (missing types have none).

    Returns:
        The index as an int and every type's host list as a tuple (all four types present).

    Raises:
        ConfigError: An unknown task type, a bad or out-of-range index, a malformed or
            duplicated address, more than one chief, or no worker and no chief.
    """
    if not isinstance(task_type, str) or task_type not in TASK_TYPES:
        hint = ("TF1's 'master' is called 'chief' here" if task_type == "master"
                else "use one of " + ", ".join(repr(t) for t in TASK_TYPES))
        raise fail("task_type", "one of " + ", ".join(TASK_TYPES), show(task_type), hint)
    seen: dict[tuple[str, int], str] = {}
    out: dict[str, tuple[str, ...]] = {}
    for job in TASK_TYPES:
        name = f"{job}_hosts"
        given = hosts.get(job, ()) or ()
        if isinstance(given, str):  # TensorLayer's comma-separated form
            given = [h.strip() for h in given.split(",") if h.strip()]
        if not isinstance(given, Sequence) or isinstance(given, bytes):
            raise fail(name, "a list of 'host:port' strings (or one comma-separated string)",
                       f"{type(given).__name__} {show(given)}", f"e.g. {name}=['node0:2222']")
        out[job] = tuple(given)
        for i, address in enumerate(out[job]):
            host, port = parse_address(address, f"{name}[{i}]")
            key = (host.lower(), port)
            if key in seen:
                raise fail(f"{name}[{i}]", "every address used once",
                           f"{show(address)} again (already {seen[key]})",
                           "give each task its own host:port")
            seen[key] = f"{name}[{i}]"
    if len(out["chief"]) > 1:
        raise fail("chief_hosts", "at most one chief", f"{len(out['chief'])} hosts",
                   "list the extra hosts in worker_hosts")
    if not out["worker"] and not out["chief"]:
        raise fail("worker_hosts", "at least one worker (or a chief)", "none",
                   "list the training hosts in worker_hosts")
    i = as_index(index, "index")
    count = len(out[task_type])
    if task_type == "evaluator" and count == 0:
        count = 1  # TF evaluators may stand outside the cluster spec entirely
    check_below("index", i, f"len({task_type}_hosts)", count,
                f"a {task_type} index counts from 0 within {task_type}_hosts")
    return i, out


def cluster_order(hosts: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """Addresses of the training world in rank order: ps, chief, workers (no evaluators)."""
    return (*hosts.get("ps", ()), *hosts.get("chief", ()), *hosts.get("worker", ()))


def rank_of(task_type: str, index: int, hosts: Mapping[str, Sequence[str]]) -> int | None:
    """Global rank of a (checked) task; ``None`` for an evaluator. Parameter servers come
    first, then the chief, then the workers."""
    if task_type == "evaluator":
        return None
    ps, chief = len(hosts.get("ps", ())), len(hosts.get("chief", ()))
    return {"ps": 0, "chief": ps, "worker": ps + chief}[task_type] + index


def read_tf_config(text: str) -> tuple[str, int, dict[str, tuple[str, ...]]] | None:
    """Parse and check a ``TF_CONFIG`` JSON document.

    Args:
        text: ``{"cluster": {"ps": [...], "chief": [...], "worker": [...]},
            "task": {"type": "worker", "index": 0}}``; a missing index means 0.

    Returns:
        ``(task_type, index, hosts)`` as :func:`check_task` returns them; ``None`` when the
        document has no cluster (absent, ``null`` or ``{}``): TensorFlow's local mode, one
        process, as if ``TF_CONFIG`` were unset.

    Raises:
        ConfigError: Invalid JSON, a wrong structure or an invalid cluster; without a cluster,
            a task other than worker (or chief) 0.
    """
    hint = ('write e.g. {"cluster": {"worker": ["w0:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise fail("TF_CONFIG", "a JSON object", f"{show(text)} ({exc})", hint) from None
    if not isinstance(config, dict):
        raise fail("TF_CONFIG", "a JSON object", show(config), hint)
    cluster, task = config.get("cluster"), config.get("task")
    if cluster is None or cluster == {}:  # TensorFlow's local mode: this one process alone
        task = {} if task is None else task
        if not isinstance(task, dict) or task.get("type", "worker") not in (
                "worker", "chief", "master") or digits_as_int(task.get("index", 0)) != 0:
            raise fail("TF_CONFIG['task']", "no task or worker 0 without a 'cluster' "
                       "(TensorFlow's local mode)", show(task),
                       "add the cluster's host lists to TF_CONFIG, or drop its 'task'")
        return None
    if not isinstance(cluster, dict):
        raise fail("TF_CONFIG['cluster']", "an object of host lists", show(cluster), hint)
    if not isinstance(task, dict):
        raise fail("TF_CONFIG['task']", "an object with 'type' and 'index'", show(task), hint)
    if "master" in cluster:  # TF1's (Cloud ML Engine's) name for the chief, as TensorLayer read it
        if "chief" in cluster:
            raise fail("TF_CONFIG['cluster']", "one of 'master' (TF1) or 'chief'", "both",
                       "name the chief once")
        cluster = {("chief" if job == "master" else job): h for job, h in cluster.items()}
        if task.get("type") == "master":
            task = {**task, "type": "chief"}
    for job, hosts in cluster.items():
        if job not in TASK_TYPES:
            raise fail("TF_CONFIG['cluster']", "jobs among " + ", ".join(TASK_TYPES),
                       f"job {show(job)}", hint)
        if not isinstance(hosts, list):
            raise fail(f"TF_CONFIG['cluster'][{job!r}]", "a list of 'host:port' strings",
                       show(hosts), hint)
    try:
        index, checked = check_task(task.get("type"), digits_as_int(task.get("index", 0)),
                                    cluster)
    except ConfigError as exc:
        raise ConfigError(f"TF_CONFIG: {exc}") from None
    return task["type"], index, checked


# -- SLURM hostlists and task counts -------------------------------------------------------------

def tasks_on(node: int | None, counts: str | None) -> int | None:
    """Node ``node``'s entry of SLURM's per-node task counts (``"2(x3),1"``), if readable."""
    per_node: list[int] = []
    for part in (counts or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        per_node += [int(m[1])] * int(m[2] or 1)
    return per_node[node] if node is not None and node < len(per_node) else None


def parse_nodelist(text: str) -> list[list[str | list[tuple[int, int, int]]]]:
    """Validate a SLURM hostlist; for each name, its literal parts and bracket groups."""
    names: list[list[str | list[tuple[int, int, int]]]] = []
    pos = 0
    while True:
        m = NODE.match(text, pos)
        if m is None:
            raise fail("SLURM nodelist", "names like 'node[01-04,07],gpu3'", show(text),
                       f"near character {pos}: no empty names or spaces, brackets balanced "
                       "and not nested")
        parts: list[str | list[tuple[int, int, int]]] = []
        for i, piece in enumerate(re.split(r"\[([^\]]*)\]", m.group())):
            if i % 2 == 0:  # re.split alternates literal text and group contents
                parts += [piece] if piece else []
                continue
            group = []
            for spec in piece.split(","):
                r = RANGE.fullmatch(spec)
                if r is None or int(r.group(1)) > int(r.group(2) or r.group(1)):
                    raise fail("SLURM nodelist", "ranges 'N' or 'LO-HI' with LO <= HI",
                               f"{show(spec)} in {show(text)}", "e.g. 'node[01-04,07]'")
                group.append((int(r.group(1)), int(r.group(2) or r.group(1)), len(r.group(1))))
            parts.append(group)
        names.append(parts)
        pos = m.end()
        if pos == len(text):
            return names
        if text[pos] != ",":
            raise fail("SLURM nodelist", "',' between names", show(text),
                       f"unexpected {text[pos]!r} at character {pos}")
        pos += 1


def first_node(text: str) -> str:
    """First host of a hostlist, without expanding it (``n[1-99999999]`` stays cheap)."""
    return "".join(p if isinstance(p, str) else str(p[0][0]).zfill(p[0][2])
                   for p in parse_nodelist(text)[0])


def expand_nodelist(s: str) -> list[str]:
    """Expand a SLURM hostlist: ``"node[01-03,07],gpu-[1-2]-x"`` -> ``node01 .. gpu-2-x``.

    Zero padding is kept (the width of each range's first number); several bracket groups in
    one name expand as a product, in order.

    Args:
        s: The hostlist, e.g. the value of ``SLURM_JOB_NODELIST``.

    Returns:
        Host names in SLURM's order.

    Raises:
        ConfigError: Empty names, spaces, unbalanced or nested brackets, or a bad range.
    """
    if not isinstance(s, str):
        raise fail("SLURM nodelist", "a string", show(s), "pass e.g. 'node[01-04]'")
    hosts = []
    for parts in parse_nodelist(s):
        choices = [[p] if isinstance(p, str) else
                   [str(n).zfill(w) for lo, hi, w in p for n in range(lo, hi + 1)] for p in parts]
        hosts += ["".join(name) for name in itertools.product(*choices)]
    return hosts
