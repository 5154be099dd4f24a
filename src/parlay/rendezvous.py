"""The loopback rendezvous of a one-node ``parlay run`` (:mod:`parlay.launch` registers it).

torchrun's ``--standalone`` hosts its c10d store with a ``TCPStore`` that listens on every
interface, and shares a second one, also on every interface, with the workers. A
single-node ``parlay run`` instead registers the rendezvous backend ``parlay-local``: the
same c10d ``DynamicRendezvousHandler`` over a ``TCPStore`` whose listening socket is bound
to ``127.0.0.1`` (``TCPStore(master_listen_fd=...)``: the store has no bind-address
option), and that one store is shared with the workers, so ``MASTER_ADDR=127.0.0.1`` and
``MASTER_PORT`` is ``--master-port`` when given (else a free port). Gloo's own sockets are
kept on loopback too (``GLOO_SOCKET_IFNAME=lo`` unless the user set it).
"""
from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any

__all__ = ["LOOPBACK_BACKEND", "register_loopback_rendezvous"]

#: Name of the loopback rendezvous backend registered with torchrun.
LOOPBACK_BACKEND = "parlay-local"


def _loopback_store(port: int, timeout_s: float) -> Any:
    """A TCPStore server listening on 127.0.0.1 only (port 0: a free one)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, multi_tenant=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on 127.0.0.1:{port}: {e.strerror}") from e
    return store


def _create_loopback_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import \
        C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    class LoopbackBackend(C10dRendezvousBackend):
        """torch's c10d rendezvous state on the loopback store, under this backend's name."""

        @property
        def name(self) -> str:
            return LOOPBACK_BACKEND

    store = _loopback_store(port, float(params.get_as_int("read_timeout", 60) or 60))
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The workers' store is this same loopback server (torch would open a second one on
    # every interface); the agent's own keys live under torch's rendezvous prefix.
    # torch has no argument for an existing store: replace this one handler's factory.
    handler._create_tcp_store_server = (  # type: ignore[method-assign]  # noqa: SLF001
        lambda master_addr, master_port: store)
    return handler


def register_loopback_rendezvous() -> None:
    """Register :data:`LOOPBACK_BACKEND` with torchrun's rendezvous registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    with contextlib.suppress(ValueError):  # already registered
        registry.register(LOOPBACK_BACKEND, _create_loopback_handler)
