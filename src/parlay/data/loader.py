"""DataLoader construction where workers and prefetching actually take effect.

Two things the original TensorLayer trainer got wrong are fixed here:

* Prefetching is real. With ``num_workers > 0`` the loader's workers keep ``prefetch`` batches
  each in flight (``DataLoader(prefetch_factor=...)``, persistent until ``close()``); that is the
  default (``prefetch=None``: 2). With ``num_workers=0`` loading is inline by default; an
  explicit ``prefetch=k`` keeps ``k`` batches ready in a background thread of this process.
  That thread runs the dataset's ``__getitem__`` while the step runs, so a dataset that draws
  from torch's global RNG (random augmentation) races with dropout there and a run is not
  reproducible. Worker processes have their own RNGs, seeded per rank from ``seed``, but a
  resume restarts them from that seed, so only inline loading resumes bit-exact. (For in-memory
  tensor datasets a batch is one ``index_select``; a thread measured slower there.)
* In-memory tensor datasets (``TensorDataset`` and ``parlay.data.mnist``, unless a subclass
  overrides ``__getitem__``) are fetched one batch at a time with a single fancy index instead
  of ``batch_size`` ``__getitem__`` calls and a collate: almost nothing next to the step.

The loader never touches the global RNG (it gets its own generator), so creating an iterator
mid-run does not change dropout masks or anything else a resumed run must reproduce.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, Sampler,
                              TensorDataset, default_collate)

from parlay.errors import ConfigError

__all__ = ["build_loader", "check_dataset", "IndexBatchSampler", "Prefetcher"]


def check_dataset(name: str, dataset: Any, pairs: bool = True) -> None:
    """Raise ConfigError unless ``dataset`` is a map-style dataset (of ``(input, target)``
    pairs with ``pairs``: its first sample is read to see)."""
    hint = ("Hint: for arrays X, y pass parlay.data.from_arrays(X, y) (or torch.utils.data."
            "TensorDataset(X, y)), not the tuple (X, y); a Dataset's __getitem__(i) returns "
            "(input, target).")
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") \
            or not hasattr(dataset, "__len__"):
        raise ConfigError(f"{name} must be a map-style Dataset (a sized dataset, with __len__ "
                          f"and __getitem__), got {type(dataset).__name__}. {hint}")
    sample = dataset[0] if pairs and len(dataset) else (None, None)
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        size = f" of {len(sample)}" if isinstance(sample, (tuple, list)) else ""
        raise ConfigError(f"each sample of {name} must be an (input, target) pair; {name}[0] is "
                          f"a {type(sample).__name__}{size}. {hint}")


def _collate(batch: list[Any]) -> Any:
    """``default_collate``, with a hint when the samples differ in shape."""
    try:
        return default_collate(batch)
    except RuntimeError as e:
        if "equal size" not in str(e):
            raise
        raise ConfigError(f"the samples of one batch differ in shape ({e}). Hint: pad or crop "
                          "them to one shape in the dataset's __getitem__ (or give "
                          "build_loader a collate_fn that pads them).") from e


class _BatchIndexed(Dataset[Any]):
    """View of a tensor dataset whose ``__getitem__`` takes a whole list of indices."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def __getitem__(self, idx: list[int]) -> tuple[torch.Tensor, ...]:
        ix = torch.as_tensor(idx, dtype=torch.long)
        return tuple(t.index_select(0, ix) for t in self.tensors)


class IndexBatchSampler(Sampler[list[int]]):
    """Group a sampler's indices into lists of ``batch_size`` (the last may be shorter)."""

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool = False) -> None:
        self._inner = BatchSampler(sampler, batch_size, drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


def _tensor_view(dataset: Dataset[Any]) -> tuple[torch.Tensor, ...] | None:
    tensors = getattr(dataset, "tensors", None)
    # A subclass overriding __getitem__ (a transform) must be read through it.
    if (isinstance(tensors, tuple) and tensors
            and all(isinstance(t, torch.Tensor) for t in tensors)
            and type(dataset).__getitem__ is TensorDataset.__getitem__):
        return tuple(tensors)
    return None


class Prefetcher:
    """Iterate ``source`` in a background thread, keeping up to ``depth`` items ready.

    Errors raised while loading are re-raised in the consumer. :meth:`close` stops the thread.
    """

    _END, _NONE = object(), object()  # the end; nothing received yet (None is an item)

    def __init__(self, source: Iterable[Any], depth: int) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._end: Any = self._NONE  # _END or the loading error, once the consumer met it
        self._thread = threading.Thread(target=self._run, args=(iter(source),),
                                        name="parlay-prefetch", daemon=True)
        self._thread.start()

    def _run(self, it: Iterator[Any]) -> None:
        try:
            for item in it:
                self._put(item)
                if self._stop.is_set():
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        item = self._end
        while item is self._NONE:  # bounded waits: a thread that ended leaves no caller blocked
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    item = self._END
        if item is self._END:
            self._end = item  # an iterator that ended (or failed) ends (fails) again
            raise StopIteration
        if isinstance(item, BaseException):
            self._end = item
            raise item
        return item

    def close(self) -> None:
        """Stop the loading thread (pending items are dropped)."""
        self._stop.set()
        self._thread.join(timeout=5)


class _Loader:
    """What :func:`build_loader` returns: iterable once per epoch, closable."""

    def __init__(self, loader: DataLoader[Any], prefetch: int, threaded: bool) -> None:
        self.loader = loader
        self.prefetch = prefetch
        self.threaded = threaded
        self._live: Prefetcher | None = None

    def __iter__(self) -> Iterator[Any]:
        self._stop_thread()
        if self.threaded:
            self._live = Prefetcher(self.loader, self.prefetch)
            return self._live
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def _stop_thread(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None

    def close(self) -> None:
        """Stop the loading thread and worker processes (the next ``iter()`` restarts them)."""
        self._stop_thread()
        it = getattr(self.loader, "_iterator", None)  # persistent workers' iterator
        if it is not None:
            getattr(it, "_shutdown_workers", lambda: None)()
            self.loader._iterator = None


def build_loader(dataset: Dataset[Any], sampler: Sampler[int], batch_size: int, *,
                 num_workers: int = 0, prefetch: int | None = None, pin_memory: bool = False,
                 drop_last: bool = False, collate_fn: Any = None, seed: int = 0,
                 rank: int = 0) -> _Loader:
    """A loader over ``sampler``'s indices of ``dataset`` in batches of ``batch_size``.

    Args:
        dataset: A map-style dataset. Tensor datasets are fetched a whole batch per index.
        sampler: Yields this rank's sample indices (e.g. :class:`ShardedSampler`).
        batch_size: Samples per batch on this rank.
        num_workers: Worker processes (``0``: load in this process).
        prefetch: Batches kept ready: per worker (``prefetch_factor``) with workers, else in
            total by a background thread (see the module docstring on its RNG); ``0``: inline;
            ``None``: 2 with workers, else inline.
        pin_memory: Pin host memory (worth it when training on CUDA).
        drop_last: Drop this rank's last, shorter batch.
        collate_fn: Custom collate for non-tensor datasets.
        seed, rank: Seed the worker processes' RNGs (torch, ``random``, NumPy's legacy one) from
            these: distinct per rank, reproducible per run. Checkpoints keep no worker RNG
            state: after a resume the workers' draws restart from this seed.

    Returns:
        An object whose ``iter()`` starts one pass (from the sampler's current position).

    Raises:
        ConfigError: Bad sizes or counts, or ``dataset`` is not map-style.
    """
    check_dataset("the dataset", dataset, pairs=False)
    tensors = _tensor_view(dataset) if collate_fn is None else None
    if prefetch is None:
        prefetch = 0 if num_workers == 0 else 2
    for name, v, lo in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0),
                        ("prefetch", prefetch, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be an int >= {lo}, got {v!r}.")
    if num_workers > 0 and prefetch < 1:
        raise ConfigError("with num_workers > 0, prefetch (batches in flight per worker) must "
                          f"be >= 1, got {prefetch}. Hint: prefetch=2.")
    batches = IndexBatchSampler(sampler, batch_size, drop_last)
    worker_opts: dict[str, Any] = {}
    if num_workers > 0:
        worker_opts = dict(num_workers=num_workers, prefetch_factor=prefetch,
                           persistent_workers=True)
    # A private generator: DataLoader otherwise draws its base seed from the global RNG each
    # time an iterator is created, which would make a resumed run diverge.
    gen = torch.Generator().manual_seed((seed * 100_003 + rank) % 2**64)
    if tensors is not None:
        loader = DataLoader(_BatchIndexed(tensors), batch_size=None, sampler=batches,
                            pin_memory=pin_memory, generator=gen, **worker_opts)
    else:
        loader = DataLoader(dataset, batch_sampler=batches, pin_memory=pin_memory,
                            collate_fn=collate_fn or _collate, generator=gen, **worker_opts)
    return _Loader(loader, prefetch, threaded=num_workers == 0 and prefetch > 0)
