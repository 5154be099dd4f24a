"""Sharded data parallel by hand (ZeRO): each rank keeps 1/N of the training state.

    parlay run -n 2 examples/sharded_mlp.py                          # shard="gradients"
    parlay run -n 4 examples/sharded_mlp.py --shard parameters --out /tmp/mlp

A Horovod-style loop on synthetic data (one teacher, each rank draws its own batches): the
same loop as ``horovod_style.py`` plus ``shard=``, clipping by the global norm across every
rank's chunks, and the whole model read back at the end. See docs/sharding.md.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard", default="gradients", choices=["optimizer", "gradients", "parameters"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--out", default=None, help="write each rank's shard and the whole model here")
    args = p.parse_args()

    parlay.init()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)                                  # the same model on every rank
    teacher = torch.randn(32, 4)
    data = torch.Generator().manual_seed(1000 + parlay.rank())
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    parlay.broadcast_parameters(model.state_dict(), root_rank=0)   # before wrapping
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * parlay.size())
    opt = parlay.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      shard=args.shard, model=model)  # model=: "parameters"

    for step in range(args.steps):
        x = torch.randn(args.batch_size, 32, generator=data)
        opt.zero_grad()
        loss = F.mse_loss(model(x), torch.tanh(x @ teacher))
        loss.backward()                     # gradients reduce-scattered bucket by bucket
        opt.synchronize()                   # this rank's chunk of the averaged gradients
        norm = opt.clip_grad_norm_(1.0)     # the norm over every rank's chunks
        with opt.skip_synchronize():
            opt.step()                      # steps this rank's chunks, then all-gathers
        avg = parlay.comm.allreduce(loss.detach(), "avg")
        if parlay.rank() == 0 and step % 20 == 0:
            print(f"step {step:3d}  loss {avg.item():.4f}  grad norm {norm.item():.3f}", flush=True)

    with opt.gathered_parameters():         # every rank enters: whole parameters inside
        total = sum(p.numel() for p in model.parameters())
        checksum = sum(p.double().sum().item() for p in model.parameters())
        if args.out and parlay.rank() == 0:
            torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))
    if args.out:                            # each rank's shard; loads at the same N only
        torch.save(opt.state_dict(), os.path.join(args.out, f"shard.rank{parlay.rank()}.pt"))
    sums = parlay.allgather_object(checksum)
    if parlay.rank() == 0:
        grads = sum(g.numel() for g in opt.local_gradients())
        state = sum(t.numel() for s in opt.optimizer.state.values() for t in s.values()
                    if t.dim() > 0)
        print(f"shard={args.shard}, {parlay.size()} ranks: rank 0 steps {grads} of {total} "
              f"gradient elements and holds {state} of {2 * total} AdamW state elements; "
              f"ranks agree on the weights: {all(s == sums[0] for s in sums)}", flush=True)
    parlay.shutdown()


if __name__ == "__main__":
    main()
