"""Input pipeline: sharded resumable sampling, DataLoader construction, MNIST."""
from parlay.data.arrays import from_arrays, load_mnist_dataset
from parlay.data.loader import IndexBatchSampler, Prefetcher, build_loader
from parlay.data.mnist import MNIST, default_root, mnist
from parlay.data.sampler import ShardedSampler

__all__ = ["ShardedSampler", "build_loader", "IndexBatchSampler", "Prefetcher", "MNIST",
           "mnist", "default_root", "load_mnist_dataset", "from_arrays"]
