"""Meters and sinks: weighted means, one printing rank, JSONL records."""
from __future__ import annotations

import io
import json
import math

import pytest

from parlay.metrics import Meter, MetricsLogger, reduce_meters

pytestmark = pytest.mark.timeout(30)


def test_meter_is_a_sample_weighted_mean():
    m = Meter()
    assert math.isnan(m.mean)
    m.add(1.0, 3)
    m.add(5.0, 1)
    assert m.mean == 2.0 and reduce_meters([m]) == [2.0]


def _drive(logger: MetricsLogger) -> None:
    for loss in (4.0, 2.0):
        logger.step(loss, local_samples=8, global_samples=16)
    logger.log(step=2, epoch=0, lr_factor=1.5, console=True)
    logger.epoch_end(epoch=0, step=2)
    logger.validation(step=2, epochs=1.0, metrics={"accuracy": 0.5, "samples": 10.0})
    logger.close()


def test_non_printing_ranks_are_silent(tmp_path):
    out = io.StringIO()
    _drive(MetricsLogger(printer=False, reduces=True, jsonl_path=tmp_path / "m.jsonl",
                         stream=out))
    assert out.getvalue() == "" and not (tmp_path / "m.jsonl").exists()


def test_printer_writes_summaries_and_jsonl(tmp_path):
    out = io.StringIO()
    _drive(MetricsLogger(printer=True, reduces=True, jsonl_path=tmp_path / "m.jsonl",
                         progress=False, stream=out))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step       2  epoch 0  loss 3.0000")
    assert lines[1].startswith("epoch 0: loss 3.0000  32 samples in")
    assert lines[2] == "validation @ step 2 (1.00 epochs): accuracy 0.5  samples 10"
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["train", "epoch", "validation"]
    assert records[0]["loss"] == 3.0 and records[0]["lr_factor"] == 1.5
    assert records[2]["accuracy"] == 0.5


def test_default_metrics_give_the_loss_of_structured_outputs_and_targets():
    import torch

    from parlay.metrics import default_metrics

    def loss(out, y):  # a model with two heads, a target per head
        return torch.nn.functional.mse_loss(out[0], y["a"]) + out[1].sum() * 0
    fn = default_metrics(loss)
    got = fn((torch.ones(3, 2), torch.zeros(3)), {"a": torch.zeros(3, 2)})
    assert list(got) == ["loss"] and float(got["loss"]) == 1.0
    got = default_metrics(torch.nn.functional.cross_entropy)(  # class scores: and accuracy
        torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0]))
    assert float(got["accuracy"]) == 0.5
