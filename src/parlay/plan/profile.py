"""The compute term from a user's own model: forward + backward time per sample.

Two ways in:

* :func:`profile_model` times a model you hold (``model``, an example batch, a loss);
* :func:`profile_script` runs your unchanged training script in a child process
  (``python -m parlay.plan.profile script.py ARGS``) for a few optimizer steps on one
  process and stops it: the time between optimizer steps (data, forward, backward and update,
  as your script does them) is the compute term, the optimizer's parameters are the model, and
  the first dimension of the model's input is the batch. The script needs nothing special
  beyond making optimizer steps (``torch.optim``, or parlay's wrappers around it); it runs
  without the cluster variables of this environment (TF_CONFIG, SLURM_*, ...), so its
  ``parlay.init()`` joins no cluster.
"""
from __future__ import annotations

import json
import os
import runpy
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from parlay.discovery import describes_cluster
from parlay.errors import ConfigError
from parlay.plan.model import Workload

__all__ = ["ModelProfile", "profile_model", "profile_script"]


@dataclass(frozen=True)
class ModelProfile:
    """What profiling found.

    Attributes:
        params: Trainable parameters.
        batch: Samples per step.
        compute_s_per_sample: Step time per sample, seconds.
        layers: Pipeline-splittable layers (children of an ``nn.Sequential``, else modules
            holding parameters).
        activation_numel: Median elements per sample leaving a layer.
        shapes: Parameter shapes.
        steps: Steps timed.
    """

    params: int
    batch: int
    compute_s_per_sample: float
    layers: int
    activation_numel: float
    shapes: tuple[tuple[int, ...], ...]
    steps: int

    def workload(self, batch: int | None = None) -> Workload:
        """A :class:`Workload` of this model (optionally at another per-rank batch)."""
        return Workload(self.params, batch or self.batch, self.compute_s_per_sample,
                        layers=self.layers, activation_numel=self.activation_numel,
                        shapes=self.shapes)


class _Recorder:
    """Global module and optimizer hooks: the outermost model, its batch and layer outputs."""

    def __init__(self) -> None:
        self.depth = 0
        self.top: Any = None
        self.batch = 0
        self.outputs: dict[int, float] = {}
        self.steps: list[float] = []
        self.params: list[Any] = []
        self.owner: int | None = None

    def pre(self, module: Any, args: tuple[Any, ...]) -> None:
        import torch

        if self.depth == 0 and any(True for _ in module.parameters()):
            first = next((a for a in args if torch.is_tensor(a) and a.dim() > 0), None)
            if first is not None and (self.top is None or module is self.top):
                self.top, self.batch = module, int(first.shape[0])
        self.depth += 1

    def post(self, module: Any, args: tuple[Any, ...], out: Any) -> None:
        import torch

        self.depth -= 1
        if self.top is None or self.depth != 1 or not torch.is_tensor(out) or not self.batch:
            return
        if out.dim() > 0 and out.shape[0] == self.batch:
            self.outputs[id(module)] = out.numel() / self.batch

    def step(self, optimizer: Any, args: Any, kwargs: Any) -> bool:
        """Record a step of the first optimizer seen (a wrapper such as parlay's
        DistributedOptimizer fires the hook again around its inner optimizer's step)."""
        if self.owner is None:
            self.owner = id(optimizer)
            self.params = [p for g in optimizer.param_groups for p in g["params"]
                           if p.requires_grad]
        if id(optimizer) != self.owner:
            return False
        self.steps.append(time.perf_counter())
        return True


def _layers(top: Any) -> int:
    import torch.nn as nn

    if isinstance(top, nn.Sequential):  # stages are cut between children; each needs
        return sum(1 for m in top if any(True for _ in m.parameters()))  # parameters
    return sum(1 for m in top.modules() if any(True for _ in m.parameters(recurse=False)))


def _profile(rec: _Recorder, warmup: int) -> ModelProfile:
    times = [b - a for a, b in zip(rec.steps[warmup:], rec.steps[warmup + 1:])]
    if not times or rec.top is None or not rec.batch:
        raise ConfigError(f"the script made {len(rec.steps)} optimizer step(s) (and "
                          f"{'no' if rec.top is None else 'a'} model forward); profiling needs "
                          f"at least {warmup + 2}. Hint: let it train a few steps, or pass "
                          "--compute-ms and --model-params instead of --script.")
    shapes = tuple(tuple(int(d) for d in p.shape) for p in rec.params)
    acts = sorted(rec.outputs.values())
    return ModelProfile(sum(p.numel() for p in rec.params), rec.batch,
                        statistics.median(times) / rec.batch, max(1, _layers(rec.top)),
                        statistics.median(acts) if acts else 0.0, shapes, len(times))


class _Enough(BaseException):
    """Stops the user's script once enough steps were timed (not an Exception, so a broad
    ``except Exception`` in the script does not swallow it)."""


def run_script(path: str, args: Sequence[str], steps: int = 3, warmup: int = 2) -> ModelProfile:
    """Run ``path`` in this process under the hooks until ``warmup + steps + 1`` optimizer
    steps (or its end) and profile it."""
    import torch
    from torch.nn.modules import module as mod
    from torch.optim import optimizer as optim

    rec = _Recorder()
    need = warmup + steps + 1

    def on_step(opt: Any, a: Any, k: Any) -> None:
        if rec.step(opt, a, k) and len(rec.steps) >= need:
            raise _Enough

    handles = [mod.register_module_forward_pre_hook(rec.pre),
               mod.register_module_forward_hook(rec.post),
               optim.register_optimizer_step_post_hook(on_step)]
    argv = sys.argv
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python path` does
    try:
        runpy.run_path(path, run_name="__main__")
    except _Enough:
        pass
    except SystemExit as e:
        if e.code not in (None, 0):
            raise  # the script's own failure: its message is on stderr
    finally:
        sys.argv = argv
        sys.path.pop(0)
        for h in handles:
            h.remove()
        torch.set_grad_enabled(True)
    return _profile(rec, warmup)


def profile_script(path: str, args: Sequence[str] = (), steps: int = 3, warmup: int = 2,
                   timeout: float = 300.0) -> ModelProfile:
    """Profile a training script in a child process (see the module docstring).

    Raises:
        ConfigError: The script is missing, fails, times out or makes too few steps.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"--script: no file {path!r}. Hint: the path of your training "
                          "script, e.g. --script train.py")
    env = {k: v for k, v in os.environ.items() if not describes_cluster(k)}  # one process, alone
    cmd = [sys.executable, "-m", "parlay.plan.profile", "--steps", str(steps), "--warmup",
           str(warmup), path, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"profiling {path} took more than {timeout:.0f} s. Hint: a smaller "
                          "dataset or fewer steps per epoch, or --compute-ms.") from None
    line = next((ln for ln in reversed(proc.stdout.splitlines())
                 if ln.startswith("PARLAY_PROFILE ")), None)
    if proc.returncode or line is None:
        raise ConfigError(f"profiling {path} failed (exit {proc.returncode}):\n"
                          f"{proc.stderr.strip()[-2000:]}")
    doc = json.loads(line.split(" ", 1)[1])
    if "error" in doc:
        raise ConfigError(doc["error"])
    doc["shapes"] = tuple(tuple(s) for s in doc["shapes"])
    return ModelProfile(**doc)


def profile_model(model: Any, example: Any, loss_fn: Callable[..., Any] | None = None,
                  steps: int = 3, warmup: int = 1) -> ModelProfile:
    """Time forward + backward of ``model`` on ``example`` (an input, or ``(input, target)``
    with ``loss_fn``); the default loss is the mean square of the output."""
    import torch

    x, y = example if isinstance(example, (tuple, list)) else (example, None)
    rec = _Recorder()
    from torch.nn.modules import module as mod

    handles = [mod.register_module_forward_pre_hook(rec.pre),
               mod.register_module_forward_hook(rec.post)]
    try:
        for _ in range(warmup + steps + 1):
            model.zero_grad(set_to_none=True)
            out = model(x)
            loss = loss_fn(out, y) if loss_fn is not None else out.float().pow(2).mean()
            loss.backward()
            rec.steps.append(time.perf_counter())
    finally:
        for h in handles:
            h.remove()
    rec.params = [p for p in model.parameters() if p.requires_grad]
    if rec.top is None:
        rec.top, rec.batch = model, int(x.shape[0]) if torch.is_tensor(x) else 1
    return _profile(rec, warmup)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m parlay.plan.profile [--steps N] [--warmup W] script.py ARGS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    opts = {"--steps": 3, "--warmup": 2}
    while args and args[0] in opts:
        opts[args[0]] = int(args[1])
        args = args[2:]
    try:
        prof = run_script(args[0], args[1:], opts["--steps"], opts["--warmup"])
        doc: dict[str, Any] = asdict(prof)
    except ConfigError as e:
        doc = {"error": str(e)}
    sys.stdout.flush()
    print("PARLAY_PROFILE " + json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
