"""A full disk or snapshot folder is reported as such, naming the folder actually used (issue 25:
torch's writer says ``unexpected pos ...``, and the snapshot hint named /dev/shm whatever
PARLAY_SNAPSHOT_DIR said). Real full file systems: a 64 KiB tmpfs mounted for the test."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from parlay.checkpoint import save_atomic
from parlay.errors import CheckpointError
from parlay.snapshot import SnapshotStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def full_fs(tmp_path):
    """A folder on a 64 KiB tmpfs (root only), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        pytest.skip("needs root and mount to make a small file system")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_named_as_such_with_the_checkpoint_folder(full_fs):
    with pytest.raises(CheckpointError) as e:
        save_atomic({"w": torch.zeros(100_000)}, full_fs / "ckpt-1.rank0.pt")
    msg = str(e.value)
    assert f"no space left on device (the file system of {full_fs} is full)" in msg, msg
    assert "unexpected pos" not in msg and f"write permission of {full_fs}" in msg
    assert not list(full_fs.iterdir())  # no temporary file left behind


def test_a_full_snapshot_folder_names_the_folder_used_not_dev_shm(full_fs):
    store = SnapshotStore("job-full-0123456789ab", 0, root=full_fs)
    with pytest.raises(CheckpointError) as e:
        store.save(1, {"w": torch.zeros(100_000)})
        store.wait()
    msg = str(e.value)
    assert "no space left on device" in msg and f"free space in {store.directory}" in msg, msg
    assert "/dev/shm" not in msg and "PARLAY_SNAPSHOT_DIR" in msg
    store.close()
