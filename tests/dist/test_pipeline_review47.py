"""Pipelines against the unpartitioned model: integer tensors crossing a stage boundary, and a
traced model whose input is a tuple (called as ``model(x)``, as in every mode)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parlay.errors import ConfigError
from parlay.pipeline import Pipeline
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)


class _Embed(nn.Module):  # stage 0: ids -> (hidden, ids)
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids):
        return self.emb(ids).mean(1), ids


class _Head(nn.Module):  # stage 1 looks the ids up again
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 8), nn.Linear(8, 3)

    def forward(self, t):
        h, ids = t
        return self.out(h + self.emb(ids).mean(1))


def _ids_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Embed(), _Head()).double()


def _ids_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)


def _int_boundary():
    pipe = Pipeline(_ids_model(), nn.functional.cross_entropy, stages=2, chunks=2)
    out = pipe.step(*_ids_batch())
    return out.loss, {k: p.grad.clone() for k, p in pipe.named_parameters()}


def test_an_integer_tensor_crosses_a_stage_boundary():
    # torch's shape inference fed stage 1 ids from torch.empty: "index out of range in self"
    ranks = run_world(_int_boundary, 2, comm_timeout=10, timeout=60)
    model = _ids_model()
    ids, y = _ids_batch()
    loss = nn.functional.cross_entropy(model(ids), y)
    loss.backward()
    torch.testing.assert_close(ranks[1][0], loss.detach(), **TOL)
    grads = {**ranks[0][1], **ranks[1][1]}
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


class _Pair(nn.Module):  # one argument: the (a, b) pair, as a dataset of ((a, b), y) gives it
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fa, self.fb, self.head = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, inputs):
        a, b = inputs
        return self.head(torch.relu(self.fa(a) + self.fb(b)))


class _TwoArgs(_Pair):
    def forward(self, a, b):  # type: ignore[override]
        return super().forward((a, b))


def _pair_batch() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return ((torch.randn(8, 4, generator=g, dtype=torch.float64),
             torch.randn(8, 3, generator=g, dtype=torch.float64)),
            torch.randint(0, 2, (8,), generator=g))


def _traced_pair():
    x, y = _pair_batch()
    pipe = Pipeline(_Pair().double(), nn.functional.cross_entropy, stages=2, chunks=2,
                    split_points=["head"], sample=(x[0][:4], x[1][:4]))
    out = pipe.step(x, y)
    grads = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    return out.loss, grads, pipe.forward(x)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_traced_model_takes_a_tuple_input_as_one_argument():
    ranks = run_world(_traced_pair, 2)
    model = _Pair().double()
    x, y = _pair_batch()
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    torch.testing.assert_close(ranks[1][0], loss.detach(), **TOL)
    torch.testing.assert_close(ranks[1][2], out.detach(), **TOL)
    grads = {**ranks[0][1], **ranks[1][1]}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_trace_failure_names_its_root_error():
    from parlay.pipeline.trace import trace_to_sequential

    x, _ = _pair_batch()
    with pytest.raises(ConfigError) as e:  # model(x) with a tuple x: forward's b is missing
        trace_to_sequential(_TwoArgs().double(), ["head"], x)
    assert "TypeError: missing a required argument: 'b'" in str(e.value), e.value
    assert "model(sample)" in str(e.value) and "Hint" in str(e.value)
