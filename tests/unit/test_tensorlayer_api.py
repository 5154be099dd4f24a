"""The seed's TensorLayer-shaped API: TaskSpecDef, device_fn, load_mnist_dataset, from_arrays,
and the MNIST copy shipped inside the package (a fresh clone trains offline)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import parlay
from parlay.data.mnist import FILES, _md5, bundled_root, mnist
from parlay.errors import ConfigError


def test_taskspecdef_is_taskspec_and_device_fn_places_a_model():
    spec = parlay.TaskSpecDef(task_type="worker", index=0, ps_hosts=["ps0:2222"],
                              worker_hosts=["w0:2222", "w1:2222"])
    assert isinstance(spec, parlay.TaskSpec)
    # TensorLayer's positional order (trial third) and an index read from the environment
    tl = parlay.TaskSpecDef("worker", "1", None, "ps0:2222", "w0:2222,w1:2222")
    assert (tl.ps_hosts, tl.worker_hosts, tl.index, tl.rank) == (
        ("ps0:2222",), ("w0:2222", "w1:2222"), 1, 2)
    with pytest.raises(parlay.ConfigError, match=r"0 <= index < len\(worker_hosts\) \(2\), got -1"):
        parlay.TaskSpecDef("worker", " -1", None, "ps0:2222", "w0:2222,w1:2222")  # not "got str"
    dev = spec.device_fn()
    assert isinstance(dev, torch.device)
    model = nn.Linear(3, 2).to(spec.device_fn())
    assert next(model.parameters()).device.type == dev.type
    ps = parlay.TaskSpecDef(task_type="ps", index=0, ps_hosts=["ps0:2222"],
                            worker_hosts=["w0:2222"])
    assert ps.device_fn() == torch.device("cpu"), "parameter servers hold their shards on the CPU"


def test_taskspecdef_answers_tensorlayer_s_calls():
    # comma-separated hosts; is_ps() etc. as methods and as plain truth values; shard_index
    spec = parlay.TaskSpecDef("worker", 1, ps_hosts="p:1", worker_hosts="w:1, w:2")
    assert spec.worker_hosts == ("w:1", "w:2") and spec.rank == 2
    assert spec.is_worker() and spec.is_worker and not spec.is_ps() and not spec.is_ps
    assert not spec.is_master() and not spec.is_chief and not spec.is_evaluator()
    assert (spec.num_workers, spec.shard_index) == (2, 1)
    chief = parlay.TaskSpecDef("worker", 0, ps_hosts="p:1", worker_hosts="w:1,w:2")
    assert chief.is_master() and chief.shard_index == 0
    assert parlay.TaskSpecDef("ps", 0, ps_hosts="p:1", worker_hosts="w:1").shard_index is None


def test_create_task_spec_def_reads_tensorlayer_s_job_variables():
    env = {"JOB_NAME": "worker", "TASK_INDEX": "1", "PS_HOSTS": "p:1",
           "WORKER_HOSTS": "w:1,w:2", "MASTER_HOST": "m:1"}
    spec = parlay.create_task_spec_def(env)
    assert (spec.task_type, spec.rank, spec.shard_index, spec.num_workers) == ("worker", 3, 2, 3)
    master = parlay.create_task_spec_def({**env, "JOB_NAME": "master", "TASK_INDEX": "0"})
    assert master.is_master() and master.rank == 1
    with pytest.raises(ConfigError, match="TASK_INDEX"):
        parlay.create_task_spec_def({**env, "TASK_INDEX": "one"})


def test_tensorlayer_s_variables_place_the_task_in_the_world_as_tf_config_does():
    # parlay.init() and TaskSpec.from_env() ignored them: each task became its own 1-rank job
    env = {"JOB_NAME": "worker", "TASK_INDEX": "1", "PS_HOSTS": "p:1",
           "WORKER_HOSTS": "w:1,w:2", "MASTER_HOST": "m:1"}
    found = parlay.discovery.detect(env)
    assert (found.rank, found.world_size, found.num_ps, found.master_addr) == (3, 4, 1, "p")
    assert parlay.TaskSpec.from_env(env) == parlay.create_task_spec_def(env)
    with pytest.raises(ConfigError, match="JOB_NAME=master needs MASTER_HOST"):
        parlay.discovery.detect({**env, "JOB_NAME": "master", "MASTER_HOST": ""})
    # Jenkins sets JOB_NAME to the build's name: no cluster, a single process as before
    assert parlay.discovery.detect({"JOB_NAME": "parlay-nightly"}).world_size == 1
    assert parlay.discovery.detect({"JOB_NAME": "worker"}).world_size == 1
    with pytest.raises(ConfigError, match="TensorLayer's variables.*len\\(worker_hosts\\)"):
        parlay.TaskSpec.from_env({**env, "TASK_INDEX": "2"})


def test_tensorlayer_s_master_in_tf_config_and_taskspecdef():
    cfg = ('{"cluster": {"master": ["m:1"], "worker": ["w:1"]}, '
           '"task": {"type": "master", "index": 0, "trial": "7"}}')
    spec = parlay.TaskSpec.from_tf_config(cfg)  # Cloud ML Engine's format was refused
    assert (spec.task_type, spec.rank, spec.trial, spec.is_master()) == ("chief", 0, "7", True)
    assert parlay.discovery.detect({"TF_CONFIG": cfg}).world_size == 2
    local = parlay.TaskSpecDef()  # TensorLayer's default: one local master (was refused)
    assert (local.is_master(), local.rank, local.world_size) == (True, 0, 1)
    with pytest.raises(ConfigError, match="master='host:port'.*MASTER_HOST"):
        parlay.TaskSpecDef("master", 0, None, "p:1", "w:1")


def test_local_index_counts_training_tasks_on_the_same_host():
    hosts = ["a:1", "a:2", "b:1", "a:3"]
    got = [parlay.TaskSpec("worker", i, ps_hosts=["a:9"], worker_hosts=hosts).local_index()
           for i in range(4)]
    assert got == [0, 1, 0, 2], "ps tasks on the host take no accelerator"


def test_create_task_spec_def_reads_tf_config():
    env = {"TF_CONFIG": '{"cluster": {"ps": ["p:1"], "worker": ["w:1", "w:2"]}, '
                        '"task": {"type": "worker", "index": 1}}'}
    spec = parlay.create_task_spec_def(env)
    assert (spec.task_type, spec.index, spec.rank) == ("worker", 1, 2)


def test_bundled_mnist_files_are_the_published_ones():
    for name, md5 in FILES.items():
        assert _md5(bundled_root() / name) == md5, name


def test_bundled_copy_is_used_when_data_dir_and_cache_are_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("PARLAY_DATA_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="lacks"):
        ds = mnist(train=False, download=False)
    assert ds.root == bundled_root() and len(ds) == 10000
    with pytest.raises(ConfigError, match="not found"):     # an explicit root stays explicit
        mnist(tmp_path / "empty", train=False, download=False)
    with pytest.raises(ConfigError, match="not found"):
        mnist(train=False, download=False, bundled=False)


def test_load_mnist_dataset_has_tensorlayer_splits_and_shapes(tmp_path, monkeypatch):
    monkeypatch.delenv("PARLAY_DATA_DIR", raising=False)    # an empty cache: the bundled copy
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    X_train, y_train, X_val, y_val, X_test, y_test = parlay.data.load_mnist_dataset(shape=(-1, 784))
    assert [len(a) for a in (X_train, y_train, X_val, y_val, X_test, y_test)] == \
        [50000, 50000, 10000, 10000, 10000, 10000]
    assert X_train.shape == (50000, 784) and X_train.dtype == np.float32
    assert 0.0 <= X_train.min() and X_train.max() <= 1.0 and y_train.dtype == np.int64
    assert y_train[:5].tolist() == [5, 0, 4, 1, 9] and y_test[:3].tolist() == [7, 2, 1]
    img = parlay.data.load_mnist_dataset(shape=(-1, 28, 28, 1))[4]
    assert img.shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(img.reshape(-1, 784), X_test)
    for shape in ((-1, 100), (-1, 28), (28, 28)):  # (-1, 28) made 1.67M rows of 28
        with pytest.raises(ConfigError, match="784"):
            parlay.data.load_mnist_dataset(shape=shape)


def test_from_arrays_makes_a_trainer_dataset_in_one_call():
    x = np.random.default_rng(0).random((6, 4)).astype(np.float64)
    ds = parlay.data.from_arrays(x, np.arange(6, dtype=np.int32))
    xi, yi = ds[2]
    assert xi.dtype == torch.float32 and yi.dtype == torch.int64 and int(yi) == 2
    tokens = parlay.data.from_arrays(np.arange(12).reshape(6, 2), np.zeros(6), dtype=torch.float32)
    assert tokens[0][0].dtype == torch.int64, "integer inputs (token ids) are kept"
    with pytest.raises(ConfigError, match="same length"):
        parlay.data.from_arrays(x, np.arange(5))


def test_taskspecdef_takes_tensorlayer_s_master_and_trial_and_spares_an_evaluator():
    hosts = dict(ps_hosts="p:1", worker_hosts="w:1,w:2", master="m:1")
    master = parlay.TaskSpecDef(task_type="master", index=0, trial=7, **hosts)
    assert (master.task_type, master.rank, master.num_workers, master.trial) == ("chief", 1, 3, 7)
    assert master.is_master() and master.shard_index == 0
    w1 = parlay.TaskSpecDef(task_type="worker", index=1, **hosts)
    assert (w1.rank, w1.shard_index, bool(w1.is_master())) == (3, 2, False)  # as TensorLayer's
    ev = w1.use_last_worker_as_evaluator()
    assert ev.is_evaluator() and not ev.is_worker() and ev.rank is None and ev.world_size == 3
    kept = master.use_last_worker_as_evaluator()
    assert (kept.rank, kept.world_size, kept.trial, kept.evaluator_hosts) == (1, 3, 7, ("w:2",))
    with pytest.raises(ConfigError, match="one must still train"):
        parlay.TaskSpecDef("worker", 0, worker_hosts="w:1").use_last_worker_as_evaluator()
    with pytest.raises(ConfigError, match="either master="):
        parlay.TaskSpecDef("worker", 0, worker_hosts="w:1", chief_hosts="c:1", master="m:1")


def test_trainer_takes_tensorlayer_s_defaults_and_explains_its_build_functions():
    from parlay.trainer.config import TrainerConfig

    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    cfg = TrainerConfig(lambda: (nn.Linear(2, 1), nn.MSELoss()), data, torch.optim.SGD,
                        {"lr": 0.1}, 2, max_iteration=float("inf"))  # TensorLayer's default
    assert cfg.max_iteration is None
    for kw in ({"build_training_func": lambda x, y_: None},  # a raw TypeError at start-up
               {"build_validation_func": lambda x, y_: None}):
        args = {"build_training_func": lambda: (nn.Linear(2, 1), nn.MSELoss()), **kw}
        with pytest.raises(ConfigError, match=r"no arguments.*needs x, y_.*TensorLayer's"):
            TrainerConfig(training_dataset=data, optimizer=torch.optim.SGD,
                          optimizer_args={"lr": 0.1}, batch_size=2, **args)
