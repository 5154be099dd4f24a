"""Import contracts (``[tool.importlinter]`` in pyproject.toml), checked with import-linter.

The contracts hold today: every module belongs to one of parlay's parts (horovod, face, plan,
trainer, modes, recovery, compress, data, runtime) and the parts import one way, top to bottom;
``tools/`` sits above parlay; ``parlay.horovod`` is a leaf; the modes (``dp``, ``ps``,
``pipeline``) never import each other (except pipeline -> dp). The linter runs in a
fresh interpreter (it imports nothing of parlay; it parses the sources), and a deliberately
broken contract of each type must be reported, so the check cannot pass because the linter saw
nothing.

No import cycle exists among parlay's modules, in the graph the linter itself builds (grimp's,
function-level imports included), and a cycle added to that graph is reported. Importing a
parlay module by a string (``importlib.import_module``) hides an edge from both checks, so it is
allowed nowhere.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib  # Python 3.11+, as import-linter 2.17 itself needs
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

_RUN = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def _lint(config: Path) -> subprocess.CompletedProcess[str]:
    try:
        import importlinter  # noqa: F401
    except ImportError:
        pytest.fail("import-linter is not installed. Hint: pip install -e '.[test]'.")
    return subprocess.run([sys.executable, "-c", _RUN, str(config)], cwd=ROOT, text=True,
                          capture_output=True, timeout=100, check=False)


def _ini(tmp_path: Path, contracts: str) -> Path:
    path = tmp_path / "contracts.ini"
    path.write_text("[importlinter]\nroot_package = parlay\n\n" + textwrap.dedent(contracts),
                    encoding="utf-8")
    return path


def test_import_contracts_hold() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    ids = {c["id"] for c in config["tool"]["importlinter"]["contracts"]}
    assert {"tools-outside", "parts", "horovod-leaf", "runtime-one-way",
            "modes-independent"} <= ids
    proc = _lint(ROOT / "pyproject.toml")
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, "an import contract is broken:\n" + report
    assert f"Contracts: {len(ids)} kept, 0 broken." in report, report


# One deliberately broken contract per contract type used above, each on an import that exists
# (dp imports comm; the core imports comm; comm imports errors; the pipeline imports dp).
BROKEN = {
    "protected": ("""
        [importlinter:contract:only-runtime-may-import-comm]
        name = only parlay.runtime may import parlay.comm
        type = protected
        protected_modules = parlay.comm
        allowed_importers = parlay.runtime
        """, "parlay.dp.optimizer -> parlay.comm"),
    "forbidden": ("""
        [importlinter:contract:dp-without-comm]
        name = dp must not import comm
        type = forbidden
        source_modules = parlay.dp
        forbidden_modules = parlay.comm
        """, "parlay.dp.optimizer -> parlay.comm"),
    "layers": ("""
        [importlinter:contract:upside-down]
        name = errors above comm
        type = layers
        layers =
            parlay.errors
            parlay.comm
        """, "parlay.comm -> parlay.errors"),
    "independence": ("""
        [importlinter:contract:pipeline-without-dp]
        name = pipeline and dp independent, no exception
        type = independence
        modules =
            parlay.pipeline
            parlay.dp
        """, "parlay.pipeline.pipe -> parlay.dp."),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_contract_is_reported(kind: str, tmp_path: Path) -> None:
    contract, import_line = BROKEN[kind]
    proc = _lint(_ini(tmp_path, contract))
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0, report
    assert "1 broken" in report and import_line in report, report


def _graph() -> Any:
    """grimp's ImportGraph, as lint-imports builds it (it parses; it imports nothing)."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter: pip install "
                                "-e '.[test]'")
    return grimp.build_graph("parlay", cache_dir=None)


def _cycles(graph: Any) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
    return found


def test_no_import_cycle() -> None:
    graph = _graph()
    assert len(graph.modules) > 50  # the graph holds the package, not an empty shell
    assert graph.direct_import_exists(importer="parlay.runtime", imported="parlay.discovery")
    assert _cycles(graph) == [], "import cycles among parlay's modules (break each by moving " \
        "what both sides need below them)"


def test_an_added_cycle_is_reported() -> None:
    graph = _graph()
    # runtime -> discovery -> errors exist; errors -> runtime closes a three-module cycle.
    graph.add_import(importer="parlay.errors", imported="parlay.runtime")
    cycles = _cycles(graph)
    assert len(cycles) == 1 and {"parlay.errors", "parlay.runtime"} <= set(cycles[0]), cycles


# Where a parlay module may be imported by its name as a string (an edge no graph sees): nowhere.
# The lazy names of parlay/__init__.py and the built-in modes of parlay.strategies load by
# import statements at function level, which the linter and the cycle check both see.
STRING_IMPORTS: set[str] = set()


def test_string_imports_only_where_named() -> None:
    found = set()
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                    or isinstance(node.func, ast.Name) and node.func.id in ("__import__",
                                                                             "import_module")):
                found.add(path.relative_to(ROOT / "src").as_posix())
    assert found <= STRING_IMPORTS, (
        f"string imports in {sorted(found - STRING_IMPORTS)}: the import graph cannot see them, "
        "so a cycle or a broken layer hides there. Import by statement (at function level if "
        "it must be lazy): the linter and test_no_import_cycle see those.")
