"""Training feedback: meters reduced over the data-parallel group, JSONL and console sinks.

Meters accumulate locally (a sum and a count, no communication per step). At log steps and
epoch ends the ranks that report a loss reduce them over the strategy's ``dp_group`` in one
small float64 allreduce, so what is printed is the mean over *all* replicas, not rank 0's.
Exactly one rank (the *printer*: the lowest rank that reports a loss) shows a tqdm progress bar
(samples/s, loss, ETA), prints the one-line summary of each epoch and writes the JSONL file;
every other rank is silent.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO
from collections.abc import Callable, Sequence

import torch

from parlay import comm, runtime
from parlay.errors import ConfigError

__all__ = ["Meter", "reduce_meters", "MetricsLogger", "default_metrics", "choose_printer"]


class Meter:
    """Weighted running mean: ``add(value, weight)``; ``sum``/``count`` are exposed for
    reduction."""

    def __init__(self) -> None:
        self.sum = 0.0
        self.count = 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.sum += float(value) * weight
        self.count += weight

    @property
    def mean(self) -> float:
        """The mean so far (NaN when empty)."""
        return self.sum / self.count if self.count else math.nan

    def reset(self) -> None:
        self.sum = self.count = 0.0


def reduce_meters(meters: list[Meter], group: Any = None) -> list[float]:
    """Means of ``meters`` over every rank of ``group`` (one allreduce; weighted by counts)."""
    flat = torch.tensor([v for m in meters for v in (m.sum, m.count)], dtype=torch.float64)
    if torch.distributed.is_initialized() and comm.group_size(group) > 1:
        # float64 sums stay exact for counts; NCCL-only groups need the tensor on the GPU.
        flat = comm.allreduce(flat.to(comm.group_device(group)), "sum", group=group).cpu()
    pairs = flat.view(-1, 2).tolist()
    return [s / c if c else math.nan for s, c in pairs]


def default_metrics(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., dict[str, torch.Tensor]]:
    """Validation metrics: ``loss`` (the training loss), plus ``accuracy`` for class scores
    (a 2-D output tensor and a 1-D integer target tensor; other outputs and targets, tuples or
    dicts say, get the loss alone)."""
    def fn(output: Any, target: Any) -> dict[str, torch.Tensor]:
        out = {"loss": loss_fn(output, target)}
        if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
            return out
        if output.dim() == 2 and target.dim() == 1 and not target.is_floating_point():
            out["accuracy"] = (output.argmax(1) == target).double().mean()
        return out
    return fn


def choose_printer(trains: bool, reports_loss: bool, group: Any) -> bool:
    """Whether this rank prints: the lowest rank of ``group`` (the training ranks) that reports
    a loss, else its lowest rank; agreed with one int64 allreduce. Ranks that do not train
    (``trains`` False) never print and take no part."""
    if not trains:
        return False
    me = runtime.rank()
    low = torch.tensor([me if reports_loss else 2 ** 62, me], dtype=torch.int64,
                       device=comm.group_device(group))
    if comm.group_size(group) > 1:
        comm.allreduce(low, "min", group=group)
    reporter, lowest = low.tolist()
    return me == (reporter if reporter != 2 ** 62 else lowest)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.4g}"
    return str(v)


class MetricsLogger:
    """Meters, log steps, epoch summaries and sinks for one rank.

    Args:
        printer: Whether this rank prints and writes (exactly one rank should).
        reduces: Whether this rank takes part in the reductions (it reports a loss).
        group: The group to reduce over (the strategy's ``dp_group``).
        total_samples: Samples of the whole run over all replicas (for the bar and ETA).
        initial_samples: Samples already seen (when resuming).
        jsonl_path: File to append one JSON object per event to (None: no file).
        progress: Show a tqdm bar (on the printer, when stderr is a terminal; otherwise the
            printer prints a line at each log step).
        stream: Where summaries go (default ``sys.stdout``).
        epoch_so_far: What :attr:`epoch_so_far` was when the state resumed was saved (the
            log window's two entries may be missing).

    Raises:
        ConfigError: The printer cannot create ``jsonl_path``.
    """

    def __init__(self, *, printer: bool, reduces: bool, group: Any = None,
                 total_samples: int | None = None, initial_samples: int = 0,
                 jsonl_path: str | os.PathLike[str] | None = None, progress: bool = True,
                 stream: TextIO | None = None,
                 epoch_so_far: Sequence[float] | None = None) -> None:
        self.reduces = reduces
        self.group = group
        self.stream = stream or sys.stdout
        self.window = Meter()   # since the last log step
        self.epoch = Meter()    # since the start of the epoch
        self._t0 = self._t_log = self._t_epoch = time.perf_counter()
        self._samples_log = self._samples_epoch = 0
        if epoch_so_far is not None:  # a resumed epoch's summary counts its earlier steps
            total, weight, samples, *window = epoch_so_far  # (older states: no window)
            self.epoch.sum, self.epoch.count, self._samples_epoch = total, weight, int(samples)
            self.window.sum, self.window.count = window or (0.0, 0.0)
        self._file: TextIO | None = None
        self._bar: Any = None
        self._path = jsonl_path
        self.printer = False
        self.set_printer(printer)
        if printer and progress and sys.stderr.isatty():  # a bar in a log file is noise
            from tqdm.auto import tqdm  # type: ignore[import-untyped]

            self._bar = tqdm(total=total_samples, initial=initial_samples, unit="sample",
                             unit_scale=True, dynamic_ncols=True, smoothing=0.1,
                             file=sys.stderr, desc="train")

    def set_printer(self, printer: bool) -> None:
        """Make this rank the one that prints and writes, or not (the first printer may be a
        worker that was lost)."""
        if printer and not self.printer and self._path is not None:
            try:
                Path(self._path).parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self._path, "a", encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"cannot create metrics_path {self._path}: {e}. Hint: a "
                                  "path in a writable folder, or metrics_path=None.") from e
        elif not printer and self._file is not None:
            self._file.close()
            self._file = None
        self.printer = printer

    @property
    def epoch_so_far(self) -> list[float]:
        """This rank's loss sum, its weight and the samples counted in the epoch so far, then
        the loss sum and weight since the last log step: what a resume gives back
        (``epoch_so_far=``) so that the epoch's summary and the next log record cover them."""
        return [self.epoch.sum, self.epoch.count, self._samples_epoch, self.window.sum,
                self.window.count]

    # ------------------------------------------------------------------ sinks
    def write(self, event: str, **fields: Any) -> None:
        """Append one JSON record (printer only)."""
        if self._file is not None:
            rec = {"event": event, "time": round(time.time(), 3), **fields}
            self._file.write(json.dumps(rec, default=float) + "\n")
            self._file.flush()

    def print(self, line: str) -> None:
        """Print one line on the printer, without breaking the progress bar."""
        if not self.printer:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    # ------------------------------------------------------------------ events
    def step(self, loss: float | None, local_samples: int, global_samples: int) -> None:
        """Record one training step (no communication)."""
        if loss is not None and self.reduces:
            self.window.add(loss, local_samples)
            self.epoch.add(loss, local_samples)
        self._samples_log += global_samples
        self._samples_epoch += global_samples
        if self._bar is not None:
            self._bar.update(global_samples)

    def log(self, step: int, epoch: int, lr_factor: float, console: bool = False) -> float:
        """Reduce the window's loss over the group and emit it; returns the mean loss."""
        loss = reduce_meters([self.window], self.group)[0] if self.reduces else math.nan
        now = time.perf_counter()
        rate = self._samples_log / max(now - self._t_log, 1e-9)
        self.window.reset()
        self._t_log, self._samples_log = now, 0
        self.write("train", step=step, epoch=epoch, loss=loss, lr_factor=lr_factor,
                   samples_per_s=rate)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch, refresh=False)
        elif console:
            self.print(f"step {step:>7d}  epoch {epoch}  loss {loss:.4f}  {rate:,.0f} samples/s")
        return loss

    def epoch_end(self, epoch: int, step: int, samples: int | None = None) -> float:
        """Reduce and print the one-line summary of ``epoch``; returns its mean loss.

        Args:
            epoch: The epoch that ended.
            step: The step it ended at.
            samples: Samples trained in it, counted over the replicas (default: the sum of the
                steps' ``global_samples``).
        """
        loss = reduce_meters([self.epoch], self.group)[0] if self.reduces else math.nan
        now = time.perf_counter()
        secs = now - self._t_epoch
        n = self._samples_epoch if samples is None else samples
        rate = n / max(secs, 1e-9)
        self.print(f"epoch {epoch}: loss {loss:.4f}  {n} samples in "
                   f"{secs:.1f} s ({rate:,.0f} samples/s)  step {step}")
        self.write("epoch", epoch=epoch, step=step, loss=loss, samples=n, seconds=secs,
                   samples_per_s=rate)
        self.epoch.reset()
        self._t_epoch, self._samples_epoch = now, 0
        return loss

    def validation(self, step: int, epochs: float, metrics: dict[str, float],
                   seconds: float = 0.0) -> None:
        """Emit validation metrics (already reduced); ``epochs``: epochs done so far. The
        ``seconds`` validation took are left out of the training rates."""
        self._t_log += seconds
        self._t_epoch += seconds
        if metrics:
            self.print(f"validation @ step {step} ({epochs:.2f} epochs): "
                       + "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()))
            self.write("validation", step=step, epochs=epochs, **metrics)

    def close(self) -> None:
        """Close the bar and the file."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
