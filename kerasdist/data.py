"""Input sharding and equal step counts for data-parallel training.

    x, y = kerasdist.data.shard((x, y))          # this rank's 1/size
    ds = kerasdist.data.shard(ds).batch(32)       # shard before batching

Per-rank vs global batch size: `batch_size` in `fit` is per rank; one step
of the job consumes `batch_size * size()` examples. Scale the learning rate
with the global batch (`lr * size()`), with a warmup
(`kerasdist.callbacks.LearningRateWarmupCallback`).
"""

import math

import numpy as np

from kerasdist import basics
from kerasdist._core import host as _host


def _rank_size(rank, size):
    if rank is None:
        rank = basics.rank()
    if size is None:
        size = basics.size()
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}.")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}.")
    return rank, size


def _is_dataset(data):
    """A `tf.data.Dataset`, told without importing TensorFlow (a JAX or
    PyTorch job that shards numpy arrays never loads it)."""
    if not type(data).__module__.startswith("tensorflow"):
        return False
    import tensorflow as tf
    return isinstance(data, tf.data.Dataset)


def _is_structure(data):
    return isinstance(data, (tuple, dict)) or (
        isinstance(data, list) and data
        and all(hasattr(x, "shape") for x in data))


def _leaves(data):
    if isinstance(data, dict):
        return [leaf for v in data.values() for leaf in _leaves(v)]
    if _is_structure(data):
        return [leaf for v in data for leaf in _leaves(v)]
    return [data]


def _map(fn, data):
    if isinstance(data, dict):
        return {k: _map(fn, v) for k, v in data.items()}
    if _is_structure(data):
        return type(data)(_map(fn, v) for v in data)
    return fn(data)


def shard(data, rank=None, size=None):
    """Returns this rank's 1/size of a dataset or of arrays.

    Rank r gets the elements r, r + size, r + 2 * size, ...: the shards are
    disjoint and together hold every element once. Their lengths differ by
    at most one (10 examples on 3 ranks: 4, 3, 3); see
    `kerasdist.callbacks.EqualizeStepsCallback` for training on uneven
    shards.

    Args:
        data: a `tf.data.Dataset` (sharded with `Dataset.shard`: shard
            before `shuffle`/`batch`, so that ranks split examples, not
            batches), or a numpy array, or a tuple / list / dict of arrays
            of the same length, such as `(x, y)`.
        rank: the shard to take (default `kerasdist.rank()`).
        size: the number of shards (default `kerasdist.size()`).

    Returns:
        The same kind of object, holding this rank's shard.

    Raises:
        ValueError: if the arrays have different lengths, or rank/size are
            out of range.

    Example:

    ```python
    (x, y), _ = keras.datasets.mnist.load_data()
    x, y = kerasdist.data.shard((x, y))
    ```
    """
    rank, size = _rank_size(rank, size)
    if _is_dataset(data):
        return data.shard(size, rank)
    lengths = {len(leaf) for leaf in _leaves(data)}
    if len(lengths) > 1:
        raise ValueError("shard: all arrays must have the same length, got "
                         f"lengths {sorted(lengths)}.")
    return _map(lambda a: np.asarray(a)[rank::size], data)


def num_batches(data, batch_size=None):
    """Number of batches in this rank's `data`.

    Args:
        data: arrays (as accepted by `shard`) with `batch_size`, or a
            batched `tf.data.Dataset` of known cardinality.
        batch_size: examples per batch, for arrays (the last partial batch
            counts).

    Raises:
        ValueError: if the count is unknown.
    """
    if _is_dataset(data):
        n = int(data.cardinality())
        if n < 0:
            raise ValueError(
                "The dataset's cardinality is unknown or infinite; count its "
                "batches yourself (or use "
                "dataset.apply(tf.data.experimental.assert_cardinality(n))).")
        return n
    if not batch_size:
        raise ValueError("num_batches needs batch_size for arrays.")
    return math.ceil(len(_leaves(data)[0]) / batch_size)


def min_steps(local_steps):
    """The smallest of `local_steps` over all ranks (an allreduce Min).

    Every rank must call it, in the same order as its other collectives.

    Example:

    ```python
    steps = kerasdist.data.min_steps(len(my_batches))
    ```
    """
    value = np.array(int(local_steps), np.int64)
    return int(_host.host_allreduce(value, basics.Min,
                                        "kerasdist.data.min_steps"))


def equalize_steps(data, batch_size=None):
    """`steps_per_epoch` that every rank can run: the minimum number of
    batches over the ranks.

    Pass it to `fit(steps_per_epoch=...)` together with a dataset that
    repeats (`dataset.repeat()`): without `repeat`, Keras stops training
    when a dataset runs out. For arrays, or datasets of known size, the
    `kerasdist.callbacks.EqualizeStepsCallback` does the same without
    `repeat`.

    Args:
        data: this rank's shard (see `num_batches`).
        batch_size: examples per batch, for arrays.

    Returns:
        An int, the same on every rank.

    Example:

    ```python
    ds = kerasdist.data.shard(ds).batch(32)
    steps = kerasdist.data.equalize_steps(ds)
    model.fit(ds.repeat(), steps_per_epoch=steps, epochs=5)
    ```
    """
    return min_steps(num_batches(data, batch_size))
