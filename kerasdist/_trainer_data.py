"""Input pipelines of the Trainer (private).

The training pipeline is one `tf.data.Dataset` that covers the epochs
`[first_epoch, last_epoch)` back to back, each exactly `steps` batches long.
Epoch e is built from e alone: the whole data set is shuffled with a seed
derived from (seed, e), then sharded and batched. So the data order of
epoch e is the same whether the job ran straight through or restarted
before it, and every rank runs the same number of steps (no rank waits in
an allreduce that the others never join).
"""

import math

import numpy as np
import tensorflow as tf

from kerasdist import data as kd_data


def as_dataset(value, what):
    """A `tf.data.Dataset` of examples from a dataset or a tuple of arrays.

    Raises:
        TypeError: for anything else, naming `what` and what it returned.
    """
    if isinstance(value, tf.data.Dataset):
        return value
    if isinstance(value, (tuple, list)) and len(value) in (2, 3) and all(
            isinstance(a, (np.ndarray, tf.Tensor)) for a in value):
        lengths = {len(a) for a in value}
        if len(lengths) != 1:
            raise ValueError(f"{what} returned arrays of different lengths "
                             f"{sorted(lengths)}; x and y must match.")
        return tf.data.Dataset.from_tensor_slices(tuple(value))
    raise TypeError(
        f"{what} must return a tf.data.Dataset of (x, y) examples or a "
        "tuple (x, y) of numpy arrays (of the whole data set); got "
        f"{type(value).__name__}.")


def count(dataset):
    """Number of elements of a finite dataset (iterates it if TF does not
    know the cardinality)."""
    n = int(dataset.cardinality())
    if n == tf.data.INFINITE_CARDINALITY:
        raise ValueError("The Trainer needs finite data (one epoch of "
                         "examples); got an infinite dataset (.repeat()?).")
    if n < 0:
        n = int(dataset.reduce(np.int64(0), lambda c, _: c + 1))
    return n


def shard_size(n, rank, size):
    """Examples of rank `rank` under kerasdist.data.shard's strided rule."""
    return n // size + (1 if rank < n % size else 0)


def _epoch_seed(seed, epoch, rank):
    # int64 arithmetic on a tensor epoch; distinct for each (epoch, rank).
    return (tf.cast(seed, tf.int64) * 1000003 + epoch * 7919
            + tf.cast(rank, tf.int64))


def train_pipeline(dataset, n, *, rank, size, sharded, batch_size, seed,
                   shuffle, shuffle_buffer, first_epoch, last_epoch):
    """Returns (dataset of batches for the epochs, steps per epoch).

    Args:
        dataset: examples; the whole data set, or this rank's part when
            `sharded` is True.
        n: len(dataset).
        sharded: the data is already this rank's part (shuffle it with a
            per-rank seed; agree on the step count with an allreduce).
    """
    if sharded:
        local = n
        steps = kd_data.min_steps(math.ceil(local / batch_size))
        shuffle_rank = rank
    else:
        if n < size:
            raise ValueError(f"train_data() has {n} examples, fewer than the "
                             f"{size} ranks.")
        # The smallest shard decides, so every rank can run `steps`.
        local = shard_size(n, size - 1, size)
        steps = math.ceil(local / batch_size)
        shuffle_rank = 0  # one global permutation, then strided shards
    if steps < 1:
        raise ValueError("Some rank has no training examples; give every "
                         "rank at least one.")
    buffer = n if shuffle_buffer is None else min(int(shuffle_buffer), n)

    def one_epoch(epoch):
        d = dataset
        if shuffle:
            d = d.shuffle(buffer, seed=_epoch_seed(seed, epoch, shuffle_rank),
                          reshuffle_each_iteration=False)
        if not sharded:
            d = d.shard(size, rank)
        return d.batch(batch_size).take(steps)

    epochs = tf.data.Dataset.range(first_epoch, last_epoch)
    return epochs.flat_map(one_epoch).prefetch(2), steps


def eval_pipeline(dataset, n, *, rank, size, sharded, batch_size):
    """Returns (this rank's batched evaluation data, its example count)."""
    if sharded:
        return dataset.batch(batch_size), n
    return (dataset.shard(size, rank).batch(batch_size),
            shard_size(n, rank, size))
