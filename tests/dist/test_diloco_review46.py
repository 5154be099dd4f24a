"""DiLoCoOptimizer: PowerSGD's tensor layout, foreign states, the overlap bound, and the hint of
a sync that timed out."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlay
from parlay.compress.auto import AutoCompressor
from parlay.errors import CommError, ConfigError
from parlay.local.diloco import DiLoCoOptimizer
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _update(compression):
    """One inner SGD step of one sample (an update of rank 1) and a plain outer SGD step."""
    torch.manual_seed(0)
    m = nn.Linear(64, 48).double()
    w0 = [p.detach().clone() for p in m.parameters()]
    g = torch.Generator().manual_seed(100 + parlay.rank())
    x = torch.randn(1, 64, generator=g, dtype=torch.float64)
    y = torch.randn(1, 48, generator=g, dtype=torch.float64)
    opt = DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                          sync_every=1, compression=compression,
                          outer_optimizer_args={"lr": 1.0})
    nn.functional.mse_loss(m(x), y).backward()
    opt.step()
    return [p.detach() - w for p, w in zip(m.parameters(), w0)]


def _powersgd_vs_exact():
    return _update(None), _update("powersgd:2")


def test_powersgd_compresses_each_tensor_of_a_fragment_as_a_matrix():
    # The average of two rank-1 weight updates is rank 2: PowerSGD of rank 2 passes it exactly
    # when it sees the 48 x 64 weight (it saw the fragment as one near-square matrix: 92% off).
    for exact, got in run_world(_powersgd_vs_exact, 2):
        for a, b in zip(got, exact):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_auto_compression_gives_its_powersgd_candidate_each_fragment_s_layout():
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    auto = AutoCompressor(["powersgd:2", "none"])
    DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                    sync_every=4, fragments=2, compression=auto)
    assert auto.cands["powersgd:2"]._layouts == {  # type: ignore[attr-defined]
        "fragment0": [(4, 3)], "fragment1": [(4,), (2, 4), (2,)]}


def test_a_state_diloco_did_not_write_is_refused_naming_what_to_load():
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = DiLoCoOptimizer(inner, m.named_parameters(), sync_every=4)
    with pytest.raises(ConfigError, match=r"not a DiLoCo optimizer state.*opt\.inner"):
        opt.load_state_dict(inner.state_dict())


def test_an_overlap_below_h_over_p_is_taken_and_keeps_one_exchange_in_flight():
    # H=5, P=2: exchanges start at steps 5, 7, 10, 12, ... (2 or 3 apart); tau=2 < 2.5 merges
    # fragment 0's at step 7 before fragment 1's starts there.
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                          sync_every=5, fragments=2, overlap=2)
    for _ in range(23):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
        assert sum(f.flight is not None for f in opt.fragments) <= 1
    assert opt.merges == 7  # fragment 0's of steps 5..20, fragment 1's of 7..17
    with pytest.raises(ConfigError, match=r"below sync_every / fragments = 2\b.*overlap=1"):
        DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                        sync_every=4, fragments=2, overlap=2)


def _late_replica():
    """Rank 1 stops one inner step short of the sync (as a slower replica would be late)."""
    store = dist.distributed_c10d._get_default_store()
    m = nn.Linear(3, 2)
    opt = DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                          sync_every=2)
    try:
        for _ in range(2 - parlay.rank()):
            m(torch.ones(1, 3)).sum().backward()
            opt.step()
    except CommError as e:
        return str(e)
    finally:
        if parlay.rank() == 0:
            store.set("rank0_done", "1")
    store.wait(["rank0_done"], datetime.timedelta(seconds=60))
    return None


def test_a_sync_that_timed_out_says_the_timeout_must_cover_the_replicas_drift():
    msg = run_world(_late_replica, 2, comm_timeout=2, timeout=60)[0]
    assert msg is not None and "collective timeout" in msg
    assert "drift over the round, about sync_every=2 x the difference in step time" in msg


def _subgroup_start():
    members = [1, 2]  # a replica group whose first member is not global rank 0
    group = dist.new_group(members)
    torch.manual_seed(100 + dist.get_rank())  # each rank its own weights
    m = nn.Linear(3, 2)
    if dist.get_rank() not in members:
        return None
    DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                    sync_every=4, process_group=group)
    torch.manual_seed(101)
    return torch.equal(m.weight, nn.Linear(3, 2).weight)  # global rank 1's, the group's first


def test_replicas_of_a_subgroup_start_from_its_first_member():
    # the broadcast converted the group rank to a global rank twice: rank 2's weights here,
    # and "Group rank 2 is not part of group" where the group's first member was rank 2
    assert run_world(_subgroup_start, 3) == [None, True, True]
