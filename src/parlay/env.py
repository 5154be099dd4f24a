"""Where is this process in the cluster: the public home of the discovery names.

``from parlay.env import ClusterEnv, TaskSpec, detect`` has worked since the first release. The
names are defined one layer down, where what uses them can reach them without a cycle:
:mod:`parlay.discovery` (``ClusterEnv``, :func:`detect`; the launcher's variables) and
:mod:`parlay.taskspec` (``TaskSpec``, a TensorFlow-style task, which builds on ``detect``).
Imports run ``env -> taskspec -> runtime -> discovery``; nothing below imports this module.
"""
from __future__ import annotations

from parlay.discovery import (DEFAULT_MASTER_PORT, TASK_TYPES, ClusterEnv, detect,
                              expand_nodelist, pipeline_stages, run_id)
from parlay.taskspec import TaskSpec, TaskSpecDef, create_task_spec_def

__all__ = ["TASK_TYPES", "DEFAULT_MASTER_PORT", "TaskSpec", "TaskSpecDef", "create_task_spec_def",
           "ClusterEnv", "detect", "expand_nodelist", "pipeline_stages", "run_id"]
