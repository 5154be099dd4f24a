"""Local updates with an outer optimizer: DiLoCo, streamed in fragments (Streaming DiLoCo).

Data parallel communicates every step; over slow links every step then waits for the wire.
DiLoCo (Douillard et al. 2023, arXiv 2311.08105) lets each replica take ``H`` inner steps with
its own optimizer, then averages the replicas' *pseudo-gradients* (the weights at the start of
the round minus the current ones) and lets an **outer optimizer** (Nesterov SGD, lr 0.7,
momentum 0.9) apply them to the shared weights, from which every replica goes on. Streaming
DiLoCo (arXiv 2501.18512) splits the model into ``P`` fragments synced at staggered steps (one
every ``H/P`` inner steps), so the wire is busy all the time with a ``P``-th of the model, and
lets each exchange run in the background while inner steps continue, merged ``tau`` steps
later (the local progress made meanwhile is kept on top of the new shared weights).

Pseudo-gradients go through parlay's compressors (fp16/bf16, top-k/random-k with error
feedback, ...) like gradients do; a non-finite average is refused before the outer step.
With ``H=1``, a plain inner SGD and an outer SGD of lr 1.0 without momentum, this is data
parallel training with that SGD.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm
from parlay._validate import check_int
from parlay.compress.base import CommStats, Compressor, check_state_writer, own_compressor
from parlay.compress.reduce import RoundsHandle, reduce_async
from parlay.dp import checks
from parlay.dp.hierarchical import make_reducer
from parlay.dp.wrapped import WrappedOptimizer
from parlay.errors import CommError, ConfigError, NonFiniteError
from parlay.local.fragments import OUTER_DEFAULTS, Fragment, _InFlight, _outer_args, _split
from parlay.nonfinite import all_finite
from parlay.runinfo import stable_repr

__all__ = ["DiLoCoOptimizer", "OUTER_DEFAULTS"]

log = logging.getLogger("parlay")


class DiLoCoOptimizer(WrappedOptimizer):
    """Wrap an inner ``torch.optim`` optimizer: ``step()`` is an inner step, and every
    ``sync_every`` inner steps each fragment's pseudo-gradient is averaged over the group and
    applied by the outer optimizer.

    Every rank must call :meth:`step` the same number of times. All replicas start from rank
    0's weights (broadcast at construction unless ``broadcast=False``: replicas built alike).

    Args:
        optimizer: The inner optimizer, over the model's parameters. A
            :class:`~parlay.DistributedOptimizer` over each host's ranks (e.g. with ``shard=``)
            makes every host one replica: pass the groups of
            :func:`parlay.dp.hierarchical.host_groups` (the host's to it, the cross one as
            ``process_group``); with ``shard=`` each rank syncs only its chunks.
        named_parameters: ``model.named_parameters()`` (names in error messages).
        sync_every: Inner steps per round (``H``).
        fragments: Parameter groups synced at staggered steps (``P``, at most ``H``).
        overlap: Inner steps a fragment's exchange may take before it is merged (``tau``,
            ``0 <= tau < H/P``; 0: wait for it at once).
        outer_optimizer: The outer optimizer's class (default Nesterov SGD, see
            :data:`OUTER_DEFAULTS`).
        outer_optimizer_args: Its arguments.
        compression: Compressor of the pseudo-gradients (``"fp16"``, ``"topk:0.01"``...).
        process_group: The replicas (default: the world).
        hierarchical: ``True`` sums the pseudo-gradients inside each host first, then across
            hosts (``"auto"``: where the replicas span hosts with several ranks each; see
            :mod:`parlay.dp.hierarchical`).
        broadcast: Start every replica from rank 0's weights (off where they already are).
        on_nonfinite: ``"raise"`` (default) a :class:`~parlay.errors.NonFiniteError` when an
            averaged pseudo-gradient is not finite, or ``"skip"`` that round of the fragment
            (every replica goes back to the shared weights).

    Raises:
        ConfigError: Bad arguments.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                 sync_every: int = 100, fragments: int = 1, overlap: int = 0,
                 outer_optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
                 outer_optimizer_args: dict[str, Any] | None = None, compression: Any = None,
                 process_group: Any = None, on_nonfinite: str = "raise",
                 hierarchical: bool | str = False, broadcast: bool = True) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DiLoCoOptimizer wraps a built torch.optim.Optimizer (the inner "
                              f"one), got {optimizer!r}. Hint: DiLoCoOptimizer(torch.optim."
                              "AdamW(model.parameters(), lr=1e-3), model.named_parameters()).")
        super().__init__(optimizer)  # LR schedulers act on the inner one's param_groups
        self.inner = optimizer
        self.sync_every = check_int("sync_every", sync_every, 1)
        n_frag = check_int("fragments", fragments, 1, self.sync_every)
        # Exchanges start floor(H/P) or ceil(H/P) steps apart, the longer gap before fragment
        # 0's: tau < H/P merges each before the next starts (at the same step: merged first).
        if isinstance(overlap, int) and not isinstance(overlap, bool) \
                and overlap * n_frag >= self.sync_every:
            raise ConfigError(f"overlap={overlap} must be below sync_every / fragments = "
                              f"{self.sync_every / n_frag:g} (an exchange is merged before the "
                              f"next one starts). Hint: overlap={(self.sync_every - 1) // n_frag}"
                              ", or a larger sync_every.")
        self.overlap = check_int("overlap", overlap, 0)
        if on_nonfinite not in ("raise", "skip"):
            raise ConfigError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}.")
        self.on_nonfinite = on_nonfinite
        self.compression: Compressor = own_compressor(compression, self)
        self.group = process_group
        self.world = comm.group_size(process_group) if dist.is_initialized() else 1
        self._reducer = make_reducer(hierarchical, process_group, self.compression, self.world)
        bind = getattr(self.compression, "bind", None)  # "auto" agrees its choices over the group
        if callable(bind):  # and sends only summable payloads through a host-first reducer
            bind(process_group, summable_only=self._reducer is not None)
        mine = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        #: A sharded inner optimizer's engine: its chunks are what this rank syncs.
        self._engine = getattr(optimizer, "shard_engine", None)
        if self._engine is not None:
            named = [(self._engine.unit_name(b), s) for b, s in enumerate(self._engine.shards)]
        elif named_parameters is None:
            named = [(f"param{i}", p) for i, p in enumerate(mine)]
        else:  # every given tensor (frozen ones too) starts from rank 0's; each is checked
            named = list(named_parameters)
            checks.named_parameters(optimizer, named)
        outer_args = _outer_args(outer_optimizer, outer_optimizer_args)
        ids = {id(p) for p in mine}
        if self.world > 1:  # the ranks must also agree on which of them are synced
            self._agree_on_schedule(n_frag, [] if self._engine is not None else [
                (n if id(p) in ids else f"{n} (not synced: frozen or not in the inner optimizer)",
                 p) for n, p in named], {
                "outer_optimizer": outer_optimizer, "outer_optimizer_args": outer_args,
                "compression": self.compression, "hierarchical": hierarchical,
                "on_nonfinite": on_nonfinite})
        if self.world > 1 and broadcast:
            for _, p in named:
                comm.broadcast(p.data, src=0, group=process_group)  # (a group rank)
        named = [(n, p) for n, p in named if id(p) in ids]
        if not named:
            raise ConfigError("DiLoCoOptimizer: the optimizer holds no trainable parameter.")
        self.fragments: list[Fragment] = []
        for f, idx in enumerate(_split(named, n_frag)):
            outer = [torch.nn.Parameter(named[i][1].detach().clone()) for i in idx]
            try:
                opt = outer_optimizer(outer, **outer_args)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"could not build the outer optimizer {outer_optimizer!r} "
                                  f"with {outer_args}: {e}. Hint: pass a torch.optim class "
                                  "(e.g. torch.optim.SGD) and its keyword arguments.") from e
            self.fragments.append(Fragment(f, [named[i][0] for i in idx],
                                           [named[i][1] for i in idx], outer, opt,
                                           offset=f * self.sync_every // n_frag))
            layout = getattr(self.compression, "set_layout", None)  # PowerSGD's matrices
            if layout is not None and self._engine is None:  # (a sharded one's chunks: flat)
                layout(f"fragment{f}", [tuple(named[i][1].shape) for i in idx])
        self.steps = 0
        self.merges = 0  #: outer syncs completed (in this process)
        self.stats = CommStats()
        self._synced = {id(p) for frag in self.fragments for p in frag.params}

    def _agree_on_schedule(self, n_frag: int, named: list[tuple[str, torch.Tensor]],
                           settings: dict[str, Any]) -> None:
        """Every replica must sync the same fragments at the same steps (else different rounds
        would be averaged, or mismatched collectives abort): one MIN-allreduce at start. Then
        the same parameters and ``settings`` (the outer step and the wire), which would
        otherwise leave the replicas' shared weights apart or abort the exchange."""
        mine = [self.sync_every, n_frag, self.overlap]
        t = torch.tensor(mine + [-v for v in mine], device=comm.group_device(self.group))
        lo = comm.allreduce(t, "min", group=self.group).tolist()
        if lo[:3] != [-v for v in lo[3:]]:
            spans = ", ".join(f"{n} {a}..{-b}" for n, a, b in
                              zip(("sync_every", "fragments", "overlap"), lo[:3], lo[3:]))
            raise ConfigError(f"DiLoCo replicas disagree on the schedule ({spans} over the "
                              "replicas). Hint: give every rank the same sync_every, "
                              "fragments and overlap.")
        checks.check_consistency(named, self.group,
                                 {k: stable_repr(v) for k, v in settings.items()},
                                 what="build their DiLoCoOptimizer with")

    # ----------------------------------------------------------------- the optimizer face
    #: ``torch.amp.GradScaler.step`` then calls :meth:`step` on an overflow too (setting
    #: ``found_inf`` and ``grad_scale``): the skipped inner step still counts, so a replica
    #: that overflowed alone stays in step with the others.
    _step_supports_amp_scaling = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the inner optimizer's gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; then merge the exchanges that are due and start those whose
        fragment's turn it is.

        Raises:
            CommError: A replica was lost or timed out.
            NonFiniteError: An averaged pseudo-gradient is not finite (``on_nonfinite``).
            ConfigError: An exchange is due while a parameter the inner optimizer steps became
                trainable after construction (refused before the inner step).
        """
        self._refuse_unsynced()
        found_inf, scale = self.__dict__.get("found_inf"), self.__dict__.get("grad_scale")
        if found_inf is not None and bool(found_inf):
            self._after_inner_step()
            return None
        if scale is not None:  # GradScaler left the gradients scaled
            self._unscale_grads(scale)
        out = self.inner.step(closure) if closure is not None else self.inner.step()
        self._after_inner_step()
        return out

    def _after_inner_step(self) -> None:
        self.steps += 1
        for frag in self.fragments:
            if frag.flight is not None and frag.flight.due <= self.steps:
                self._merge(frag)
            elif frag.flight is not None and frag.flight.rounds_left > 0:
                # A further round (int8's, PowerSGD's) starts an inner step after the last,
                # at the same step on every rank (collectives on the group stay in order).
                frag.flight.rounds_left -= 1
                with self._at_sync():
                    frag.flight.handle.advance()  # type: ignore[attr-defined]
            if self._sends_now(frag):
                self._send(frag)

    def _sends_now(self, frag: Fragment, ahead: int = 0) -> bool:
        """Whether ``frag``'s exchange starts at the current inner step (plus ``ahead``)."""
        steps = self.steps + ahead
        return steps > frag.offset and (steps - frag.offset) % self.sync_every == 0

    def step_without_update(self) -> None:
        """Count an inner step this replica skipped (a non-finite or overflowed one): the
        rounds stay in step with the other replicas, which may have taken theirs."""
        self._refuse_unsynced()
        self._after_inner_step()

    def _refuse_unsynced(self) -> None:
        """Refuse the next inner step when an exchange is due at it and a parameter the inner
        optimizer steps became trainable after construction: before the step is taken or
        counted, so :meth:`sync_now` still syncs the whole round."""
        if self._engine is not None or not any(self._sends_now(f, 1) for f in self.fragments):
            return
        unsynced = [p for g in self.inner.param_groups for p in g["params"]
                    if p.requires_grad and id(p) not in self._synced]
        if unsynced:
            raise ConfigError(f"{len(unsynced)} parameter(s) the inner optimizer steps became "
                              "trainable after the DiLoCoOptimizer was built, so they would "
                              "never be synced; this inner step was refused (not taken). Hint: "
                              "call sync_now() (it syncs the parameters this optimizer tracks; "
                              "the newly trainable ones stay each replica's own), then wrap the "
                              "inner optimizer in a new DiLoCoOptimizer (it starts every replica "
                              "from rank 0's weights of all of them).")

    @contextlib.contextmanager
    def shared_weights(self) -> Iterator[None]:
        """Inside this block the model holds the shared (outer) weights, the same on every
        replica (to evaluate them); its own are back after it."""
        with torch.no_grad():
            mine = [[p.detach().clone() for p in frag.params] for frag in self.fragments]
            for frag in self.fragments:
                for p, o in zip(frag.params, frag.outer):
                    p.copy_(o)
        self._written()
        try:
            yield
        finally:
            with torch.no_grad():
                for frag, saved in zip(self.fragments, mine):
                    for p, v in zip(frag.params, saved):
                        p.copy_(v)
            self._written()

    def _written(self) -> None:
        """The synced tensors changed outside an inner step: a sharded inner optimizer's
        model gathers them anew."""
        if self._engine is not None:
            self._engine.reload()

    def sync_now(self) -> None:
        """Finish every exchange under way and sync every fragment at once (e.g. before the
        end of training, so every replica holds the same weights). A fragment with no inner
        step since its last exchange is left as it is; parameters made trainable after
        construction are not synced (each replica keeps its own)."""
        for frag in self.fragments:
            if frag.flight is not None:
                self._merge(frag)
            if self._sends_now(frag) or frag.sent_at == self.steps:
                with torch.no_grad():  # synced at this very step: an outer step on a zero
                    for p, o in zip(frag.params, frag.outer):  # pseudo-gradient would still
                        p.copy_(o)  # move the weights (momentum); so none
                self._written()
                continue
            self._send(frag, wait=True)

    # ----------------------------------------------------------------- one fragment
    def _send(self, frag: Fragment, wait: bool = False) -> None:
        frag.sent_at = self.steps
        flat = torch.cat([(o.detach() - p.detach()).reshape(-1)
                          for o, p in zip(frag.outer, frag.params)])
        key = f"fragment{frag.index}"
        if self._reducer is not None:
            handle = self._reducer.reduce_async(flat, self.compression, key, self.stats)
        elif self.world > 1:
            handle = reduce_async(flat, self.compression, key=key, group=self.group,
                                  stats=self.stats, into=flat)
        else:
            handle = comm.Handle(None, "local", lambda: flat)
        sent = [p.detach().clone() for p in frag.params] if self.overlap and not wait else []
        more = getattr(self.compression, "rounds", 1) - 1 if isinstance(handle, RoundsHandle) else 0
        frag.flight = _InFlight(handle, sent, self.steps + (0 if wait else self.overlap), more)
        if frag.flight.due <= self.steps:
            self._merge(frag)

    @contextlib.contextmanager
    def _at_sync(self) -> Iterator[None]:
        """A sync that timed out: a healthy replica may just be late by its drift."""
        try:
            yield
        except CommError as e:
            if "collective timeout" not in str(e):
                raise
            raise CommError(f"{e} At a DiLoCo sync a healthy but slower replica arrives late by "
                            "its drift over the round, about sync_every="
                            f"{self.sync_every} x the difference in step time: the timeout must "
                            "cover that.", op=e.op, rank=e.rank, peer=e.peer) from e

    def _merge(self, frag: Fragment) -> None:
        flight = frag.flight
        assert flight is not None
        frag.flight = None
        self.merges += 1
        with self._at_sync():
            avg = flight.handle.wait()
        if self.world > 1:
            avg = avg / self.world
        with torch.no_grad():
            if not all_finite([avg]):
                if self.on_nonfinite == "raise":
                    raise NonFiniteError(
                        f"the averaged pseudo-gradient of fragment {frag.index} "
                        f"({', '.join(frag.names[:3])}{', ...' if len(frag.names) > 3 else ''})"
                        f" at inner step {self.steps} is not finite; the outer step was not "
                        "applied. Hint: lower the inner learning rate or clip gradients.",
                        step=self.steps, rank=comm.group_rank(self.group) if self.world > 1
                        else 0, parameter=frag.names[0])
                log.warning("the averaged pseudo-gradient of fragment %d at inner step %d is not "
                            "finite: its outer step is skipped, every replica goes back to the "
                            "shared weights and the compression state starts afresh",
                            frag.index, self.steps)
                self.compression.load_state_dict({})  # residuals may hold the non-finite values
                for p, o in zip(frag.params, frag.outer):  # skip: back to the shared weights
                    p.copy_(o)
                self._written()
                return
            off = 0
            for o in frag.outer:
                o.grad = avg[off:off + o.numel()].view_as(o).to(o.dtype)
                off += o.numel()
            frag.optimizer.step()
            frag.optimizer.zero_grad(set_to_none=True)
            for i, (p, o) in enumerate(zip(frag.params, frag.outer)):
                if flight.sent_from:  # keep what the replica learned while the exchange ran
                    p.add_(o - flight.sent_from[i])
                else:
                    p.copy_(o)
        self._written()

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The inner and outer optimizers' state, the round position and any exchange under
        way, which is finished first: **every rank must call it at the same inner step** (as
        FSDP's), not rank 0 alone. With a compressor of several rounds (``"int8"``, PowerSGD;
        fp16 after an overflow) and ``overlap >= 1`` finishing runs the exchange's remaining
        collective rounds, so one rank calling it alone can mismatch the ranks' collectives (gloo
        aborts, or the ranks time out). Let each rank save its own (replicas differ)."""
        return super().state_dict()

    def _state(self) -> dict[str, Any]:
        """:meth:`state_dict`'s content."""
        flights = []
        for frag in self.fragments:
            f = frag.flight
            flights.append(None if f is None else {"avg": f.handle.wait(), "world": self.world,
                                                   "sent_from": f.sent_from, "due": f.due})
        return {"inner": self.inner.state_dict(), "steps": self.steps,
                "outer": [[o.detach().clone() for o in frag.outer] for frag in self.fragments],
                "outer_optimizers": [frag.optimizer.state_dict() for frag in self.fragments],
                "flights": flights, "compression": self.compression.state_dict(),
                "compressor": repr(self.compression),
                "sent_at": [frag.sent_at for frag in self.fragments]}

    def _load_state(self, state: dict[str, Any]) -> None:
        """:meth:`load_state_dict`: restore :meth:`state_dict`.

        Raises:
            ConfigError: It is no DiLoCo state, or was written with another number of
                fragments or another compressor (whose error-feedback state this one would
                drop).
        """
        if not {"inner", "outer", "flights"} <= state.keys():
            raise ConfigError(f"not a DiLoCo optimizer state (keys {sorted(state)[:6]}). Hint: "
                              "load what DiLoCoOptimizer.state_dict() returned (a Trainer "
                              "checkpoint's optimizer state); the inner optimizer's own state "
                              "goes to opt.inner.load_state_dict().")
        check_state_writer(self.compression, state.get("compression"), state.get("compressor"))
        if len(state["outer"]) != len(self.fragments):
            raise ConfigError(f"this DiLoCo state has {len(state['outer'])} fragment(s), the "
                              f"optimizer {len(self.fragments)}; resume with the same fragments.")
        self.inner.load_state_dict(state["inner"])
        self.steps = int(state["steps"])
        sent_at = state.get("sent_at", [0] * len(self.fragments))  # older states: none
        for frag, outer, opt_sd, flight, sent in zip(self.fragments, state["outer"],
                                                     state["outer_optimizers"],
                                                     state["flights"], sent_at):
            frag.sent_at = int(sent)
            with torch.no_grad():
                for o, saved in zip(frag.outer, outer):
                    o.copy_(saved)
            frag.optimizer.load_state_dict(opt_sd)
            if flight is not None:  # a sum over the replicas that saved it: rescaled to ours
                total = flight["avg"] * (self.world / flight["world"]) \
                    if flight.get("world", self.world) != self.world else flight["avg"]
                flight = _InFlight(comm.Handle(None, "restored", functools.partial(
                    torch.Tensor.clone, total)), list(flight["sent_from"]), int(flight["due"]))
            frag.flight = flight
        if state.get("compression"):
            self.compression.load_state_dict(state["compression"])
        self._written()

    def comm_stats(self) -> dict[str, float]:
        """Pseudo-gradient bytes so far: dense and on the wire, per inner step."""
        d = self.stats.as_dict()
        steps = max(1, self.steps)
        return {**d, "steps": self.steps, "dense_bytes_per_step": d["dense_bytes"] / steps,
                "wire_bytes_per_step": d["wire_bytes"] / steps}
