"""Command line: ``parlay run | env | demo | bench``.

``parlay run -n N [--ps K] script.py ARGS`` hands the launch to ``torch.distributed.run``
(torchrun's elastic agent): parlay adds only the role assignment (the first K ranks are
parameter servers, passed as ``PARLAY_NUM_PS``) and a standalone rendezvous when no multi-node
flags are given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

__all__ = ["main", "build_parser", "torchrun_argv"]

# torchrun flags passed through unchanged (value-taking).
_PASSTHROUGH = ["--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
                "--rdzv-conf", "--max-restarts", "--master-addr", "--master-port",
                "--monitor-interval", "--log-dir", "--redirects", "--tee", "--local-addr"]


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc-per-node", "--np", dest="nproc", type=int, default=None,
                   help="processes to start on this node (default: 1)")
    p.add_argument("--ps", type=int, default=0,
                   help="number of parameter-server ranks (the first K global ranks)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages per replica for mode='hybrid' (sets PARLAY_PP)")
    for flag in _PASSTHROUGH:
        p.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"), default=None,
                       help="passed to torchrun")


def torchrun_argv(ns: argparse.Namespace, target: list[str]) -> list[str]:
    """The ``torch.distributed.run`` argument list for parsed launch options.

    Args:
        ns: Parsed options of :func:`_add_launch_args`.
        target: ``[script, *args]`` or ``["-m", module, *args]``.

    Returns:
        Arguments for ``torch.distributed.run.main``.
    """
    nproc = ns.nproc if ns.nproc is not None else 1
    if nproc < 1:
        raise SystemExit(f"parlay run: -n must be >= 1, got {nproc}")
    argv = ["--nproc-per-node", str(nproc)]
    multi_node = any(getattr(ns, f.lstrip("-").replace("-", "_")) is not None
                     for f in ("--nnodes", "--rdzv-endpoint", "--master-addr"))
    if not multi_node:
        argv.append("--standalone")
    for flag in _PASSTHROUGH:
        v = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if v is not None:
            argv += [flag, str(v)]
    if ns.ps < 0:
        raise SystemExit(f"parlay run: --ps must be >= 0, got {ns.ps}")
    if ns.ps and ns.nnodes is None and ns.ps >= nproc:
        raise SystemExit(f"parlay run: --ps {ns.ps} leaves no worker among {nproc} processes; "
                         f"use -n {ns.ps + 1} or more")
    return argv + target


def _cmd_run(ns: argparse.Namespace, rest: list[str]) -> int:
    if not rest:
        raise SystemExit("parlay run: missing the script to run, e.g. parlay run -n 2 train.py")
    return _launch(ns, rest)


def _launch(ns: argparse.Namespace, target: list[str]) -> int:
    from torch.distributed import run as torchrun

    os.environ["PARLAY_NUM_PS"] = str(ns.ps)
    if ns.pp is not None:
        if ns.pp < 1:
            raise SystemExit(f"parlay run: --pp must be >= 1, got {ns.pp}")
        os.environ["PARLAY_PP"] = str(ns.pp)
    argv = torchrun_argv(ns, target)
    try:
        torchrun.main(argv)
    except SystemExit as e:  # torchrun exits through SystemExit on failure
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except Exception as e:  # ChildFailedError: torchrun already printed the rank's traceback
        print(f"parlay run: {type(e).__name__}: a rank failed (see above)", file=sys.stderr)
        return 1
    return 0


def _cmd_env(ns: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from parlay.env import detect
    from parlay.errors import ConfigError

    try:
        c = detect()
    except ConfigError as e:
        print(f"parlay env: {e}", file=sys.stderr)
        return 2
    info = dict(rank=c.rank, world_size=c.world_size, local_rank=c.local_rank,
                local_world_size=c.local_world_size, node_rank=c.node_rank,
                num_nodes=c.num_nodes, role=c.role, num_ps=c.num_ps, source=c.source,
                master=f"{c.master_addr}:{c.master_port}",
                backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                device=f"cuda:{c.local_rank}" if torch.cuda.is_available() else "cpu",
                torch=torch.__version__)
    if ns.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:>16}: {v}")
    return 0


def _cmd_demo(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.name != "mnist":
        raise SystemExit(f"parlay demo: unknown demo {ns.name!r}; available: mnist")
    if ns.nproc is None:
        ns.nproc = 2
    return _launch(ns, ["-m", "parlay.demos.mnist", *rest])


def _cmd_bench(ns: argparse.Namespace, rest: list[str]) -> int:
    import runpy

    path = os.path.join("benchmarks", f"{ns.name}.py")
    if not os.path.exists(path):
        raise SystemExit(f"parlay bench: no benchmark {path}; run it from the repository root")
    sys.argv = [path, *rest]
    runpy.run_path(path, run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``parlay`` argument parser (sub-commands run, env, demo, bench)."""
    parser = argparse.ArgumentParser(prog="parlay", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="launch a script on N processes (torchrun underneath)")
    _add_launch_args(p_run)
    p_env = sub.add_parser("env", help="print the cluster parlay detects here")
    p_env.add_argument("--json", action="store_true")
    p_demo = sub.add_parser("demo", help="run a demo, e.g. parlay demo mnist -n 2")
    p_demo.add_argument("name")
    _add_launch_args(p_demo)
    p_bench = sub.add_parser("bench", help="run benchmarks/NAME.py")
    p_bench.add_argument("name")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``parlay`` console script."""
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    # Everything after the script (or demo name) belongs to it, not to us.
    ns, rest = _split_parse(parser, args)
    handler = {"run": _cmd_run, "env": _cmd_env, "demo": _cmd_demo, "bench": _cmd_bench}[ns.cmd]
    return handler(ns, rest)


def _split_parse(parser: argparse.ArgumentParser,
                 args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if args and args[0] == "run":
        # First positional (not an option value) starts the target: script or -m module.
        i = 1
        takes_value = {"-n", "--nproc-per-node", "--np", "--ps", "--pp", *_PASSTHROUGH}
        while i < len(args):
            a = args[i]
            if a in ("-m", "--module"):
                return parser.parse_args(args[:i]), ["-m", *args[i + 1:]]
            if a.startswith("-"):
                i += 1 if "=" in a or a not in takes_value else 2
                continue
            return parser.parse_args(args[:i]), args[i:]
        return parser.parse_args(args), []
    ns, rest = parser.parse_known_args(args)
    return ns, rest


if __name__ == "__main__":
    sys.exit(main())
