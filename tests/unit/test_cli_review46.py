"""Review 46: checks before launch (--json folder, pp=0, nan warm-up), ConfigErrors recorded for
the launcher (the demo's own, and those raised before parlay.init()), one skip warning, the
MNIST shape and root checks."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import parlay.launch
from parlay import lifeline
from parlay.cli import main
from parlay.data.arrays import load_mnist_dataset
from parlay.data.mnist import bundled_root, mnist
from parlay.errors import ConfigError
from parlay.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def launches(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(parlay.launch, "run_torchrun", lambda argv, *a: calls.append(argv) or 0)
    return calls


def test_demo_json_naming_a_folder_is_refused_before_launch(launches, tmp_path):
    with pytest.raises(SystemExit, match="is a folder"):  # IsADirectoryError after training
        main(["demo", "mnist", "--json", str(tmp_path)])
    assert launches == []


@pytest.mark.parametrize("args, message", [
    (["--mode", "hybrid", "--option", "pp=0"], r"--option pp must be .* >= 1, got 0"),
    (["--warmup-epochs", "nan"], r"--warmup-epochs must be >= 0, got nan"),
    (["--warmup-epochs", "inf"], r"--warmup-epochs must be >= 0, got inf"),
])
def test_demo_refuses_pp_zero_and_non_finite_warmup_before_launch(launches, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["demo", "mnist", "-n", "2", *args])
    assert launches == []


def test_an_exception_before_init_is_recorded_for_the_launcher(tmp_path):
    """A rank of `parlay run` records its uncaught exception from `import parlay` on."""
    error_file = tmp_path / "error.json"
    env = {**os.environ, "PARLAY_LAUNCHER_PID": str(os.getpid()),
           "TORCHELASTIC_ERROR_FILE": str(error_file)}
    code = "import parlay; raise parlay.ConfigError('bad input before init')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr   # the launcher prints it once
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ConfigError: bad input before init"
    assert 'File "<string>", line 1' in message["extraInfo"]["py_callstack"]


def test_the_demos_config_error_is_recorded_and_its_hint_fits_the_demo(tmp_path, monkeypatch,
                                                                        capsys):
    from parlay.demos import mnist as demo

    data = tmp_path / "data"
    data.mkdir()
    (data / "train-images-idx3-ubyte.gz").symlink_to(bundled_root() / "train-images-idx3-ubyte.gz")
    (data / "train-labels-idx1-ubyte.gz").write_bytes(b"not mnist")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("PARLAY_DATA_DIR", str(data))  # the demo sets it from --data
    assert demo.main(["--data", str(data)]) == 2
    said = json.loads(error_file.read_text())["message"]["message"]
    assert said.startswith("ConfigError: ") and "expected MD5" in said  # not restarted
    assert "--data DIR" in said
    assert "parlay demo mnist:" not in capsys.readouterr().err  # the launcher's summary says it
    assert lifeline.record(ConfigError("x"), path="") is False  # outside a launcher: printed


@pytest.mark.parametrize("printer, together, logged", [
    (True, True, True), (False, True, False), (False, False, True)])
def test_a_skip_on_every_rank_is_logged_by_the_printing_rank_only(caplog, monkeypatch, printer,
                                                                  together, logged):
    monkeypatch.setattr(parlay.runtime, "rank", lambda: 1)
    fake = SimpleNamespace(state=SimpleNamespace(skipped_steps=0, step=4), skipped_steps=1,
                           strategy=SimpleNamespace(skips_together=together),
                           metrics=SimpleNamespace(printer=printer, write=lambda *a, **k: None))
    with caplog.at_level(logging.WARNING, logger="parlay"):
        Trainer._note_skip(fake)  # type: ignore[arg-type]
    assert ("step 5 was skipped" in caplog.text) is logged


def test_load_mnist_dataset_refuses_an_image_count_that_is_not_first():
    with pytest.raises(ConfigError, match="use one -1 first"):
        load_mnist_dataset(shape=(28, -1, 28))


def test_mnist_root_naming_a_file_is_a_config_error():
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        mnist(root=bundled_root() / "train-images-idx3-ubyte.gz", train=True)


def test_a_failed_download_leaves_no_folder_behind(tmp_path):
    root = tmp_path / "new" / "mnist"
    with pytest.raises(ConfigError, match=f"downloaded into {root}"):
        mnist(root=root, train=False, mirrors=("http://127.0.0.1:9/",))   # refused at once
    assert list(tmp_path.iterdir()) == []
