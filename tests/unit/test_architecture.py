"""Import contracts (``[tool.importlinter]`` in pyproject.toml), checked with import-linter.

The contracts hold today: ``parlay.horovod`` is a leaf, the runtime knows no mode, the modes
(``dp``, ``ps``, ``pipeline``) import neither each other (except pipeline -> dp) nor the loop
(``parlay.strategies``, ``parlay.trainer``), and the layers run one way. The linter runs in a
fresh interpreter (it imports nothing of parlay; it parses the sources), and a deliberately
broken contract of each type must be reported, so the check cannot pass because the linter saw
nothing.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

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
    assert {"horovod-leaf", "runtime-knows-no-mode", "layers", "env-taskspec-one-way",
            "horovod-process-sets-below-basics", "modes-independent",
            "strategies-owned-by-trainer"} <= ids
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
