"""Command line: ``parlay run | env | demo | bench | plan``.

``parlay run -n N [--ps K] script.py ARGS`` hands the launch to ``torch.distributed.run``
(torchrun's elastic agent): parlay adds the role assignment (the first K ranks are parameter
servers, passed as ``PARLAY_NUM_PS``), a loopback-only rendezvous on one node, a policy for
droppable parameter-server workers and legible launcher errors (see :mod:`parlay.launch`).
Input that can be checked before any process starts is checked first (:func:`check_launch`,
:func:`check_demo`), so a typo costs a message, not a launch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Sequence

__all__ = ["main", "build_parser", "torchrun_argv", "check_launch", "check_demo"]

# torchrun flags passed through unchanged (value-taking).
_PASSTHROUGH = ["--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
                "--rdzv-conf", "--max-restarts", "--master-addr", "--master-port",
                "--monitor-interval", "--log-dir", "--redirects", "--tee", "--local-addr"]
# Flags that make the launch multi-node (or otherwise not parlay's loopback rendezvous), as
# does an --nnodes other than 1 / 1:1.
_MULTI_NODE = ("--rdzv-endpoint", "--master-addr", "--rdzv-backend")
# Flags only the loopback rendezvous consumes itself (never forwarded on one node).
_LOCAL_ONLY = ("--master-port", "--local-addr", "--rdzv-id", "--nnodes")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc-per-node", "--np", dest="nproc", type=int, default=None,
                   help="processes to start on this node (default: 1)")
    p.add_argument("--ps", type=int, default=0,
                   help="number of parameter-server ranks (the first K global ranks)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages per replica for mode='hybrid' (exported as PARLAY_PP: "
                   "the default stage count of mode='hybrid' in the launched script)")
    for flag in _PASSTHROUGH:
        p.add_argument(flag, dest=_dest(flag), default=None, help="passed to torchrun")


class Refusal(SystemExit):
    """Input a command cannot use, refused before anything starts: :func:`main` prints the
    message on stderr and the exit status is 2, as argparse's usage errors."""

    def __init__(self, msg: str) -> None:
        super().__init__(2)
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


def _fail(msg: str) -> SystemExit:
    return Refusal(f"parlay: {msg}")


def _int_flag(ns: argparse.Namespace, flag: str, low: int, high: int | None = None) -> None:
    raw = getattr(ns, _dest(flag))
    if raw is None:
        return
    try:
        v = int(raw)
    except ValueError:
        raise _fail(f"{flag} must be an integer, got {raw!r}.") from None
    if v < low or (high is not None and v > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise _fail(f"{flag} must be {bounds}, got {v}.")


def check_launch(ns: argparse.Namespace) -> None:
    """Check the launch options before any process starts.

    Raises:
        SystemExit: A message naming the bad option, what was expected and the fix.
    """
    nproc = ns.nproc if ns.nproc is not None else 1
    if nproc < 1:
        raise _fail(f"-n must be >= 1, got {nproc}. Hint: -n 2 starts two processes.")
    if ns.ps < 0:
        raise _fail(f"--ps must be >= 0, got {ns.ps}.")
    _int_flag(ns, "--max-restarts", 0)
    _int_flag(ns, "--master-port", 0, 65535)
    if str(ns.nnodes or "").isdigit() and int(ns.nnodes) >= 1:
        _int_flag(ns, "--node-rank", 0, int(ns.nnodes) - 1)
    single = ns.nnodes is None or str(ns.nnodes) in ("1", "1:1")
    if ns.ps and single and ns.ps >= nproc:
        raise _fail(f"--ps {ns.ps} leaves no worker among {nproc} processes; use -n "
                    f"{ns.ps + 1} or more (parameter servers plus at least one worker).")
    if ns.pp is not None:
        if ns.pp < 1:
            raise _fail(f"--pp must be >= 1, got {ns.pp}.")
        nodes = str(ns.nnodes or 1)
        world = nproc * int(nodes) if nodes.isdigit() else None  # "1:4": elastic, unknown
        if world is not None and (world < ns.pp or world % ns.pp):
            fix = max(ns.pp, -(-world // ns.pp) * ns.pp)
            raise _fail(f"--pp {ns.pp} needs a world size that is a multiple of {ns.pp} and at "
                        f"least {ns.pp} (stages x replicas), got {world}. Hint: -n {fix}.")
    from parlay._validate import MAX_TIMEOUT_S

    raw = os.environ.get("PARLAY_TIMEOUT")
    if raw is not None:
        try:
            ok = 0 < float(raw) <= MAX_TIMEOUT_S
        except ValueError:
            ok = False
        if not ok:
            raise _fail(f"PARLAY_TIMEOUT must be a positive number of seconds up to "
                        f"{MAX_TIMEOUT_S:g}, got {raw!r}. "
                        "Hint: export PARLAY_TIMEOUT=300")


def torchrun_argv(ns: argparse.Namespace, target: list[str]) -> list[str]:
    """The ``torch.distributed.run`` argument list for parsed launch options.

    On one node (none of ``--rdzv-endpoint``, ``--rdzv-backend``, ``--master-addr``, and
    ``--nnodes`` absent, 1 or 1:1) the rendezvous is parlay's loopback backend on ``127.0.0.1``, at
    ``--master-port`` when given, else on a free port.

    Args:
        ns: Parsed options of :func:`_add_launch_args`.
        target: ``[script, *args]`` or ``["-m", module, *args]``.

    Returns:
        Arguments for ``torch.distributed.run.main``.
    """
    from parlay.launch import LOOPBACK_BACKEND, launcher_wait_s

    check_launch(ns)
    nproc = ns.nproc if ns.nproc is not None else 1
    argv = ["--nproc-per-node", str(nproc)]
    multi_node = str(ns.nnodes or 1) not in ("1", "1:1") or any(
        getattr(ns, _dest(f)) is not None for f in _MULTI_NODE)
    if not multi_node:
        argv += ["--nnodes", "1", "--rdzv-backend", LOOPBACK_BACKEND,
                 "--rdzv-endpoint", f"127.0.0.1:{ns.master_port or 0}",
                 "--rdzv-id", ns.rdzv_id or uuid.uuid4().hex, "--local-addr", "127.0.0.1"]
    for flag in _PASSTHROUGH:
        v = getattr(ns, _dest(flag))
        if v is not None and (multi_node or flag not in _LOCAL_ONLY):
            argv += [flag, str(v)]
    if multi_node and ns.rdzv_conf is None:  # torchrun waits 600 s for missing nodes
        wait = launcher_wait_s()  # read_timeout: c10d's store connect (60 s, then again)
        argv += ["--rdzv-conf", f"join_timeout={wait},timeout={wait},read_timeout={wait}"]
    return argv + target


def _cmd_run(ns: argparse.Namespace, rest: list[str]) -> int:
    if not rest:
        raise _fail("run: missing the script to run, e.g. parlay run -n 2 train.py")
    return _launch(ns, rest)


def _launch_env(ns: argparse.Namespace, single_node: bool, run_dir: str) -> dict[str, str]:
    env = {"PARLAY_NUM_PS": str(ns.ps), "PARLAY_RUN_DIR": run_dir,
           "PARLAY_LAUNCHER_PID": str(os.getpid())}  # ranks die with this process
    if ns.pp is not None:
        env["PARLAY_PP"] = str(ns.pp)
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") \
        else set()
    if single_node and "GLOO_SOCKET_IFNAME" not in os.environ and "lo" in names:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own listening sockets stay on loopback too
    return env


def _launch(ns: argparse.Namespace, target: list[str]) -> int:
    from parlay.launch import run_torchrun

    argv = torchrun_argv(ns, target)
    single_node = "--local-addr" in argv and "127.0.0.1" in argv
    run_dir = tempfile.mkdtemp(prefix="parlay-run-")
    env = _launch_env(ns, single_node, run_dir)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # An id generated here is this job's alone: its snapshots go when the job does.
    own_id = argv[argv.index("--rdzv-id") + 1] if single_node and not ns.rdzv_id else None
    try:
        return run_torchrun(argv, run_dir, own_id)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(run_dir, ignore_errors=True)


def _cmd_env(ns: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from parlay import runtime
    from parlay.env import detect
    from parlay.errors import ConfigError

    try:
        c = detect()
    except ConfigError as e:
        print(f"parlay env: {e}", file=sys.stderr)
        return 2
    backend, device = runtime.resolve_backend("auto", c.local_rank)    # as parlay.init() picks
    info = dict(rank=c.rank, world_size=c.world_size, local_rank=c.local_rank,
                local_world_size=c.local_world_size, node_rank=c.node_rank,
                num_nodes=c.num_nodes, role=c.role, num_ps=c.num_ps, source=c.source,
                pipeline_stages=c.pipeline_stages, master=f"{c.master_addr}:{c.master_port}",
                backend=backend, device=str(device), torch=torch.__version__)
    if ns.json:  # one write: the ranks of a host share the launcher's (unbuffered) stdout
        sys.stdout.write(json.dumps(info) + "\n")
    else:
        for k, v in info.items():
            print(f"{k:>16}: {v}")
    return 0


def _cmd_demo(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.name is None and ns.help:
        print("parlay demo NAME [launch options] [demo options]\n\ndemos: mnist (parlay demo "
              "mnist --help for its options)")
        return 0
    if ns.name is None:
        raise _fail("demo: name a demo, e.g. parlay demo mnist -n 2; available: mnist")
    if ns.name != "mnist":
        raise _fail(f"demo: unknown demo {ns.name!r}; available: mnist")
    from parlay.demos import mnist

    if ns.help:
        print("parlay demo mnist [launch options] [demo options]\n\nlaunch options: -n N, "
              "--ps K, --pp P, --max-restarts R, --master-port PORT and the other torchrun "
              "flags of `parlay run --help`.\n")
        mnist.parse_args(["--help"])  # prints the demo's own options and exits 0
    if ns.nproc is None:
        ns.nproc = 2
    demo = mnist.parse_args(rest)  # the demo's own parser: bad options exit here
    check_demo(ns, demo)
    if ns.pp is not None and not any(o.startswith("pp=") for o in demo.option):
        rest = [*rest, "--option", f"pp={ns.pp}"]  # the stage count, explicitly
    return _launch(ns, ["-m", "parlay.demos.mnist", *rest])


def check_demo(ns: argparse.Namespace, demo: argparse.Namespace) -> None:
    """Check the demo's options against the registries and the launch layout, pre-launch.

    Raises:
        SystemExit: A message naming the bad option and the fix.
    """
    check_launch(ns)
    try:
        _check_trainer_options(demo, nproc=ns.nproc or 1, ps=ns.ps, pp=ns.pp,
                               multi_node=ns.nnodes not in (None, "1", "1:1"))
    except ValueError as e:  # ConfigError is a ValueError
        raise _fail(f"demo mnist: {e}") from None
    if demo.json and os.path.isdir(demo.json):
        raise _fail(f"demo mnist: --json {demo.json} is a folder; the metrics would be lost "
                    "after training. Hint: a file name, e.g. --json out.json")
    folder = os.path.dirname(os.path.abspath(demo.json)) if demo.json else None
    if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise _fail(f"demo mnist: --json {demo.json}: no writable folder {folder}; the metrics "
                    "would be lost after training. Hint: an existing folder, e.g. --json out.json")


def _check_trainer_options(demo: argparse.Namespace, *, nproc: int, ps: int, pp: int | None,
                           multi_node: bool) -> None:
    """Names against parlay's registries, numbers against their ranges, layout against mode."""
    from parlay.compress import get_compressor
    from parlay.demos.mnist import _options
    from parlay.dp.shard_units import check_level
    from parlay.env import pipeline_stages
    from parlay.errors import ConfigError
    from parlay.pipeline.schedule import get_schedule
    from parlay.ps.consistency import get_consistency
    from parlay.strategies import available_strategies

    modes = available_strategies()
    if demo.mode not in modes:
        raise ConfigError(f"--mode must be one of {', '.join(modes)}, got {demo.mode!r}.")
    for flag, v, low in (("--batch-size", demo.batch_size, 1), ("--epochs", demo.epochs, 1),
                         ("--workers", demo.workers, 0),
                         ("--warmup-epochs", demo.warmup_epochs, 0)):
        if not low <= v < float("inf"):  # nan and inf too
            raise ConfigError(f"{flag} must be >= {low}, got {v}.")
    if not demo.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {demo.lr}. Hint: --lr 1e-3")
    comp = get_compressor(demo.compression)  # unknown names and bad options: ConfigError
    opts = _options(demo.option)
    if "consistency" in opts:
        get_consistency(str(opts["consistency"]))
    if "schedule" in opts:
        get_schedule(str(opts["schedule"]))
    if demo.mode == "ps" and ps < 1:
        raise ConfigError("--mode ps needs parameter-server ranks. Hint: add --ps 1 "
                          f"(with -n {max(nproc, 2)}: 1 server and {max(nproc, 2) - 1} worker(s)).")
    if getattr(demo, "shard", None) and demo.mode == "ps":
        raise ConfigError("--shard shards data-parallel state; --mode ps shards parameters over "
                          "its servers already. Hint: drop --shard, or use --mode allreduce.")
    if demo.mode == "ps" and callable(getattr(comp, "bind", None)):
        comp.bind(collective=False)  # type: ignore[attr-defined]  # "auto": a candidate fits?
    elif demo.mode == "ps" and not comp.point_to_point:
        raise ConfigError(f"--compression {demo.compression} needs collective rounds (PowerSGD, "
                          "int8) and cannot compress parameter-server pushes. Hint: fp16, bf16, "
                          "topk:0.01 or randomk:0.01.")
    sharded_comp = comp if demo.mode in ("allreduce", "hybrid") else get_compressor(None)
    check_level(getattr(demo, "shard", None), sharded_comp, None)  # type: ignore[arg-type]
    if demo.mode != "ps" and ps:
        raise ConfigError(f"--ps {ps} starts parameter servers, which only --mode ps uses. "
                          "Hint: drop --ps, or add --mode ps.")
    if demo.mode != "hybrid" and (pp is not None or "pp" in opts):
        raise ConfigError("--pp (pipeline stages) only applies to --mode hybrid. "
                          "Hint: drop --pp, or add --mode hybrid.")
    if demo.mode == "hybrid" and not multi_node:
        given = next((v for v in (pp, opts.get("pp"), pipeline_stages()) if v is not None), 2)
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise ConfigError(f"--option pp must be a number of stages >= 1, got {given!r}. "
                              "Hint: --option pp=2")
        stages = given
        if nproc < stages or nproc % stages:
            fix = max(stages, -(-nproc // stages) * stages)
            raise ConfigError(f"--mode hybrid with {stages} pipeline stages needs -n to be a "
                              f"multiple of {stages} (stages x replicas), got -n {nproc}. "
                              f"Hint: -n {fix}, or --pp to change the stage count.")


def _checkout() -> str | None:
    """The source checkout holding ``tools/`` (the working directory, or the one an editable
    install points into), or ``None``: the wheel does not ship the benchmark tools."""
    import parlay

    here = os.path.dirname(os.path.abspath(parlay.__file__))
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(here))):
        if os.path.isfile(os.path.join(root, "tools", "bench", "runner.py")):
            return root
    return None


def _refuse(msg: str) -> int:
    """One line on stderr for input a command cannot use; its exit status (2, as argparse's)."""
    print(f"parlay {msg}", file=sys.stderr)
    return 2


def _cmd_bench(ns: argparse.Namespace, rest: list[str]) -> int:
    import runpy

    root = _checkout()
    if ns.name in (None, "suite"):  # the suite: tools/bench in a source checkout
        if root is None:
            return _refuse("bench: the benchmark suite lives in tools/ of parlay's source "
                           "checkout, which the installed package does not ship. Hint: clone "
                           "parlay's repository, pip install -e '.[bench]' there and run "
                           "parlay bench from its root.")
        if root not in sys.path:
            sys.path.insert(0, root)
        from tools.bench.runner import main as suite  # the checkout's, never the wheel's

        return suite(rest)
    path = os.path.join("benchmarks", f"{ns.name}.py")
    if not os.path.exists(path) and root is not None:
        path = os.path.join(root, "benchmarks", f"{ns.name}.py")
    if not os.path.exists(path):
        known = sorted(f[:-3] for f in os.listdir(os.path.dirname(path) or ".")
                       if f.endswith(".py") and not f.startswith("_")) if root else []
        return _refuse(f"bench: no benchmark benchmarks/{ns.name}.py"
                       + (f"; known: {', '.join(known)}" if known else "; run it from the root "
                          "of parlay's source checkout"))
    sys.argv = [path, *rest]
    runpy.run_path(path, run_name="__main__")
    return 0


def _cmd_plan(ns: argparse.Namespace, rest: list[str]) -> int:
    from parlay.plan.command import run_plan

    ns.script_args = rest  # the --script's own arguments (after --)
    return run_plan(ns)


def build_parser() -> argparse.ArgumentParser:
    """The ``parlay`` argument parser (sub-commands run, env, demo, bench)."""
    parser = argparse.ArgumentParser(prog="parlay", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="launch a script on N processes (torchrun underneath)",
                           usage="parlay run [options] script.py [script args]  (or -m module)")
    _add_launch_args(p_run)
    p_env = sub.add_parser("env", help="print the cluster parlay detects here")
    p_env.add_argument("--json", action="store_true")
    # The demo's own --help is its options, so this parser does not take -h itself.
    p_demo = sub.add_parser("demo", help="run a demo, e.g. parlay demo mnist -n 2",
                            add_help=False)
    p_demo.add_argument("-h", "--help", action="store_true", help="the demo's options")
    p_demo.add_argument("name", nargs="?")
    _add_launch_args(p_demo)
    # Its options are the suite's (tools/bench/runner.py) or NAME's own: parsed there.
    p_bench = sub.add_parser("bench", help="run the benchmark suite (parlay bench --help), or "
                             "benchmarks/NAME.py", add_help=False)
    p_bench.add_argument("name", nargs="?")
    from parlay.plan.command import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``parlay`` console script."""
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    # Everything after the script (or demo name) belongs to it, not to us.
    handler = {"run": _cmd_run, "env": _cmd_env, "demo": _cmd_demo, "bench": _cmd_bench,
               "plan": _cmd_plan}
    try:
        ns, rest = _split_parse(parser, args)
        return handler[ns.cmd](ns, rest)
    except Refusal as e:
        print(e, file=sys.stderr)
        raise
    except BrokenPipeError:  # the reader left (`parlay plan ... | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _split_parse(parser: argparse.ArgumentParser,
                 args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if args and args[0] == "run":
        # First positional (not an option value) starts the target: script or -m module.
        i = 1
        takes_value = {"-n", "--nproc-per-node", "--np", "--ps", "--pp", *_PASSTHROUGH}
        while i < len(args):
            a = args[i]
            if a in ("-m", "--module"):
                if i + 1 == len(args):
                    raise _fail("run: -m needs a module, e.g. parlay run -n 2 -m pkg.train")
                return parser.parse_args(args[:i]), ["-m", *args[i + 1:]]
            if a == "--":  # the conventional end of options: the script follows
                return parser.parse_args(args[:i]), args[i + 1:]
            if a.startswith("-"):
                i += 1 if "=" in a or a not in takes_value else 2
                continue
            return parser.parse_args(args[:i]), args[i:]
        return parser.parse_args(args), []
    if args and args[0] == "bench":
        # NAME, when given, comes first; everything else is the suite's or NAME's.
        named = len(args) > 1 and not args[1].startswith("-")
        return parser.parse_args(args[:2] if named else args[:1]), args[2 if named else 1:]
    if args and args[0] == "plan":
        cut = args.index("--") if "--" in args else len(args)
        return parser.parse_args(args[:cut]), args[cut + 1:]
    if args and args[0] == "env":  # takes no arguments of its own beyond its flags
        return parser.parse_args(args), []
    ns, rest = parser.parse_known_args(args)
    return ns, rest


if __name__ == "__main__":
    sys.exit(main())
