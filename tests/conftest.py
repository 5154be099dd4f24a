"""Shared fixtures: every test is checked for leaked environment variables and process groups."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

# The repository root, so tests reach the tooling under tools/ (not shipped in the wheel),
# in this process and in the ranks run_world starts (its forkserver inherits sys.path).
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


# Set by pytest itself or lazily by torch's own modules on first use, not by parlay.
_IGNORED = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "KMP_", "OMP_WAIT")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_IGNORED)}


@pytest.fixture(autouse=True)
def _no_leaks():
    before = _env()
    yield
    after = _env()
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    import parlay.runtime as rt
    rt._rt = None  # noqa: SLF001 - reset so the next test starts clean
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        pytest.fail(f"test leaked environment variables: {changed}")
    if leaked_group:
        pytest.fail("test leaked a live torch.distributed process group")


@pytest.fixture
def mnist_dir(tmp_path):
    """A folder of tiny synthetic MNIST IDX files (see tests/_idx.py)."""
    from tests._idx import write_fake_mnist

    write_fake_mnist(tmp_path, n_train=64, n_test=32)
    return tmp_path
