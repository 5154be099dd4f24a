"""The c10d backends Horovod-style operations travel on.

A :class:`Group` is either a registered torch group's own backends (the ``process_group=`` path,
run at once) or, for a process set's engine, backends built straight from the default store
under a prefix unique to the set and the init generation (gloo always, NCCL on the first CUDA
tensor). The latter never touch torch's group registry, so they can be connected lazily, on the
first negotiation (by a helper thread when ``poll`` must not block), without racing
``new_group`` calls; only the set's members take part: a rank that never runs a Horovod-style
operation never connects, and no rank waits for it.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from parlay import comm, runtime
from parlay.reduce_ops import c10d_op

__all__ = ["Group"]


class Group:
    """Blocking collectives over fixed ranks on c10d backends (failures become ``CommError``).

    Args:
        global_ranks: Members' global ranks, in group-rank order.
        backend: Returns the c10d backend for a device type (``"cpu"`` or ``"cuda"``).
        control: Where small control tensors go.
    """

    def __init__(self, global_ranks: list[int], backend: Callable[[str], Any],
                 control: torch.device) -> None:
        self.global_ranks = global_ranks
        self.size = len(global_ranks)
        self.rank = global_ranks.index(dist.get_rank())
        self._backend = backend
        self._control = control

    @classmethod
    def of_torch_group(cls, group: Any) -> Group:
        """A registered torch process group's backends."""
        pg = group if group is not None else c10d._get_default_group()
        return cls(dist.get_process_group_ranks(pg),
                   lambda device: pg._get_backend(torch.device(device)),
                   comm.group_device(group))

    @classmethod
    def private(cls, prefix: str, global_ranks: list[int]) -> Group:
        """Backends of their own, created from the default store under ``prefix``."""
        store = c10d._get_default_store()
        timeout, me = runtime.timeout(), global_ranks.index(dist.get_rank())
        made: dict[str, Any] = {}

        def backend(device: str) -> Any:
            if device not in made:
                sub = dist.PrefixStore(f"{prefix}/{device}", store)
                with comm.comm_errors("process set rendezvous"):
                    if device == "cuda":
                        opts = dist.ProcessGroupNCCL.Options()
                        opts._timeout = timeout
                        made[device] = dist.ProcessGroupNCCL(sub, me, len(global_ranks), opts)
                    else:
                        made[device] = dist.ProcessGroupGloo(sub, me, len(global_ranks), timeout)
            return made[device]
        backend("cpu")
        return cls(global_ranks, backend, torch.device("cpu"))

    def control_device(self) -> torch.device:
        """Where small control tensors go."""
        return self._control

    def _run(self, what: str, t: torch.Tensor, call: Callable[[Any], Any]) -> None:
        with comm.comm_errors(what, group=self.global_ranks):
            call(self._backend(t.device.type)).wait()

    def all_reduce(self, t: torch.Tensor, op: int) -> None:
        o = dist.AllreduceOptions()
        o.reduceOp = c10d_op(op)
        self._run("allreduce", t, lambda be: be.allreduce([t], o))

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._run("allgather", t, lambda be: be._allgather_base(out, t))

    def start_all_gather(self, out: torch.Tensor, t: torch.Tensor,
                         timeout: datetime.timedelta | None = None) -> Any:
        """Issue an allgather of CPU tensors; returns its c10d work (``wait``, ``is_completed``).
        ``timeout`` replaces the group's for this one."""
        opts = c10d.AllgatherOptions()
        if timeout is not None:
            opts.timeout = timeout
        with comm.comm_errors("allgather"):
            return self._backend("cpu")._allgather_base(out, t, opts)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Broadcast from *global* rank ``root``."""
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = self.global_ranks.index(root), 0
        self._run("broadcast", t, lambda be: be.broadcast([t], o))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        self._run("alltoall", t, lambda be: be.alltoall_base(out, t, out_splits, in_splits,
                                                             dist.AllToAllOptions()))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: int) -> None:
        o = dist.ReduceScatterOptions()
        o.reduceOp = c10d_op(op)
        self._run("reducescatter", t, lambda be: be._reduce_scatter_base(out, t, o))
