"""Fuzzing everything that parses outside input: cluster descriptions, compression and
consistency specs, parameter-server messages (checkpoint and snapshot files:
``test_fuzz_files.py``).

Whatever the input, the only exceptions that may come out are parlay's documented ones
(:class:`~parlay.errors.ParlayError`: ``ConfigError``, ``CheckpointError``, ``CommError``);
an ``IndexError``, ``KeyError``, ``RuntimeError``, ``UnpicklingError`` ... is a bug. Tests of
cases that still fail are marked ``xfail(strict=True)`` with the failing input and the owner's
module: once fixed they pass, the strict marker turns that into a failure, and the marker goes.
(Cluster detection from whole environments is fuzzed in ``test_env_hypothesis.py``.)
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from parlay.compress import Compressor, available, get_compressor
from parlay.env import TaskSpec, detect
from parlay.errors import CommError, ConfigError
from parlay.ps import wire
from parlay.ps.consistency import Consistency, get_consistency

FAST = settings(max_examples=100, deadline=None)

# ------------------------------------------------------------------ cluster descriptions
addresses = st.one_of(
    st.builds("{}:{}".format, st.sampled_from(["a", "b", "node0", "10.0.0.1", "[::1]"]),
              st.integers(1, 3)),
    st.builds("{}:{}".format, st.sampled_from(["", "a b", "::1", "[::1", "a/b", "é", "a\x00"]),
              st.one_of(st.integers(-2, 70000), st.text(max_size=3))),
    st.text(max_size=10), st.integers(), st.none(), st.floats())
host_lists = st.one_of(st.lists(addresses, max_size=4), st.text(max_size=6), st.integers(),
                       st.none(), st.dictionaries(st.text(max_size=2), addresses, max_size=2))
indices = st.one_of(st.integers(-2, 5), st.text(max_size=3), st.floats(), st.booleans(),
                    st.none(), st.integers(min_value=2**62))
task_types = st.one_of(st.sampled_from(["ps", "worker", "chief", "evaluator", "master", "Ps"]),
                       st.text(max_size=6), st.integers(), st.none())


@FAST
@given(task_types, indices, host_lists, host_lists, host_lists, host_lists)
def test_task_spec_construction(task_type, index, ps, workers, chief, evaluators) -> None:
    try:
        spec = TaskSpec(task_type=task_type, index=index, ps_hosts=ps, worker_hosts=workers,
                        chief_hosts=chief, evaluator_hosts=evaluators)
    except ConfigError:
        return
    if spec.rank is not None:
        assert 0 <= spec.rank < spec.world_size == len(spec.cluster_hosts)
    assert 1 <= spec.master_port <= 65535 and spec.master_addr
    assert 0 <= spec.local_index() <= max(spec.index, 0)


tf_configs = st.one_of(
    st.text(max_size=60),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                 lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.sampled_from(["cluster", "task", "type", "index", "ps",
                                                    "worker", "chief", "evaluator", "x"]),
                                   inner, max_size=4),
                 max_leaves=16).map(json.dumps),
    st.builds(lambda c, t, i: json.dumps({"cluster": c, "task": {"type": t, "index": i}}),
              st.dictionaries(st.sampled_from(["ps", "worker", "chief", "evaluator", "boss"]),
                              st.lists(addresses.filter(lambda a: a is None or isinstance(
                                  a, (int, str))), max_size=3), max_size=3),
              st.sampled_from(["ps", "worker", "chief", "evaluator", "boss"]), indices.filter(
                  lambda i: not isinstance(i, float) or i == i)))


@FAST
@given(tf_configs)
def test_task_spec_from_tf_config(text: str) -> None:
    try:
        spec = TaskSpec.from_tf_config(text)
    except ConfigError:
        return
    assert spec.rank is None or 0 <= spec.rank < spec.world_size


# A complete torchrun environment with one variable replaced by arbitrary text: reaches the
# checks behind the first one, which fully random environments rarely do.
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "abc", "PARLAY_NUM_PS": "1"}
odd_text = st.one_of(st.text(max_size=12), st.sampled_from(
    ["", " ", "-1", "0", "4", "99999999999999999999", "1e3", "0x10", "٣", "1_0", "+2", "nan",
     "２", "\x00", "[::1]", "a:b"]))


@FAST
@given(st.sampled_from(sorted(TORCHRUN)), odd_text, st.sampled_from(["TF_CONFIG", "SLURM_PROCID",
                                                                      "OMPI_COMM_WORLD_RANK",
                                                                      None]))
def test_launcher_environment_with_one_odd_value(name, value, extra) -> None:
    env = {**TORCHRUN, name: value}
    if extra:
        env[extra] = value
    for parse in (detect, TaskSpec.from_env):
        try:
            parse(env)
        except ConfigError:
            pass


# ------------------------------------------------------------------ spec strings
option_names = st.sampled_from(["ratio", "ef", "momentum", "warmup", "warmup_start", "masking",
                                "seed", "rank", "warm_start", "min_compression", "init_scale",
                                "dynamic", "junk", ""])
option_values = st.one_of(st.text(max_size=6), st.sampled_from(
    ["0", "1", "-1", "0.5", "1e309", "-1e309", "nan", "inf", "true", "False", "no", "",
     "1" * 40, "0.01", "٣", "1_0", "0x1"]))
options = st.lists(st.one_of(option_values, st.builds("{}={}".format, option_names,
                                                      option_values)), max_size=4)
compression_specs = st.one_of(
    st.text(max_size=30),
    st.builds(lambda n, o, sep: n + sep + ",".join(o),
              st.sampled_from([*available(), "TopK", " fp16 ", "x", "", "top k"]), options,
              st.sampled_from([":", "::", ": ", ""])))


@settings(max_examples=300, deadline=None)
@given(compression_specs)
@example("topk:0.01,momentum=0.9,warmup=500")
@example("powersgd:4,ef=0")
def test_compression_spec(spec: str) -> None:
    try:
        comp = get_compressor(spec)
    except ConfigError:
        return
    assert isinstance(comp, Compressor)
    # What the parser accepts must work on a gradient (PowerSGD and int8 refuse a single round
    # with a ConfigError: they need their two collectives).
    flat = torch.linspace(-1.0, 1.0, 64)
    try:
        payload, ctx = comp.compress(flat.clone(), "fuzz")
        out = comp.decompress(payload, ctx)
    except ConfigError:
        return
    assert out.shape == flat.shape
    # fp16 with a large scale overflows by design: its second round resends full precision.
    assert comp.name == "fp16" or torch.isfinite(out).all()


# "fp16:0", "fp16:nan" and "fp16:inf" are refused when parsed (a zero scale divided by zero at
# the first decompress; nan/inf gave NaN gradients).
@pytest.mark.parametrize("spec", ["fp16:0", "fp16:nan", "fp16:inf", "fp16:-2", "fp16:3"])
def test_fp16_scale_that_is_zero_or_not_finite(spec: str) -> None:
    with pytest.raises(ConfigError, match="init_scale"):
        get_compressor(spec)


consistency_specs = st.one_of(
    st.text(max_size=12),
    st.builds("{}{}{}".format, st.sampled_from(["sync", "async", "stale", "STALE", " stale",
                                                "ssp", ""]),
              st.sampled_from([":", "", "::", ": "]), option_values))


@settings(max_examples=300, deadline=None)
@given(consistency_specs)
@example("stale:2")
@example("stale:+3")
def test_consistency_spec(spec: str) -> None:
    try:
        policy = get_consistency(spec)
    except ConfigError:
        return
    assert isinstance(policy, Consistency)
    assert policy.bound is None or (isinstance(policy.bound, int) and policy.bound >= 0)
    assert get_consistency(policy.name) == policy  # the canonical spelling parses back


# ------------------------------------------------------------------ parameter-server wire
dtypes = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16,
                          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
payloads = st.lists(st.builds(lambda dt, shape: torch.ones(shape).to(dt), dtypes,
                              st.lists(st.integers(0, 4), max_size=3)), max_size=wire.MAX_TENSORS)
messages = st.builds(wire.Message, op=st.integers(0, 13), sender=st.integers(0, 2**31),
                     step=st.integers(-2**63, 2**63 - 1), version=st.integers(0, 2**40),
                     scalar=st.floats(allow_nan=False), extra=st.integers(-1, 2**31),
                     tensors=payloads)


def _packed(msg: wire.Message) -> torch.Tensor:
    size = sum(t.numel() * t.element_size() for t in msg.tensors)
    return wire.pack(msg, torch.zeros(wire.capacity(size, wire.MAX_TENSORS), dtype=torch.uint8))


@FAST
@given(messages)
def test_wire_round_trip(msg: wire.Message) -> None:
    got = wire.unpack(_packed(msg).clone(), clone=True)
    assert (got.op, got.sender, got.step, got.version, got.scalar, got.extra) == (
        msg.op, msg.sender, msg.step, msg.version, msg.scalar, msg.extra)
    assert len(got.tensors) == len(msg.tensors)
    for a, b in zip(got.tensors, msg.tensors):
        assert a.dtype == b.dtype and torch.equal(a, b)


# A short, truncated or malformed buffer (random bytes; a header naming dtype code 99 or -1, a
# negative or huge dimension, more tensors than MAX_TENSORS; context codes that are not a
# context) must fail with CommError, the error for anything that arrives from a peer.
NO_SHRINK = settings(max_examples=200, deadline=None, database=None)


def _unpack(buf: torch.Tensor) -> None:
    try:
        msg = wire.unpack(buf, clone=True)
    except CommError:
        return
    assert len(msg.tensors) <= wire.MAX_TENSORS


@NO_SHRINK
@given(st.binary(max_size=400))
@example(bytes(10))
def test_wire_unpack_random_bytes(data: bytes) -> None:
    _unpack(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
            torch.empty(0, dtype=torch.uint8))


@NO_SHRINK
@given(messages, st.floats(0.0, 1.0), st.integers(0, wire.HEADER_INTS - 1),
       st.integers(-2**63, 2**63 - 1))
def test_wire_unpack_truncated_or_mutated(msg, cut, field, value) -> None:
    buf = _packed(msg).clone()
    head = buf[:wire.HEADER_BYTES].clone()
    head.view(torch.int64)[field] = value
    _unpack(buf[:int(cut * buf.numel())])
    _unpack(torch.cat([head, buf[wire.HEADER_BYTES:]]))


@NO_SHRINK
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=12))
def test_wire_decode_ctx_random_codes(codes: list[int]) -> None:
    comp = get_compressor("topk:0.1")
    _, ctx = comp.compress(torch.linspace(-1, 1, 50), "k")
    try:
        wire.decode_ctx(torch.tensor(codes, dtype=torch.int64), ctx)
    except CommError:
        pass
