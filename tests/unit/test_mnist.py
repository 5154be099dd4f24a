"""parlay.data.mnist on small IDX files written by the tests (and the real files when given)."""
from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from parlay.data import mnist
from parlay.data.mnist import FILES, MEAN, STD, default_root
from parlay.errors import ConfigError, ParlayError
from parlay.testing import free_port
from tests._idx import FILES as SPLITS

pytestmark = pytest.mark.timeout(60)


def _md5s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.glob("*.gz")}


def _raw(path: Path, header: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read()[header:], dtype=np.uint8)


def test_loads_idx_files_as_normalised_float_images_and_int64_labels(mnist_dir):
    train = mnist(mnist_dir, train=True, download=False, verify=False)
    test = mnist(mnist_dir, train=False, download=False, verify=False)
    assert len(train) == 64 and len(test) == 32
    assert train.images.shape == (64, 1, 28, 28) and train.images.dtype == torch.float32
    assert train.labels.dtype == torch.int64
    pixels = _raw(mnist_dir / SPLITS["train"][0], 16).reshape(64, 1, 28, 28)
    want = (torch.from_numpy(pixels.copy()).float() / 255 - MEAN) / STD
    torch.testing.assert_close(train.images, want)
    labels = _raw(mnist_dir / SPLITS["train"][1], 8)
    assert train.labels.tolist() == labels.tolist()
    x, y = train[3]
    assert x.shape == (1, 28, 28) and int(y) == int(labels[3])


def test_md5_mismatch_names_the_file_and_both_sums(mnist_dir):
    with pytest.raises(ConfigError) as e:
        mnist(mnist_dir, download=False)          # synthetic files != the published MD5s
    msg = str(e.value)
    assert "train-images-idx3-ubyte.gz" in msg and FILES["train-images-idx3-ubyte.gz"] in msg
    assert "verify=False" in msg
    assert len(mnist(mnist_dir, download=False, verify=_md5s(mnist_dir))) == 64


def test_missing_files_offline_say_where_to_put_them(tmp_path):
    with pytest.raises(ConfigError) as e:
        mnist(tmp_path / "nothing", download=False)
    msg = str(e.value)
    assert "not found in" in msg and "PARLAY_DATA_DIR" in msg and "root=" in msg
    closed = f"http://127.0.0.1:{free_port()}/"   # nothing listens: like being offline
    with pytest.raises(ConfigError, match="download attempts") as e:
        mnist(tmp_path / "offline", mirrors=[closed])
    assert closed in str(e.value)
    assert not list((tmp_path / "offline").glob("*")), "no partial file is left behind"


def test_root_defaults_to_parlay_data_dir_then_the_cache(mnist_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("PARLAY_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_root() == tmp_path / "cache" / "parlay" / "mnist"
    monkeypatch.setenv("PARLAY_DATA_DIR", str(mnist_dir))
    assert default_root() == mnist_dir
    assert mnist(download=False, verify=False).root == mnist_dir
    # PARLAY_DATA_DIR without the files (mistyped): the cache serves, and a warning says so
    shutil.copytree(mnist_dir, tmp_path / "cache" / "parlay" / "mnist")
    monkeypatch.setenv("PARLAY_DATA_DIR", str(tmp_path / "typo"))
    with pytest.warns(UserWarning, match=r"PARLAY_DATA_DIR=.*typo.* \(parlay demo: --data\) "
                      r"lacks .*: MNIST is read from .*cache"):
        assert mnist(download=False, verify=False).root == tmp_path / "cache/parlay/mnist"
    # the demo's --data DIR is read as PARLAY_DATA_DIR is, as the README says
    import parlay
    from parlay.demos.mnist import load_data

    monkeypatch.setattr(parlay, "size", lambda: 1)  # one process: no launcher needed
    monkeypatch.setenv("PARLAY_DATA_DIR", "")
    with pytest.warns(UserWarning, match=r"PARLAY_DATA_DIR=.*typo2.* lacks"), \
            pytest.raises(ConfigError, match=r"cache/parlay/mnist/train-images.*expected MD5"):
        load_data(str(tmp_path / "typo2"))  # (the cache holds fake files: verified, refused)
    assert not (tmp_path / "typo2").exists()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def mirror(mnist_dir, tmp_path):
    """Two local HTTP mirrors: the first serves corrupted files, the second good ones."""
    bad = tmp_path / "bad_mirror"
    bad.mkdir()
    for p in mnist_dir.glob("*.gz"):
        (bad / p.name).write_bytes(p.read_bytes()[:-5] + b"xxxxx")
    servers = []
    for folder in (bad, mnist_dir):
        handler = functools.partial(_Quiet, directory=str(folder))
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield [f"http://127.0.0.1:{s.server_address[1]}/" for s in servers], _md5s(mnist_dir)
    for s in servers:
        s.shutdown()
        s.server_close()


def test_downloads_from_the_first_mirror_with_a_good_md5(mirror, tmp_path):
    urls, sums = mirror
    root = tmp_path / "downloaded"
    ds = mnist(root, train=False, mirrors=urls, verify=sums)
    assert len(ds) == 32
    assert sorted(os.listdir(root)) == sorted(SPLITS["test"]), "only the split asked for"
    assert _md5s(root) == {k: sums[k] for k in SPLITS["test"]}


def test_truncated_idx_file_is_reported(mnist_dir, tmp_path):
    root = tmp_path / "cut"
    shutil.copytree(mnist_dir, root)
    name = SPLITS["test"][0]
    with gzip.open(mnist_dir / name, "rb") as f:
        data = f.read()
    with gzip.open(root / name, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(ParlayError, match="truncated"):
        mnist(root, train=False, download=False, verify=False)
    raw = bytearray((mnist_dir / name).read_bytes())   # a flipped byte in the deflate stream:
    raw[32] ^= 0xFF                                    # zlib.error (it leaked, unwrapped)
    (root / name).write_bytes(bytes(raw))
    with pytest.raises(ParlayError, match="not a readable gzip file"):
        mnist(root, train=False, download=False, verify=False)


@pytest.mark.skipif(not os.environ.get("PARLAY_DATA_DIR"), reason="real MNIST not provided")
def test_real_mnist_files_match_the_published_md5s():
    train = mnist(download=False)
    test = mnist(train=False, download=False)
    assert (len(train), len(test)) == (60000, 10000)
    assert train.labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert abs(float(train.images.mean())) < 1e-3 and abs(float(train.images.std()) - 1) < 1e-3
