"""`parlay run --max-restarts` brings a killed job back, bit for bit, through the real CLI.

One rank SIGKILLs itself mid-epoch on the first attempt only; torchrun's agent restarts every
worker, the Trainer resumes from its latest checkpoint, and the final weights must equal an
uninterrupted run's exactly. The restarted ranks rendezvous again on the same agent store, so
this also checks that no rank reads the dead attempt's addresses (a fresh store prefix per
attempt) and that every rendezvous is bounded by PARLAY_TIMEOUT.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# 44 samples, batch 4 per rank on 2 data-parallel ranks: 6 steps per epoch; checkpoints every
# 3 steps. Kills fall mid-epoch, some right after a checkpoint, some just before one.
SCRIPT = textwrap.dedent('''
    import os, signal, sys
    import torch, torch.nn as nn
    from torch.utils.data import TensorDataset
    import parlay

    ckpt_dir, out_dir, kill_rank, kill_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mode, shard = sys.argv[5], (sys.argv[6] if len(sys.argv) > 6 else None)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def build():
        return (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)),
                nn.CrossEntropyLoss())

    g = torch.Generator().manual_seed(11)
    x = torch.randn(44 if mode == "allreduce" else 22, 6, generator=g)
    ds = TensorDataset(x, (x[:, :3].sum(1) > 0).long())
    opts = {"hybrid": {"pp": 2, "chunks": 2},
            "diloco": {"sync_every": 4, "fragments": 2, "overlap": 1}}.get(mode)
    t = parlay.Trainer(build, ds, optimizer_args={"lr": 1e-2}, batch_size=4, max_iteration=12,
                       checkpoint_dir=ckpt_dir or None, checkpoint_every=3, mode=mode,
                       strategy_options=opts, shard=shard, progress=False)
    while not t.should_stop():
        if first_attempt and parlay.rank() == kill_rank and t.state.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        t.train_on_batch()
    sd = t.strategy.pipe.state_dict() if mode == "hybrid" else t.model.state_dict()
    if shard:  # this rank's chunks of the parameters and of the optimizer state
        opt = t.strategy.optimizer
        chunks = [c for g in opt.param_groups for c in g["params"]]
        sd = {f"chunk{i}": c.detach() for i, c in enumerate(chunks)}
        sd.update({f"state{i}.{k}": v for i, c in enumerate(chunks)
                   for k, v in opt.optimizer.state[c].items()})
    torch.save({k: v.clone() for k, v in sd.items()}, f"{out_dir}/rank{parlay.rank()}.pt")
    print(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')} rank {parlay.rank()} "
          f"finished at step {t.state.step}", flush=True)
    t.close()
''')


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PARLAY_TIMEOUT="30", OMP_NUM_THREADS="1")
    return env


def _launch(tmp: Path, name: str, mode: str, kill_rank: int = -1, kill_step: int = -1,
            checkpoint: bool = True, shard: str | None = None
            ) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    script = tmp / "train_restart.py"
    script.write_text(SCRIPT)
    ckpt, out = tmp / f"{name}-ckpt", tmp / f"{name}-out"
    ckpt.mkdir()
    out.mkdir()
    p = subprocess.run([sys.executable, "-m", "parlay.cli", "run", "-n", "2", "--max-restarts",
                        "1", *(["--pp", "2"] if mode == "hybrid" else []), str(script),
                        str(ckpt) if checkpoint else "", str(out), str(kill_rank),
                        str(kill_step), mode, *([shard] if shard else [])],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100)
    states = [torch.load(out / f"rank{r}.pt", weights_only=True)
              for r in range(2) if (out / f"rank{r}.pt").exists()]
    return p, states


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of uninterrupted runs, per mode (computed once)."""
    cache: dict[str, list[dict]] = {}

    def get(mode: str, shard: str | None = None) -> list[dict]:
        key = f"{mode}-{shard}"
        if key not in cache:
            p, states = _launch(tmp_path_factory.mktemp(f"ref-{key}"), "ref", mode,
                                checkpoint=False, shard=shard)
            assert p.returncode == 0 and len(states) == 2, p.stderr[-3000:]
            cache[key] = states
        return cache[key]
    return get


def _assert_bit_identical(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


@pytest.mark.parametrize("kill_rank, kill_step", [(1, 4), pytest.param(0, 7, marks=pytest.mark.slow)])
def test_sigkill_mid_epoch_restarts_and_matches_uninterrupted_run(tmp_path, reference,
                                                                  kill_rank, kill_step):
    p, states = _launch(tmp_path, "run", "allreduce", kill_rank, kill_step)
    assert p.returncode == 0, p.stderr[-4000:]
    # The kill happened and the job came back on the second attempt.
    assert f"attempt 1 rank {kill_rank} finished at step 12" in p.stdout, p.stdout
    assert "attempt 0 rank" not in p.stdout
    _assert_bit_identical(states, reference("allreduce"))


def test_hybrid_pipeline_restart_matches_uninterrupted_run(tmp_path, reference):
    # Two pipeline stages x one replica: the killed stage and its peer both resume from the
    # checkpoint of the same step.
    p, states = _launch(tmp_path, "run", "hybrid", kill_rank=1, kill_step=5)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "attempt 1 rank 1 finished at step 12" in p.stdout, p.stdout
    _assert_bit_identical(states, reference("hybrid"))


# The default run kills and resumes the deepest level; the others are slow variants (their
# checkpoints' content is checked by test_shard_trainer's reshard test, every level).
@pytest.mark.parametrize("shard, kill_rank, kill_step", [
    pytest.param("optimizer", 1, 4, marks=pytest.mark.slow),
    pytest.param("gradients", 0, 7, marks=pytest.mark.slow), ("parameters", 1, 5)])
def test_sharded_restart_matches_uninterrupted_run(tmp_path, reference, shard, kill_rank,
                                                   kill_step):
    # Each rank resumes its own shard (a checkpoint or its in-memory snapshot): bit for bit.
    p, states = _launch(tmp_path, "run", "allreduce", kill_rank, kill_step, shard=shard)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"attempt 1 rank {kill_rank} finished at step 12" in p.stdout, p.stdout
    _assert_bit_identical(states, reference("allreduce", shard))


def test_diloco_restart_matches_uninterrupted_run(tmp_path, reference):
    # Killed at step 6: fragment 1's exchange (sent at 6, merged at 7) may be in flight in
    # the state resumed; the outer state and the round position come back with it.
    p, states = _launch(tmp_path, "run", "diloco", kill_rank=0, kill_step=6)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "attempt 1 rank 0 finished at step 12" in p.stdout, p.stdout
    _assert_bit_identical(states, reference("diloco"))
