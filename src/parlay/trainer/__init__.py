"""The Trainer: a frozen, validated configuration (:mod:`~parlay.trainer.config`), the loop
(:mod:`~parlay.trainer.loop`) and its two collaborators, validation
(:mod:`~parlay.trainer.evaluation`) and checkpoints, snapshots and resume
(:mod:`~parlay.trainer.persistence`). The modes are :mod:`parlay.strategies`' adapters."""
from parlay.trainer.config import TrainerConfig, TrainerState
from parlay.trainer.loop import Trainer, TrainerSession

__all__ = ["Trainer", "TrainerConfig", "TrainerState", "TrainerSession"]
