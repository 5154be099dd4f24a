"""parlay.reduce_ops: the one conversion of an op (name, ReduceOp, number) for every layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from parlay.errors import ConfigError
from parlay.reduce_ops import ReduceOp, c10d_op, reduce_op


@pytest.mark.parametrize("op, expected", [
    ("avg", ReduceOp.Average), ("Average", ReduceOp.Average), ("SUM", ReduceOp.Sum),
    (ReduceOp.Max, ReduceOp.Max), (4, ReduceOp.Max), (np.int64(1), ReduceOp.Sum),
    (np.int32(5), ReduceOp.Product), ("adasum", ReduceOp.Adasum),
])
def test_names_members_and_numbers_map_to_one_reduce_op(op: object, expected: ReduceOp) -> None:
    assert reduce_op(op) is expected


@pytest.mark.parametrize("op", [True, 1.0, 6, -1, "mean", None, [1]])
def test_anything_else_is_refused_with_the_choices(op: object) -> None:
    with pytest.raises(ConfigError, match="reduction op must be one of"):
        reduce_op(op)


def test_c10d_carries_average_as_sum_and_refuses_adasum() -> None:
    assert c10d_op("avg") == dist.ReduceOp.SUM and c10d_op(np.int64(3)) == dist.ReduceOp.MIN
    with pytest.raises(ConfigError, match="Adasum has no torch.distributed reduction"):
        c10d_op(ReduceOp.Adasum)
