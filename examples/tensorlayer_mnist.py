"""TensorLayer's distributed MNIST walkthrough, line for line, on parlay.

The seed (``tl.distributed.Trainer`` on TensorFlow) became PyTorch objects in the same places:
``tl.files.load_mnist_dataset`` -> ``parlay.data.load_mnist_dataset``, ``make_dataset`` ->
``parlay.data.from_arrays``, the TensorLayer network -> an ``nn.Sequential`` (800-800-10 with
dropout), ``tf.train.AdamOptimizer`` with ``learning_rate`` -> ``torch.optim.Adam`` with
``lr``. The loop is the seed's own: ``while not trainer.session.should_stop()``.

    parlay run -n 2 examples/tensorlayer_mnist.py                    # data parallel
    parlay run -n 3 --ps 1 examples/tensorlayer_mnist.py --mode ps   # 1 parameter server, 2 workers
    parlay run -n 2 --pp 2 examples/tensorlayer_mnist.py --mode hybrid
"""
import argparse

import torch
import torch.nn as nn

import parlay


def make_dataset(images, labels):
    return parlay.data.from_arrays(images, labels)


def model():
    return nn.Sequential(
        nn.Dropout(0.2),                      # tl.layers.DropoutLayer(keep=0.8)
        nn.Linear(784, 800), nn.ReLU(),       # tl.layers.DenseLayer(800, tf.nn.relu)
        nn.Dropout(0.5),
        nn.Linear(800, 800), nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(800, 10),                   # tl.layers.DenseLayer(10, tf.identity)
    )


def build_train():
    net = model()
    cost = nn.CrossEntropyLoss()              # tl.cost.cross_entropy
    return net, cost


def build_validation():
    def metrics(outputs, y_):
        cost = nn.functional.cross_entropy(outputs, y_)
        accuracy = (outputs.argmax(1) == y_).float().mean()
        return {"cost": cost, "accuracy": accuracy}
    return metrics


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="allreduce", choices=["allreduce", "ps", "hybrid"])
    p.add_argument("--max-iteration", type=int, default=None, help="stop early (smoke tests)")
    args = p.parse_args()

    # Load MNIST data
    X_train, y_train, X_val, y_val, X_test, y_test = parlay.data.load_mnist_dataset(shape=(-1, 784))

    # Setup the trainer
    training_dataset = make_dataset(X_train, y_train)
    validation_dataset = make_dataset(X_val, y_val)
    trainer = parlay.Trainer(
        build_training_func=build_train, training_dataset=training_dataset,
        optimizer=torch.optim.Adam,
        optimizer_args={'lr': 0.001}, batch_size=500, prefetch=500 // 100,
        validation_dataset=validation_dataset, build_validation_func=build_validation,
        mode=args.mode, max_iteration=args.max_iteration,
    )

    # There are multiple ways to use the trainer:
    # 1. Easiest way to train all data: trainer.train_to_end()
    # 2. Train with validation in the middle: trainer.train_and_validate_to_end(validate_every=100)
    # 3. Train with full control like follows:
    while not trainer.session.should_stop():
        # Run a training step synchronously.
        trainer.train_on_batch()

    # Test the trained model
    result = trainer.validate(make_dataset(X_test, y_test))
    if result and trainer.metrics.printer:  # one rank prints (the ranks share the terminal)
        print(f"test accuracy {100 * result['accuracy']:.2f}% (cost {result['cost']:.4f})")
