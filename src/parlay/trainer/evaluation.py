"""Validation across the replicas: each evaluates its own shard, and the sample-weighted metric
means are reduced over the strategy's ``dp_group`` in tensors only (no peer's bytes are
unpickled), so every reporting rank returns the mean over the whole dataset."""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch
from torch.utils.data import Dataset, default_collate

from parlay import _tree, comm
from parlay.data.loader import build_loader, check_dataset
from parlay.data.sampler import ShardedSampler
from parlay.errors import ConfigError
from parlay.strategies import Strategy
from parlay.strategies.template import batch_size_of

__all__ = ["Evaluation", "reduce_metrics"]


class Evaluation:
    """Validates a strategy's model on a dataset, reusing one loader for the default dataset.

    Args:
        strategy: The Trainer's strategy (``eval_forward``, ``dp_group``, ``reports_loss``).
        metric_fn: ``fn(output, target) -> {name: batch mean}``.
        dataset: The default dataset (``Trainer(validation_dataset=...)``), or None.
        batch_size: Validation batch size.
        loader_options: ``num_workers``, ``prefetch`` and ``pin_memory`` for the loaders.

    Raises:
        ConfigError: ``dataset`` is no map-style dataset of ``(input, target)`` pairs.
    """

    def __init__(self, strategy: Strategy, metric_fn: Callable[..., dict[str, Any]],
                 dataset: Dataset | None, batch_size: int, **loader_options: Any) -> None:
        if dataset is not None:  # at construction, where a failure reaches waiting servers
            check_dataset("validation_dataset", dataset)
        if not callable(metric_fn):
            raise ConfigError(
                "build_validation_func() must return a function fn(output, target) -> {name: "
                f"batch mean}}, got {type(metric_fn).__name__}. Hint: not TensorLayer's "
                "(network, [cost, acc]); e.g. return lambda out, y: {'accuracy': "
                "(out.argmax(1) == y).float().mean()}.")
        self.strategy, self.metric_fn = strategy, metric_fn
        self.dataset, self.batch_size = dataset, batch_size
        self.loader_options = loader_options
        self._loader: Any = None  # the default dataset's, kept for the next validation

    def _loader_for(self, ds: Dataset) -> Any:
        s = self.strategy
        # A replica alone in its dp_group among several (async PS workers, whose models
        # differ) evaluates the whole dataset itself.
        alone = s.reports_loss and s.dp_size > 1 and comm.group_size(s.dp_group) == 1
        shards, index = (1, 0) if alone else (s.dp_size, s.dp_rank)
        if shards > 1:  # ranks with other lengths would evaluate samples twice or never
            n = len(ds)  # type: ignore[arg-type]
            hi, low = comm.allreduce(torch.tensor([n, -n], device=comm.group_device(
                s.train_group)), "max", group=s.train_group).tolist()
            if hi != -low:
                raise ConfigError(f"the validation dataset has {n} samples on this rank and "
                                  f"{hi if hi != n else -low} on another. Hint: pass the same "
                                  "whole dataset on every rank; the Trainer shards it.")
        sampler = ShardedSampler(len(ds), shards, index, shuffle=False, even=False)  # type: ignore[arg-type]
        return build_loader(ds, sampler, self.batch_size, **self.loader_options)

    def validate(self, dataset: Dataset | None) -> dict[str, float]:
        """Metrics over ``dataset`` (None: the default one), on every training rank (a
        pipeline's last stage tells its other stages); ``{}`` at once on ranks that take no data
        (parameter servers)."""
        s = self.strategy
        if dataset is not None:
            check_dataset("validate()'s dataset", dataset)
        if not s.consumes_data:
            return {}
        if dataset is None:
            if self._loader is None:  # (not "or": a rank's empty share has length 0)
                self._loader = self._loader_for(self.dataset)  # type: ignore[arg-type]
            loader = self._loader
        else:
            loader = self._loader_for(dataset)
        sums, count = self._evaluate(loader, dataset if dataset is not None else self.dataset)
        if loader is not self._loader:
            loader.close()
        out = reduce_metrics(sums, count, s.dp_group) if s.reports_loss else {}
        if s.metrics_group is not None:  # the means as they are (count 1), and the samples
            mine = {**out, "@samples": out.get("samples", 0.0)} if out else {}
            mine.pop("samples", None)
            out = reduce_metrics(mine, 1 if out else 0, s.metrics_group)
            out["samples"] = out.pop("@samples")
        return out

    def _evaluate(self, loader: Any, ds: Any) -> tuple[dict[str, float], int]:
        """Sample-weighted metric sums and the sample count of this rank's share."""
        s = self.strategy
        sums: dict[str, float] = {}
        count, x = 0, None
        # Where every forward is a collective, ranks with fewer batches join the others'.
        most = int(comm.allreduce(torch.tensor(
            [len(loader)], device=comm.group_device(s.train_group)), "max", group=s.train_group)) \
            if s.eval_in_lockstep else 0
        with s.evaluating():
            for x, y in loader:
                out = s.eval_forward(x)
                if out is None or not s.reports_loss:
                    continue
                found = _tree.tensors_in(out)  # (a tuple or dict of outputs too)
                y = _tree.to_device(y, found[0].device) if found else y
                k = batch_size_of(y)
                # as the training loss, which autocast computes in float32 (cross-entropy, ...)
                out = _tree.map_tensors(lambda t: t.float() if t.dtype in (
                    torch.float16, torch.bfloat16) else t, out)
                got = self.metric_fn(out, y)
                if not isinstance(got, dict):
                    raise ConfigError("the validation function must return {name: batch mean} "
                                      f"(e.g. {{'accuracy': acc}}), got {type(got).__name__}.")
                for name, v in got.items():
                    if name == "samples":
                        raise ConfigError("the validation function returned 'samples': "
                                          "'samples' is the count of validation samples the "
                                          "Trainer reports. Hint: name that metric otherwise.")
                    t = torch.as_tensor(v)
                    if t.numel() != 1:
                        raise ConfigError(f"the validation function's {name!r} must be one "
                                          f"number (the batch mean), got shape {tuple(t.shape)}.")
                    sums[name] = sums.get(name, 0.0) + float(t.double()) * k
                count += k
            if most > len(loader):
                like = x if x is not None else default_collate([ds[0]])[0]  # (numpy too)
                for _ in range(most - len(loader)):
                    s.eval_forward(like)  # its output is not counted
        return sums, count

    def close(self) -> None:
        """Stop the default dataset's loading thread."""
        if self._loader is not None:
            self._loader.close()


def reduce_metrics(sums: dict[str, float], count: int, group: Any) -> dict[str, float]:
    """Sample-weighted means of ``sums`` over ``group``, in tensors only (no peer's bytes are
    unpickled). Ranks without samples take the others' metric names; ranks with samples must
    agree on them (checked with one max over the UTF-8 codes and one over their negation).

    Raises:
        ConfigError: The ranks computed different metric names.
    """
    names = sorted(sums) if count else []
    dev = comm.group_device(group)  # a NCCL-only group reduces CUDA tensors only
    if comm.group_size(group) > 1:
        code = torch.tensor(list("\0".join(names).encode()), dtype=torch.int64, device=dev)
        width = comm.allreduce(torch.tensor([code.numel()], device=dev), "max", group=group)
        both = torch.full((2, max(1, int(width.item()))), -1, dtype=torch.int64, device=dev)
        if names:
            both[0].fill_(256)  # padding differs from every byte: lengths must agree too
            both[0, : code.numel()] = code
            both[1] = -both[0]
        else:
            both[1].fill_(-1000)  # below any -code: ranks without samples do not vote
        both = comm.allreduce(both, "max", group=group).cpu()
        hi, lo = both[0], -both[1]
        if not torch.equal(hi, lo) and bool((hi >= 0).any()):
            raise ConfigError(f"the replicas computed different validation metrics (this rank: "
                              f"{names}). Hint: build_validation_func must return the same "
                              "keys on every rank.")
        raw = bytes(int(b) for b in hi.tolist() if 0 <= b < 256)
        names = raw.decode().split("\0") if raw else []
    vec = torch.tensor([float(count)] + [sums.get(n, 0.0) for n in names], dtype=torch.float64)
    if comm.group_size(group) > 1:
        vec = comm.allreduce(vec.to(dev), "sum", group=group).cpu()
    total = vec[0].item()
    result = {n: vec[i + 1].item() / max(total, 1.0) for i, n in enumerate(names)}
    result["samples"] = float(total)
    return result
