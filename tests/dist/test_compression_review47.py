"""Compression review 47: DGC's velocity after an overflowed step, zero-element parameters in
the buckets, and Horovod-style compressors handed to parlay's own optimizers."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import parlay
import parlay.horovod as hvd
from parlay.compress import get_compressor
from parlay.compress.base import NoneCompressor
from parlay.errors import ConfigError
from parlay.local.diloco import DiLoCoOptimizer
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _overflow_once(spec):
    """Steps whose reduced gradient was finite, when rank 0's gradient overflows at step 1 and
    the loop skips non-finite steps as GradScaler does."""
    p = nn.Parameter(torch.zeros(1000))
    opt = parlay.DistributedOptimizer(torch.optim.SGD([p], lr=0.01), named_parameters=[("w", p)],
                                      compression=spec)
    g = torch.Generator().manual_seed(parlay.rank())
    finite = []
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(1000, generator=g)
        if step == 1 and parlay.rank() == 0:
            x[3] = math.inf
        (p * x).sum().backward()
        opt.synchronize()
        finite.append(bool(torch.isfinite(p.grad).all()))
        if finite[-1]:
            with opt.skip_synchronize():
                opt.step()
    return finite


@pytest.mark.parametrize("spec", ["topk:0.1,momentum=0.9,masking=0", "randomk:0.1,momentum=0.9"])
def test_dgc_momentum_recovers_after_one_overflowed_step(spec):
    # The velocity took the inf in place (only the residual was rolled back): every later step
    # was non-finite, so GradScaler skipped them all.
    assert run_world(_overflow_once, 2, spec) == [[True, False, True, True]] * 2


class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.extra = nn.Linear(0, 3, bias=False)  # weight (3, 0): zero elements
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) + self.extra(x[:, :0])


def _train_with_empty(spec, shard, x):
    out = []
    for cap in (25, 1e-6):  # the empty weight inside a bucket, then alone in one
        m = _WithEmpty()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if spec != "local":
            opt = parlay.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                              compression=spec, bucket_cap_mb=cap, shard=shard)
        for _ in range(2):
            opt.zero_grad()
            if spec == "local":  # one process on both ranks' samples: sum / 2 = the average
                (m(x.reshape(4, 4)).sum() / 2).backward()
            else:
                m(x[parlay.rank()]).sum().backward()
            opt.step()
        out.append([m.fc.weight.detach().clone(), m.fc.bias.detach().clone(),
                    tuple(m.extra.weight.shape)])
    return out


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("spec, shard", [(None, None), ("fp16", None), ("topk:1.0", None),
                                         (None, "optimizer")])
def test_a_zero_element_parameter_trains_like_ddp(spec, shard):
    # An empty slice's data_ptr() is 0, so the check that p.grad is still a view into its
    # bucket failed for it: backward raised "the model was converted ...".
    x = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(0))
    want = _train_with_empty("local", None, x)[0]
    for per_cap in run_world(_train_with_empty, 2, spec, shard, x):
        for got in per_cap:
            assert got[2] == (3, 0)
            for g, w in zip(got[:2], want[:2]):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-3)  # fp16 rounds


class _HorovodFP16(hvd.compression.Compressor):  # as Horovod's docs write custom compressors
    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


class _HorovodNone(hvd.Compression.none):  # a subclass of a parlay class, Horovod's way
    @staticmethod
    def compress(tensor):
        return tensor, None


def test_a_horovod_style_compressor_is_refused_at_construction_naming_the_protocol():
    # It was accepted "as is", then compress(flat, key) raised a raw TypeError at the first sync.
    for spec in (_HorovodFP16, _HorovodFP16(), _HorovodNone):
        with pytest.raises(ConfigError, match=r"compress\(flat, key\).*parlay\.horovod\."
                                              r"DistributedOptimizer.*Compressor"):
            get_compressor(spec)
    m = nn.Linear(4, 3)
    with pytest.raises(ConfigError, match="parlay's compressor protocol"):
        DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                        sync_every=1, compression=_HorovodFP16)
    # Horovod's own classes answer both conventions; parlay objects pass unchanged.
    assert isinstance(get_compressor(hvd.Compression.none), NoneCompressor)
    assert type(get_compressor(hvd.Compression.fp16)) is hvd.Compression.fp16
    fp16 = parlay.Compression.fp16()
    assert get_compressor(fp16) is fp16
