"""parlay.errors: every error is a ParlayError, and its fields cross a process boundary."""
from __future__ import annotations

import pickle

import pytest

from parlay.errors import (CheckpointError, CommError, ConfigError, NonFiniteError,
                           ParlayError)


@pytest.mark.parametrize("error, fields", [
    (CommError("peer lost", op="allreduce", rank=1, peer=2),
     {"op": "allreduce", "rank": 1, "peer": 2}),
    (NonFiniteError("nan", step=3, rank=None, parameter="fc.weight"),
     {"step": 3, "rank": None, "parameter": "fc.weight"}),
    (ConfigError("bad"), {}), (CheckpointError("torn"), {}),
])
def test_errors_pickle_with_their_fields(error: ParlayError, fields: dict[str, object]) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and isinstance(back, ParlayError)
    assert {k: getattr(back, k) for k in fields} == fields


def test_wrong_types_get_a_config_error_naming_the_argument() -> None:
    import torch
    import torch.nn as nn

    import parlay
    import parlay.horovod as hvd
    from parlay import comm
    from parlay.data import from_arrays, mnist
    from parlay.ps import DistributedSession

    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (lambda: parlay.DistributedOptimizer(sgd, bucket_cap_mb="25"), "bucket_cap_mb"),
        (lambda: parlay.DistributedOptimizer(sgd, bucket_cap_mb=float("inf")), "bucket_cap_mb"),
        (lambda: parlay.DistributedOptimizer(sgd, gradient_predivide_factor="2"),
         "gradient_predivide_factor must be a finite number"),
        (lambda: parlay.DistributedOptimizer(sgd, gradient_predivide_factor=None),
         "gradient_predivide_factor must be a finite number"),
        (lambda: parlay.DistributedOptimizer(sgd, gradient_predivide_factor=float("inf")),
         "gradient_predivide_factor must be a finite number"),
        (lambda: parlay.DistributedOptimizer(sgd, gradient_predivide_factor=1e-320),
         "gradient_predivide_factor must be a finite number"),
        (lambda: parlay.DiLoCoOptimizer(None), "wraps a built torch.optim.Optimizer"),
        (lambda: parlay.DiLoCoOptimizer(torch.optim.SGD), "wraps a built torch.optim.Optimizer"),
        (lambda: parlay.DiLoCoOptimizer(sgd, outer_optimizer=torch.optim.SparseAdam),
         "on dense gradients"),
        (lambda: comm.group_size("world"), "process group"),
        (lambda: parlay.broadcast_optimizer_state(model), "takes a torch.optim.Optimizer"),
        (lambda: hvd.allreduce([1.0, 2.0]), "allreduce expects torch tensors"),
        (lambda: hvd.allgather(3.0), "allgather expects torch tensors"),
        (lambda: hvd.broadcast(None, 0), "broadcast expects torch tensors"),
        (lambda: DistributedSession(model=model, optimizer=torch.optim.SGD,
                                    optimizer_args={"lr": 0.1}, resume_steps=["a"]),
         "resume_steps must be an int"),
        (lambda: from_arrays([[1.0]], None), "needs inputs and targets"),
        (lambda: mnist(train="test"), "train must be True"),
    ]
    for call, words in cases:
        with pytest.raises(ConfigError, match=words):
            call()
