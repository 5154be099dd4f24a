"""Trainer inputs that used to fail late with raw torch/Python errors: each is a ConfigError."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import parlay
from parlay.errors import ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _build():
    return nn.Linear(4, 3), nn.CrossEntropyLoss()


def _dataset(n: int = 8) -> TensorDataset:
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 3, (n,)))


class _Dicts(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"x": torch.randn(4), "y": i % 3}


class _Triples(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.randn(4), i % 3, i


class _Stream(IterableDataset):
    def __iter__(self):
        for i in range(6):
            yield torch.randn(4), i % 3


class _SizedStream(_Stream):
    def __len__(self):
        return 6


FIX = "Hint: for arrays X, y pass parlay.data.from_arrays(X, y)"
MAP = "must be a map-style Dataset (a sized dataset, with __len__ and __getitem__), got "
BAD = [(_Dicts, "[0] is a dict"), (_Triples, "[0] is a tuple of 3"), (_Stream, MAP + "_Stream"),
       (_SizedStream, MAP + "_SizedStream"),
       (lambda: [torch.randn(4) for _ in range(6)], "[0] is a Tensor"),
       (lambda: np.zeros((6, 4), np.float32), "[0] is a ndarray"),
       (lambda: tuple(_dataset().tensors), "[0] is a Tensor")]


def _refused(**kw):
    try:
        parlay.Trainer(_build, batch_size=4, progress=False, **kw)
    except ConfigError as e:
        return str(e)
    return None


def _construct_bad():
    return ([_refused(training_dataset=_dataset(), validation_dataset=make()) for make, _ in BAD],
            [_refused(training_dataset=make()) for make, _ in BAD])


def _tensorlayer_validation_builder():
    net, cost = _build()
    return _refused(training_dataset=_dataset(), validation_dataset=_dataset(),
                    build_validation_func=lambda: (net, [cost]))


def test_a_validation_builder_that_returns_no_function_is_refused_at_construction():
    # TensorLayer's builders return (network, [cost, acc]): it trained a whole epoch, then
    # failed with "'tuple' object is not callable"
    for said in run_world(_tensorlayer_validation_builder, 2):
        assert "build_validation_func() must return a function" in said and "got tuple" in said


def test_bad_datasets_are_refused_at_construction_on_every_rank():
    for validation, training in run_world(_construct_bad, 2):
        for name, said in (("validation_dataset", validation), ("training_dataset", training)):
            for msg, (_, words) in zip(said, BAD):
                assert msg is not None and name in msg and words in msg and FIX in msg


def _validate_bad():
    t = parlay.Trainer(_build, _dataset(), batch_size=4, max_iteration=1, progress=False)
    t.train_to_end()
    said = []
    for make, _ in BAD:
        try:
            t.validate(make())
        except ConfigError as e:
            said.append(str(e))
    return said, t.validate(_dataset(6))["samples"]


def test_validate_refuses_bad_datasets_on_every_rank():
    for said, samples in run_world(_validate_bad, 2):
        assert len(said) == len(BAD) and samples == 6
        for msg, (_, words) in zip(said, BAD):
            assert "validate()'s dataset" in msg and words in msg and FIX in msg


def _float_loss(out, y):
    return float(nn.functional.cross_entropy(out, y))


def _losses():
    said = []
    for loss in (_float_loss, nn.CrossEntropyLoss(reduction="none")):
        t = parlay.Trainer(lambda: (nn.Linear(4, 3), loss), _dataset(), batch_size=4,
                           max_iteration=1, progress=False)
        try:
            t.train_on_batch()
        except ConfigError as e:
            said.append(str(e))
    return said


def test_a_loss_fn_without_a_scalar_tensor_result_is_a_config_error():
    for said in run_world(_losses, 2):
        assert [m.split(";")[0] for m in said] == [
            "the loss function of build_training_func returned a float",
            "the loss function of build_training_func returned a Tensor of shape (4,)"]
        assert all("must return a scalar tensor" in m and "nn.CrossEntropyLoss()" in m
                   for m in said)


def _metrics_in(path: str):
    try:
        parlay.Trainer(_build, _dataset(), batch_size=4, progress=False, metrics_path=path)
    except ConfigError as e:
        return str(e)
    return None


def test_metrics_path_that_cannot_be_created_is_a_config_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    path = str(tmp_path / "afile" / "metrics.jsonl")
    msg = run_world(_metrics_in, 1, path)[0]
    assert msg is not None and msg.startswith(f"cannot create metrics_path {path}: ")
    assert "Hint: a path in a writable folder, or metrics_path=None." in msg
