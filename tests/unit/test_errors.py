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
