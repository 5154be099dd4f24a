"""A typical Horovod PyTorch training script, running on parlay.

Only two things differ from the Horovod original: the import (``import parlay as hvd`` instead
of ``import horovod.torch as hvd``; ``import parlay.horovod as hvd`` works too) and the
launcher::

    parlay run -n 2 examples/horovod_style.py        # was: horovodrun -np 2 python train.py

It trains a small regression MLP on synthetic data (each rank draws its own batches), prints
the loss averaged over ranks on rank 0, and checks at the end that every rank holds the same
weights.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay as hvd  # was: import horovod.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)

    # Same teacher on every rank, different samples per rank.
    w_true = torch.randn(20, 1, generator=torch.Generator().manual_seed(0))
    data = torch.Generator().manual_seed(1000 + hvd.rank())
    torch.manual_seed(hvd.rank())  # deliberately different initial weights: broadcast fixes it

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
    # Horovod's recipe: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    # Start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for step in range(args.steps):
        x = torch.randn(args.batch_size, 20, generator=data)
        y = x @ w_true + 0.01 * torch.randn(args.batch_size, 1, generator=data)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        avg = hvd.allreduce(loss.detach(), name="loss")
        if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {avg.item():.4f}", flush=True)

    checksums = hvd.allgather_object(sum(p.double().sum().item() for p in model.parameters()))
    if hvd.rank() == 0:
        same = all(c == checksums[0] for c in checksums)
        print(f"{hvd.size()} ranks hold {'the same' if same else 'DIFFERENT'} weights", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
