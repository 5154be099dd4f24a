"""TensorFlow-style tasks from the environment: ``TF_CONFIG``, or TensorLayer's variables read
as one (internal; :mod:`parlay.discovery` re-exports the names).

Pure like :mod:`parlay.discovery`: neither torch nor any parlay module but :mod:`parlay.errors`
and :mod:`parlay._validate`.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from parlay._validate import TASK_TYPES, read_tf_config
from parlay.errors import ConfigError

__all__ = ["TENSORLAYER_VARS", "tf_config_text", "read_task"]

#: TensorLayer's cluster variables, read as TF_CONFIG's jobs (``JOB_NAME`` and ``TASK_INDEX``:
#: this task's).
TENSORLAYER_VARS = {"ps": "PS_HOSTS", "worker": "WORKER_HOSTS", "master": "MASTER_HOST"}


def tf_config_text(env: Mapping[str, str]) -> str:
    """``TF_CONFIG``; when it is blank and TensorLayer's ``JOB_NAME`` is set, the same document
    made from ``JOB_NAME``, ``TASK_INDEX``, ``PS_HOSTS``, ``WORKER_HOSTS`` and ``MASTER_HOST``
    (comma-separated ``host:port`` lists; ``JOB_NAME`` must be a task type and one of the lists
    set); else ``""``.

    Raises:
        ConfigError: ``JOB_NAME=master`` without ``MASTER_HOST``.
    """
    text = env.get("TF_CONFIG", "")
    # JOB_NAME alone is no cluster (Jenkins sets it to the build's name): TensorLayer's needs a
    # task type and a host list.
    if text.strip() or env.get("JOB_NAME") not in (*TASK_TYPES, "master") \
            or not any(env.get(var, "").strip() for var in TENSORLAYER_VARS.values()):
        return text
    cluster = {job: [h.strip() for h in env.get(var, "").split(",") if h.strip()]
               for job, var in TENSORLAYER_VARS.items()}
    if env["JOB_NAME"] == "master" and not cluster["master"]:
        raise ConfigError("JOB_NAME=master needs MASTER_HOST, the master's host:port (TensorLayer "
                          "runs the master as a training task before the workers). Hint: set "
                          "MASTER_HOST, or launch the task as JOB_NAME=worker.")
    return json.dumps({"cluster": {job: h for job, h in cluster.items() if h},
                       "task": {"type": env["JOB_NAME"], "index": env.get("TASK_INDEX") or 0}})


def read_task(env: Mapping[str, str]) -> tuple[str, int, dict[str, tuple[str, ...]], Any] | None:
    """This task as :func:`tf_config_text` gives it: ``(task_type, index, hosts, trial)``
    (as :func:`~parlay._validate.read_tf_config` checks them); ``None`` without either source,
    or when ``TF_CONFIG`` has no cluster (TensorFlow's local mode).

    Raises:
        ConfigError: What :func:`~parlay._validate.read_tf_config` refuses, naming the source.
    """
    text = tf_config_text(env)
    if not text.strip():
        return None
    try:
        found = read_tf_config(text)
    except ConfigError as e:
        if env.get("TF_CONFIG", "").strip():
            raise
        names = ", ".join(["JOB_NAME", "TASK_INDEX", *TENSORLAYER_VARS.values()])
        raise ConfigError(f"TensorLayer's variables ({names}), read as {e}") from None
    if found is None:
        return None
    task_type, index, hosts = found
    return task_type, index, hosts, json.loads(text)["task"].get("trial")
