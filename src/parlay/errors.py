"""Exception hierarchy of parlay.

Every error a user can trigger derives from :class:`ParlayError`, so ``except parlay.ParlayError``
catches all of them. Messages follow one shape: what was expected, what was got, and a hint.
The keyword fields (``op``, ``rank``, ``peer``, ``step``, ...) survive pickling, as Python's own
exception pickling keeps an instance's attributes, so an error crosses processes whole.
"""
from __future__ import annotations

__all__ = ["ParlayError", "ConfigError", "CommError", "CheckpointError", "NonFiniteError",
           "ReplicaDivergence"]


class ParlayError(Exception):
    """Base class of every error raised by parlay."""


class ConfigError(ParlayError, ValueError):
    """Bad user input or an inconsistent cluster description.

    Subclasses :class:`ValueError` so code that validates arguments generically still works.
    """


class CommError(ParlayError, RuntimeError):
    """A collective or point-to-point operation failed: a peer was lost or timed out.

    Attributes:
        op: Name of the operation that failed (e.g. ``"allreduce"``).
        rank: Rank that observed the failure, or ``None`` if unknown.
        peer: Rank that was lost, when it is known.
    """

    def __init__(self, message: str, *, op: str | None = None, rank: int | None = None,
                 peer: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.peer = peer


class CheckpointError(ParlayError):
    """A checkpoint could not be written, read or validated."""


class NonFiniteError(ParlayError, FloatingPointError):
    """A training step produced a NaN or infinite loss or gradient; the update was not applied.

    Attributes:
        step: The step (1-based: the first step is step 1) that went non-finite, when known.
        rank: Lowest global rank whose own loss was non-finite, or ``None`` when every loss
            was finite (the gradient itself overflowed in backward).
        parameter: First parameter (in model order) whose averaged gradient is non-finite.
    """

    def __init__(self, message: str, *, step: int | None = None, rank: int | None = None,
                 parameter: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.parameter = parameter


class ReplicaDivergence(ParlayError, RuntimeError):
    """Data-parallel replicas hold different parameters or optimizer state, and no majority
    of three or more can heal the others.

    Attributes:
        step: The step at which the check found it.
        ranks: The global ranks that differ (all of them when there is no majority).
        agreed_at: The last step at which the replicas agreed.
    """

    def __init__(self, message: str, *, step: int | None = None,
                 ranks: list[int] | None = None, agreed_at: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks
        self.agreed_at = agreed_at
