"""Machine constants measured in the same run as the steps they predict (pure, no torch).

A cached calibration (:mod:`parlay.plan.calibrate`) was measured at another moment: on a
machine whose cores are shared, the CPU-bound terms (compression's encode and decode, a
loopback "link", which is memory copies and sums) move with the load by a factor of two or
more. A benchmark that times those pieces next to each step it predicts (the codec on the
real gradient, one tiny and one gradient-sized allreduce between the same ranks) hands them to
these functions, which fold them into the :class:`~parlay.plan.model.Costs` and
:class:`~parlay.plan.model.Link` the formulas take. The prediction then models what the
measurement cannot give it: the collectives' rounds and bytes on the real link, overlap with
backward, a pipeline's bubble and the servers' traffic.
"""
from __future__ import annotations

import dataclasses

from parlay.errors import ConfigError
from parlay.plan.model import Costs, Link, compressor_of

__all__ = ["with_codec_time", "probe_link", "exchange_link", "scale_cpu"]


def with_codec_time(costs: Costs, compressor: str, numel: float, world: int,
                    seconds: float) -> Costs:
    """``costs`` whose :func:`~parlay.plan.model.codec_s` for ``compressor`` on ``numel``
    elements is ``seconds`` (one encode and decode measured on this machine, now).

    Args:
        costs: The constants to start from (the others are kept).
        compressor: Compression string (``"powersgd:4"``); one without a codec cost
            (``"none"``) returns ``costs``.
        numel: Gradient elements the measurement covered.
        world: Ranks (top-k's decode sums every rank's sparse payload: part of ``seconds``).
        seconds: Measured encode plus decode time.

    Raises:
        ConfigError: ``numel`` not > 0 or ``seconds`` negative.
    """
    if not numel > 0 or not seconds >= 0:
        raise ConfigError(f"a measured codec time needs numel > 0 and seconds >= 0, got "
                          f"numel={numel!r}, seconds={seconds!r}.")
    fields = compressor_of(compressor).cost_fields  # the per-element one first
    if not fields:
        return costs
    return dataclasses.replace(costs, **{f: seconds / numel if i == 0 else 0.0
                                         for i, f in enumerate(fields)})


def probe_link(tiny_s: float, dense_s: float, nbytes: float, world: int,
               costs: Costs, half_s: float | None = None) -> tuple[Link, Costs]:
    """The link and per-collective-step cost two timed allreduces imply.

    A ring allreduce of ``n`` ranks takes ``2(n-1)`` steps (a tiny buffer costs only those)
    and sends ``2(n-1)/n`` of the buffer per rank; on one machine the "bandwidth" includes
    the copies and sums, so it is fitted as payload goodput (efficiency 1).

    Args:
        tiny_s: Seconds for a one-element allreduce.
        dense_s: Seconds for an ``nbytes`` fp32 allreduce.
        nbytes: Bytes of the large buffer.
        world: Ranks in the allreduce (>= 2).
        costs: Constants to update (``alpha_s``; fp32 sums move into the link).
        half_s: Seconds for an fp16/bf16 allreduce of as many elements (optional): gloo sums
            half precision in software, far slower per byte than the fp32 buffer moves.

    Returns:
        ``(link, costs)``.

    Raises:
        ConfigError: Fewer than 2 ranks or non-positive sizes.
    """
    if world < 2 or not nbytes > 0 or not dense_s > 0 or not tiny_s >= 0:
        raise ConfigError(f"a link probe needs world >= 2, nbytes > 0 and positive times, got "
                          f"world={world}, nbytes={nbytes!r}, tiny={tiny_s!r}, "
                          f"dense={dense_s!r}.")
    steps = 2 * (world - 1)
    per_byte = max(dense_s - tiny_s, 1e-3 * dense_s) / (steps / world * nbytes)
    # The measured time already holds the local sums: keep them out of the model's term.
    sums = costs.sum_s_per_elem / 4 * (world - 1) / world * nbytes
    per_byte = max(per_byte - sums / (steps / world * nbytes), 0.5 * per_byte)
    link = Link(8.0 / per_byte, 0.0, 1.0)
    out = dataclasses.replace(costs, alpha_s=tiny_s / steps)
    if half_s is not None:
        numel = nbytes / 4
        extra = max(0.0, half_s - tiny_s - per_byte * steps / world * numel * 2)
        out = dataclasses.replace(out, half_sum_s_per_elem=extra / ((world - 1) / world * numel))
    return link, out


def exchange_link(seconds: float, nbytes: float) -> Link:
    """The link a timed parameter-server exchange implies: each worker pushed ``nbytes``
    (split over the servers, every worker at once) and pulled as many back in ``seconds``.
    On one machine both directions are copies on the same shared cores, so the rate is
    fitted over the two together (payload goodput, efficiency 1).

    Raises:
        ConfigError: Non-positive ``seconds`` or ``nbytes``.
    """
    if not seconds > 0 or not nbytes > 0:
        raise ConfigError(f"an exchange probe needs seconds > 0 and nbytes > 0, got "
                          f"seconds={seconds!r}, nbytes={nbytes!r}.")
    return Link(8.0 * 2 * nbytes / seconds, 0.0, 1.0)


# CPU-bound per-element constants: they scale with how busy the cores are.
_CPU_FIELDS = ("sum_s_per_elem", "half_sum_s_per_elem", "cast_s_per_elem", "topk_s_per_elem",
               "scatter_s_per_elem", "randomk_s_per_elem", "powersgd_s_per_elem",
               "powersgd_s_per_elem_rank", "apply_s_per_elem", "alpha_s")


def scale_cpu(costs: Costs, factor: float, fields: tuple[str, ...] = _CPU_FIELDS) -> Costs:
    """``costs`` with its CPU-bound constants multiplied by ``factor`` (the machine runs
    ``factor`` times slower now than when they were calibrated, e.g. the ratio of a compute
    step timed now to one timed at calibration).

    Raises:
        ConfigError: ``factor`` not > 0.
    """
    if not factor > 0:
        raise ConfigError(f"a load factor must be > 0, got {factor!r}.")
    return dataclasses.replace(costs, **{f: getattr(costs, f) * factor for f in fields})
