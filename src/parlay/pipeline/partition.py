"""Partition a model into pipeline stages (pure: no process group).

A model is a sequence of *layers*: the children of an ``nn.Sequential``, or, for any other
module, the pieces ``torch.distributed.pipelining.pipeline`` traces between user-named split
points. A :class:`Partition` says how many consecutive layers each stage holds. The split is

* explicit (``balance=[3, 2, ...]`` or ``split_points=["fc2", ...]``),
* balanced by profiled forward+backward time per layer (``by="time"``, needs a sample input;
  torchgpipe's ``balance_by_time``, Kim et al. 2020), or
* balanced by parameter count (``by="params"``, the fallback when no sample is given).

Balancing solves the linear-partition problem exactly: contiguous stages that minimise the
cost of the most expensive stage, because the slowest stage sets a pipeline's pace.
Every argument is checked at construction; errors say what was expected, what was got, and how
to fix it.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from parlay.errors import ConfigError

__all__ = ["Partition", "partition", "balance_by_cost", "profile_layers", "param_costs",
           "check_boundaries"]

_BYS = ("auto", "time", "params")


@dataclass(frozen=True)
class Partition:
    """How the layers of a sequential model are split into stages.

    Attributes:
        names: Layer names in order (the ``nn.Sequential`` child names).
        balance: Number of consecutive layers per stage; sums to ``len(names)``.
        costs: Per-layer cost the split was balanced on (seconds or parameters; empty when
            the split was explicit).
        method: ``"explicit"``, ``"split_points"``, ``"time"`` or ``"params"``.
    """

    names: tuple[str, ...]
    balance: tuple[int, ...]
    costs: tuple[float, ...] = ()
    method: str = "explicit"

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.balance)

    def bounds(self) -> list[tuple[int, int]]:
        """``[start, stop)`` layer indices of every stage."""
        out, start = [], 0
        for n in self.balance:
            out.append((start, start + n))
            start += n
        return out

    def stage_names(self, stage: int) -> tuple[str, ...]:
        """Names of the layers of ``stage``."""
        a, b = self.bounds()[stage]
        return self.names[a:b]

    def stage_costs(self) -> list[float]:
        """Total cost of every stage (empty when no costs are known)."""
        if not self.costs:
            return []
        return [sum(self.costs[a:b]) for a, b in self.bounds()]

    def build(self, model: nn.Sequential, stage: int) -> nn.Sequential:
        """The layers of ``stage`` as an ``nn.Sequential`` that shares (not copies) the
        model's modules and keeps their names, so ``"3.weight"`` means the same parameter in
        the stage and in the full model."""
        return nn.Sequential(OrderedDict((n, model._modules[n]) for n in self.stage_names(stage)))


def _check_stages(stages: Any, n_layers: int) -> int:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"stages must be an int >= 1, got {stages!r}.")
    if stages > n_layers:
        raise ConfigError(
            f"cannot split a model of {n_layers} layer(s) into {stages} stages: expected "
            f"stages <= {n_layers} (every stage needs at least one layer), got {stages}. "
            "Hint: use fewer stages, or give the model more, smaller layers (e.g. unpack "
            "nested nn.Sequential blocks into the top-level nn.Sequential).")
    return stages


def balance_by_cost(costs: Sequence[float], stages: int) -> list[int]:
    """Split ``costs`` into ``stages`` contiguous non-empty runs minimising the largest run sum.

    Exact dynamic programme over prefix sums, O(stages * n^2). Among equally good splits the
    one whose *last* cut is latest wins, which keeps parameter-free layers (activations) with
    the layer before them.

    Args:
        costs: Non-negative cost per layer.
        stages: Number of runs, ``1 <= stages <= len(costs)``.

    Returns:
        The run lengths.

    Raises:
        ConfigError: Bad ``stages`` or a negative/non-finite cost.
    """
    n = len(costs)
    _check_stages(stages, n)
    c = [float(x) for x in costs]
    if any(not (x >= 0 and x < float("inf")) for x in c):
        raise ConfigError(f"layer costs must be finite and >= 0, got {list(costs)!r}.")
    # A floor per layer: breaks ties between splits that differ only in where cost-free layers
    # go, in favour of fewer layers on the bottleneck stage.
    floor = (sum(c) / n if sum(c) > 0 else 1.0) * 1e-6
    c = [x + floor for x in c]
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[s][i]: minimal bottleneck for the first i layers in s stages; cut[s][i]: start of
    # the last stage in that optimum.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v <= best[s][i] * (1 + 1e-12):
                    best[s][i], cut[s][i] = v, j
    out, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        out.append(i - j)
        i = j
    return out[::-1]


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Number of parameters of every layer (the fallback cost model)."""
    return [float(sum(p.numel() for p in m.parameters())) for m in layers]


def _tensors(value: Any) -> list[torch.Tensor] | None:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def _call(layer: nn.Module, value: Any) -> Any:
    # nn.Sequential semantics: the previous layer's output is the next layer's one argument.
    return layer(value)


def profile_layers(layers: Sequence[nn.Module], sample: Any, repeats: int = 3) -> list[float]:
    """Forward+backward seconds of every layer on ``sample`` (median of ``repeats`` runs).

    Gradients go through ``torch.autograd.grad``, so no ``.grad`` is touched; the RNG state
    and the layers' buffers are restored afterwards so profiling does not change dropout masks
    of the training run or BatchNorm's running statistics.

    Args:
        layers: The layers, in order.
        sample: An input of the first layer (one micro-batch is representative).
        repeats: Timed repetitions per layer after one warm-up.

    Returns:
        Seconds per layer.
    """
    costs: list[float] = []
    x = sample
    with kept_state(nn.ModuleList(layers)):
        for layer in layers:
            runs: list[float] = []
            for k in range(repeats + 1):
                inp = _detached(x)
                t0 = time.perf_counter()
                with torch.enable_grad():
                    out = _call(layer, inp)
                outs = [t for t in (_tensors(out) or []) if t.requires_grad]
                leaves = [t for t in (_tensors(inp) or []) if t.requires_grad]
                leaves += [p for p in layer.parameters() if p.requires_grad]
                if outs and leaves:
                    torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs],
                                        allow_unused=True)
                if k:
                    runs.append(time.perf_counter() - t0)
            costs.append(statistics.median(runs))
            with torch.no_grad():
                x = _call(layer, _detached(x))
    return costs


def _detached(x: Any) -> Any:
    ts = _tensors(x)
    if ts is None:
        return x
    out = [t.detach().requires_grad_(t.is_floating_point()) for t in ts]
    return out[0] if isinstance(x, torch.Tensor) else tuple(out)


@contextlib.contextmanager
def kept_state(module: nn.Module) -> Iterator[None]:
    """Forwards run inside only to learn shapes leave ``module``'s buffers (BatchNorm's running
    statistics) and the CPU random-number generator as they were."""
    saved = [b.detach().clone() for b in module.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            # through .data: no version bump, as autograd saved them in the graph torch's
            # shape inference then runs backward through
            for b, v in zip(module.buffers(), saved):
                b.data.copy_(v)


def _not_sendable(x: Any, last: bool) -> str | None:
    """What is wrong with ``x`` leaving a stage (``None``: nothing). A non-last stage sends a
    tensor or a tuple of tensors; torch's pipelining also takes a list at the last stage."""
    if isinstance(x, torch.Tensor):
        return None
    if not isinstance(x, (tuple, list)):
        return f"a {type(x).__name__}"
    if not x:
        return f"an empty {type(x).__name__}"
    bad = next((i for i, v in enumerate(x) if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        what = "None" if x[bad] is None else f"a {type(x[bad]).__name__}"
        return f"a {type(x).__name__} whose element {bad} is {what}"
    return None if last or isinstance(x, tuple) else "a list"


def check_boundaries(model: nn.Module, part: Partition, sample: Any) -> list[Any]:
    """Run ``sample`` through the model and check what crosses every stage boundary.

    Stages exchange tensors (or tuples of tensors) over point-to-point sends, so a layer that
    ends a non-last stage must return one of those; the last stage's output (the model's) must
    be a tensor or a tuple or list of tensors (torch's pipelining takes nothing else).

    Returns:
        The value leaving every stage (the last one is the model output).

    Raises:
        ConfigError: A boundary value is not a tensor or a tuple of tensors, or the model
            output is not a tensor or a tuple/list of tensors (a dict, say).
    """
    outs: list[Any] = []
    x = sample
    last = part.num_stages - 1
    with torch.no_grad(), kept_state(model):
        for s in range(part.num_stages):
            for name in part.stage_names(s):
                x = _call(model.get_submodule(name), x)
            bad = _not_sendable(x, s == last)
            if bad is not None and s == last:
                raise ConfigError(
                    f"the model's last layer {name!r} returns {bad}; in a pipeline the last "
                    "stage's output must be a tensor or a tuple of tensors. Hint: return a "
                    "tensor or a tuple (and index it in loss_fn), or train with "
                    "mode='allreduce', which takes a dict output.")
            if bad is not None:
                raise ConfigError(
                    f"stage {s} ends with layer {name!r}, which returns {bad}; a stage "
                    "boundary must carry a tensor or a tuple of tensors (they are sent to "
                    "the next stage). Hint: move the boundary (balance=[...] or "
                    "split_points=[...]) so it falls after a layer returning tensors, or wrap "
                    "the layer so it returns a tensor/tuple of tensors.")
            outs.append(x)
    return outs


# A Pipeline cuts the model into pp * virtual_stages stages, not pp.
_STAGES_HINT = ("a pipeline has pp x virtual_stages stages (schedule='interleaved' runs "
                "virtual_stages, default 2, on every rank)")


def _from_split_points(names: list[str], split_points: Sequence[str], stages: int | None
                       ) -> list[int]:
    pts = list(split_points)
    if any(not isinstance(p, str) for p in pts):
        raise ConfigError(f"split_points must be layer names (strings), got {pts!r}.")
    unknown = [p for p in pts if p not in names]
    if unknown:
        raise ConfigError(f"split_points name layers that are not in the model: {unknown}; "
                          f"expected names among {names}. Hint: a split point names the first "
                          "layer of a new stage.")
    idx = [names.index(p) for p in pts]
    if 0 in idx:
        raise ConfigError(f"split point {names[0]!r} is the first layer; a split point starts "
                          "a new stage, so the first layer cannot be one.")
    if idx != sorted(set(idx)):
        raise ConfigError(f"split_points must be distinct and in model order, got {pts}.")
    if stages is not None and len(pts) + 1 != stages:
        raise ConfigError(f"{len(pts)} split point(s) make {len(pts) + 1} stages, but "
                          f"stages={stages}. Hint: give stages - 1 split points; {_STAGES_HINT}.")
    cuts = [0, *idx, len(names)]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _check_inputs(model: nn.Module, by: str, balance: Any, split_points: Any) -> list[str]:
    """The layer names of ``model``, after checking what :func:`partition` was given."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"partition expects an nn.Sequential, got {type(model).__name__}. Hint: express "
            "the model as nn.Sequential(...) of its layers, or give parlay.pipeline.Pipeline "
            "split_points=[...] naming submodules, which traces the model instead.")
    # Every position is a layer, a module used twice too (named_children() skips repeats).
    names = list(model._modules)
    if not names:
        raise ConfigError("the nn.Sequential has no layers to split.")
    if by not in _BYS:
        raise ConfigError(f"by must be one of {_BYS}, got {by!r}.")
    if balance is not None and split_points is not None:
        raise ConfigError("give either balance or split_points, not both.")
    return names


def partition(model: nn.Module, stages: int | None = None, *,
              balance: Sequence[int] | None = None, split_points: Sequence[str] | None = None,
              sample: Any = None, by: str = "auto", repeats: int = 3) -> Partition:
    """Split an ``nn.Sequential`` into ``stages`` consecutive groups of layers.

    Args:
        model: The ``nn.Sequential`` to split.
        stages: Number of stages (may be omitted when ``balance`` or ``split_points`` is given).
        balance: Explicit layers per stage, e.g. ``[3, 2]``; must sum to the layer count.
        split_points: Names of the layers that start stages 1..S-1, e.g. ``["fc2"]``.
        sample: Example input of the model (a micro-batch); required for ``by="time"``.
        by: ``"time"`` (profiled forward+backward per layer), ``"params"`` (parameter count) or
            ``"auto"`` (time when ``sample`` is given, else params).
        repeats: Timed runs per layer when profiling.

    Returns:
        The :class:`Partition`.

    Raises:
        ConfigError: Not an ``nn.Sequential``, more stages than layers, a balance that does not
            sum to the layer count, unknown split points, ``by="time"`` without a sample, or
            (when ``sample`` is given) a stage boundary that carries no tensor.
    """
    names = _check_inputs(model, by, balance, split_points)
    layers = [model.get_submodule(n) for n in names]
    costs: list[float] = []
    if split_points is not None:
        bal = _from_split_points(names, split_points, stages)
        method = "split_points"
    elif balance is not None:
        bal = list(balance)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bal):
            raise ConfigError(f"balance entries must be ints >= 1 (layers per stage), got {bal}.")
        if stages is not None and len(bal) != stages:
            raise ConfigError(f"balance has {len(bal)} entries but stages={stages}: expected one "
                              f"entry (layer count) per stage. Hint: {_STAGES_HINT}.")
        if sum(bal) != len(names):
            raise ConfigError(
                f"balance {bal} sums to {sum(bal)}, but the model has {len(names)} layers: "
                f"expected sum(balance) == {len(names)}. Hint: count every child of the "
                "nn.Sequential, activations included.")
        method = "explicit"
    else:
        if stages is None:
            raise ConfigError("give stages=S (or balance=[...] or split_points=[...]).")
        _check_stages(stages, len(names))
        use_time = by == "time" or (by == "auto" and sample is not None)
        if use_time and sample is None:
            raise ConfigError("by='time' profiles every layer and needs sample=<example input>. "
                              "Hint: pass one micro-batch, or use by='params'.")
        costs = profile_layers(layers, sample, repeats) if use_time else param_costs(layers)
        method = "time" if use_time else "params"
        bal = balance_by_cost(costs, stages)
    _check_stages(len(bal), len(names))
    part = Partition(tuple(names), tuple(bal), tuple(costs), method)
    if sample is not None:
        check_boundaries(model, part, sample)
    return part
