"""Shared fixtures: every test is checked for leaked environment variables and process groups."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist


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
