"""MNIST with the 784-800-800-10 MLP, the same code in every parlay mode.

    parlay run -n 2 examples/mnist_mlp.py                          # data parallel (allreduce)
    parlay run -n 3 --ps 1 examples/mnist_mlp.py --mode ps         # 1 parameter server + 2 workers
    parlay run -n 4 examples/mnist_mlp.py --mode hybrid            # pipeline stages x replicas
    parlay run -n 4 examples/mnist_mlp.py --shard parameters       # sharded data parallel (ZeRO-3)
    parlay run -n 4 examples/mnist_mlp.py --mode diloco --compression fp16 \
        --option sync_every=8 --option 'outer_optimizer_args={"lr": 1.0}'  # local updates

Data: ``--data DIR`` or ``PARLAY_DATA_DIR`` (a folder with the four MNIST ``.gz`` files);
otherwise ``~/.cache/parlay/mnist``, then the copy bundled with parlay (no network needed).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn

import parlay


def build_training_func() -> tuple[nn.Module, nn.Module]:
    """The model and its loss. An ``nn.Sequential`` so hybrid mode can cut it into stages."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 800), nn.ReLU(),
        nn.Linear(800, 800), nn.ReLU(),
        nn.Linear(800, 10),
    )
    return model, nn.CrossEntropyLoss()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="allreduce", choices=["allreduce", "ps", "hybrid", "diloco"])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128, help="per data-parallel replica")
    p.add_argument("--lr", type=float, default=1e-3, help="single-replica learning rate")
    p.add_argument("--compression", default=None, help="e.g. fp16, topk:0.01")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--shard", default=None, choices=["optimizer", "gradients", "parameters"],
                   help="allreduce, hybrid: shard the training state over the replicas")
    p.add_argument("--data", default=None, help="folder with the MNIST .gz files")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="mode option, e.g. --option consistency=async")
    args = p.parse_args()

    parlay.init()
    train = parlay.data.mnist(args.data, train=True)
    test = parlay.data.mnist(args.data, train=False)
    options = {}
    for kv in args.option:
        key, _, value = kv.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value

    trainer = parlay.Trainer(
        build_training_func, train,
        optimizer=torch.optim.Adam, optimizer_args={"lr": args.lr},
        batch_size=args.batch_size, mode=args.mode, num_epochs=args.epochs,
        compression=args.compression, precision=args.precision, shard=args.shard,
        checkpoint_dir=args.checkpoint_dir, lr_schedule="cosine",
        validation_dataset=test, validation_batch_size=1000, strategy_options=options,
    )
    # Every rank runs the same loop; on parameter servers should_stop() serves until the
    # workers are done. validate() averages over all replicas.
    metrics = trainer.train_and_validate_to_end()
    if metrics and trainer.metrics.printer:
        how = args.mode + (f", shard={args.shard}" if args.shard else "")
        print(f"[{how}] test accuracy {100 * metrics['accuracy']:.2f}% after "
              f"{trainer.state.epoch} epochs ({trainer.state.step} steps)")
    parlay.shutdown()


if __name__ == "__main__":
    main()
