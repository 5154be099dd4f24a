"""The groups Horovod-style operations travel on.

:class:`TorchGroup` wraps a registered torch process group (the ``process_group=`` path, run
at once). :class:`PrivateGroup` is what a process set's engine owns: c10d backends built
straight from the default store under a prefix unique to the process set and the init
generation (gloo always, NCCL on the first CUDA tensor). It never touches torch's group
registry, so it can be connected lazily, on the first negotiation (by a helper thread when
``poll`` must not block), without racing ``new_group`` calls; only the set's members take part:
a rank that never runs a Horovod-style operation never connects, and no rank waits for it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from parlay import comm, runtime

__all__ = ["Group", "TorchGroup", "PrivateGroup"]


class Group:
    """Collectives over a fixed set of ranks (blocking; failures become ``CommError``)."""

    size: int
    rank: int
    global_ranks: list[int]

    def control_device(self) -> torch.device:
        """Where small control tensors go."""
        return torch.device("cpu")

    def all_reduce(self, t: torch.Tensor, op: int) -> None:
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Broadcast from *global* rank ``root``."""
        raise NotImplementedError

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: int) -> None:
        raise NotImplementedError


class TorchGroup(Group):
    """A registered torch process group, used through ``torch.distributed``."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_ranks = dist.get_process_group_ranks(group)

    def control_device(self) -> torch.device:
        return comm.group_device(self.group)

    def all_reduce(self, t: torch.Tensor, op: int) -> None:
        with comm.comm_errors("allreduce"):
            dist.all_reduce(t, op=comm.c10d_op(op), group=self.group)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        with comm.comm_errors("allgather"):
            comm.all_gather_single(out, t, group=self.group)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        with comm.comm_errors("broadcast"):
            dist.broadcast(t, src=root, group=self.group)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        with comm.comm_errors("alltoall"):
            dist.all_to_all_single(out, t, out_splits, in_splits, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: int) -> None:
        with comm.comm_errors("reducescatter"):
            comm.reduce_scatter_single(out, t, op=comm.c10d_op(op), group=self.group)


class PrivateGroup(Group):
    """Backends of one engine, created from the default store under ``prefix``.

    Args:
        prefix: Store prefix, unique per process set and init generation.
        global_ranks: Members' global ranks, in set-rank order.
    """

    def __init__(self, prefix: str, global_ranks: list[int]) -> None:
        self.prefix = prefix
        self.global_ranks = global_ranks
        self.size = len(global_ranks)
        self.rank = global_ranks.index(dist.get_rank())
        self._store = c10d._get_default_store()  # noqa: SLF001 - the one rendezvous store
        self._timeout = runtime.timeout()
        self._backends: dict[str, Any] = {}
        self._backend("cpu")

    def _backend(self, device: str) -> Any:
        be = self._backends.get(device)
        if be is None:
            store = dist.PrefixStore(f"{self.prefix}/{device}", self._store)
            with comm.comm_errors("process set rendezvous"):
                if device == "cuda":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = self._timeout
                    be = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
                else:
                    be = dist.ProcessGroupGloo(store, self.rank, self.size, self._timeout)
            self._backends[device] = be
        return be

    def _run(self, what: str, t: torch.Tensor, call: Any) -> None:
        with comm.comm_errors(what):
            call(self._backend(t.device.type)).wait()

    def all_reduce(self, t: torch.Tensor, op: int) -> None:
        o = dist.AllreduceOptions()
        o.reduceOp = comm.c10d_op(op)
        self._run("allreduce", t, lambda be: be.allreduce([t], o))

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._run("allgather", t, lambda be: be._allgather_base(out, t))

    def start_all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        """Issue an allgather of CPU tensors; returns its c10d work (``wait``, ``is_completed``)."""
        with comm.comm_errors("allgather"):
            return self._backend("cpu")._allgather_base(out, t)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = self.global_ranks.index(root), 0
        self._run("broadcast", t, lambda be: be.broadcast([t], o))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        self._run("alltoall", t, lambda be: be.alltoall_base(out, t, out_splits, in_splits,
                                                             dist.AllToAllOptions()))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: int) -> None:
        o = dist.ReduceScatterOptions()
        o.reduceOp = comm.c10d_op(op)
        self._run("reducescatter", t, lambda be: be._reduce_scatter_base(out, t, o))
