"""Static check: no collective in the library reduces a tensor built without a device.

A group created with ``backend="nccl"`` carries CUDA tensors only, so a flag, count or metric
built with ``torch.tensor(...)`` (CPU by default) and handed to ``comm.allreduce`` / ``broadcast``
/ ``allgather`` fails there, although it works on gloo and under ``"auto"``. Such tensors are
built on ``comm.group_device(group)``. This scan finds a collective whose tensor argument is a
``torch.tensor / zeros / ones / empty / full / arange / frombuffer`` call without ``device=``,
either inline or through a name assigned exactly once in the same function (a name assigned
twice is left alone: the scan reports nothing it cannot be sure of).
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "parlay"

_CTORS = {"tensor", "zeros", "ones", "empty", "full", "arange", "frombuffer"}
_COLLECTIVES = {"allreduce", "broadcast", "allgather", "allgather_into", "all_reduce",
                "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_single"}
_TWO_TENSORS = {"allgather_into", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_single"}


def _hostless(node: ast.AST) -> bool:
    """``torch.<constructor>(...)`` without a ``device=`` keyword."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _CTORS and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords))


def _assignments(fn: ast.AST) -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for n in ast.walk(fn):
        targets = (n.targets if isinstance(n, ast.Assign)
                   else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Name):
                out.setdefault(t.id, []).append(getattr(n, "value", None) or n)
    return out


def hostless_collectives(source: str, name: str = "<src>") -> list[str]:
    """``file:line function: call`` for each collective over a tensor built without a device."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned = _assignments(fn)
        for n in ast.walk(fn):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in _COLLECTIVES and isinstance(n.func.value, ast.Name)
                    and n.func.value.id in ("comm", "dist")):
                continue
            for arg in n.args[:2 if n.func.attr in _TWO_TENSORS else 1]:
                once = (assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [])
                if _hostless(arg) or (len(once) == 1 and _hostless(once[0])):
                    found.append(f"{name}:{n.lineno} {fn.name}: {ast.unparse(n)[:80]}")
    return found


def test_every_collective_tensor_is_built_on_the_groups_device() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        found += hostless_collectives(path.read_text(), rel)
    assert not found, ("collectives over tensors built without a device (they fail on a "
                       "NCCL-only group; build them on comm.group_device(group)):\n"
                       + "\n".join(found))


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = '''
def flag(ok, group):
    t = torch.tensor([int(ok)], dtype=torch.int32)
    comm.allreduce(t, "min", group=group)
    dist.all_reduce(torch.zeros(1))
    out = torch.empty(4)
    comm.allgather_into(out, t.to(dev), group=group)
'''
    good = '''
def flag(ok, group):
    t = torch.tensor([int(ok)], device=comm.group_device(group))
    comm.allreduce(t, "min", group=group)
    v = torch.tensor([1.0])
    v = v.to(comm.group_device(group))
    comm.allreduce(v, group=group)
    comm.allreduce(torch.zeros(1).to(dev), group=group)
'''
    found = hostless_collectives(bad)
    assert [f.split(" ")[0] for f in found] == ["<src>:4", "<src>:5", "<src>:7"]
    assert hostless_collectives(good) == []
