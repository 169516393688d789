"""Input pipelines of the Trainer (private).

The training pipeline is one `tf.data.Dataset` that covers the epochs
`[first_epoch, last_epoch)` back to back, each exactly `steps` batches long.
Epoch e is built from e alone: the whole data set is shuffled with a seed
derived from (seed, e), then sharded and batched. So the data order of
epoch e is the same whether the job ran straight through or restarted
before it, and every rank runs the same number of steps (no rank waits in
an allreduce that the others never join).

Positions within an epoch: rank r takes examples r, r + size, ... of the
epoch's order and every step but the last takes `batch_size` of them on
every rank, so the first k steps of an epoch train exactly its first
`k * batch_size * size` examples. A job resumed at a step checkpoint skips
that many and shards the rest over the ranks it has now, at any size:
no example of the epoch is trained twice or left out. (With
`data_is_sharded` the position counts this rank's examples instead.)
"""

import collections
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


def epoch_steps(n, *, size, sharded, batch_size, position=0):
    """Steps every rank can run in an epoch of `n` examples from `position`
    on (see the module docstring); 0 when too few are left for a step on
    every rank. With `sharded` (n and position of this rank's part) all
    ranks agree with an allreduce, so all must call it."""
    left = max(n - position, 0)
    if sharded:
        return kd_data.min_steps(math.ceil(left / batch_size))
    # The smallest shard decides, so every rank can run that many.
    return math.ceil(shard_size(left, size - 1, size) / batch_size)


def samples_per_step(*, size, sharded, batch_size):
    """How far a full step moves the position within an epoch."""
    return batch_size * (1 if sharded else size)


class EpochPlan(collections.namedtuple(
        "EpochPlan", "first_epoch first_position first_steps steps per_step")):
    """The steps of a `train_pipeline`: `first_epoch` starts at example
    `first_position` of its order and has `first_steps` steps, the others
    `steps`; a step moves the position by `per_step` examples."""

    def steps_of(self, epoch):
        return self.first_steps if epoch == self.first_epoch else self.steps

    def is_last(self, epoch, batch):
        """Whether batch `batch` (0-based) is the last of `epoch`."""
        return batch + 1 >= self.steps_of(epoch)

    def position(self, epoch, batch):
        """Examples of `epoch`'s order trained after batch `batch`."""
        start = self.first_position if epoch == self.first_epoch else 0
        return start + (batch + 1) * self.per_step


def train_pipeline(dataset, n, *, rank, size, sharded, batch_size, seed,
                   shuffle, shuffle_buffer, first_epoch, last_epoch,
                   first_position=0, first_steps=None):
    """Returns (dataset of batches for the epochs, steps per epoch).

    Args:
        dataset: examples; the whole data set, or this rank's part when
            `sharded` is True.
        n: len(dataset).
        sharded: the data is already this rank's part (shuffle it with a
            per-rank seed; agree on the step count with an allreduce).
        first_position: examples of `first_epoch`'s order already trained
            (a resume from a step checkpoint); they are skipped.
        first_steps: the steps of `first_epoch` from there
            (`epoch_steps(..., position=first_position)`); the other
            epochs have the returned number.
    """
    if not sharded and n < size:
        raise ValueError(f"train_data() has {n} examples, fewer than the "
                         f"{size} ranks.")
    steps = epoch_steps(n, size=size, sharded=sharded,
                        batch_size=batch_size)
    if steps < 1:
        raise ValueError("Some rank has no training examples; give every "
                         "rank at least one.")
    # One global permutation then strided shards, or each rank's own part.
    shuffle_rank = rank if sharded else 0
    buffer = n if shuffle_buffer is None else min(int(shuffle_buffer), n)
    first_position = int(first_position)
    if first_steps is None:
        first_steps = steps

    def one_epoch(epoch):
        d = dataset
        if shuffle:
            d = d.shuffle(buffer, seed=_epoch_seed(seed, epoch, shuffle_rank),
                          reshuffle_each_iteration=False)
        take = steps
        if first_position or first_steps != steps:
            first = tf.equal(epoch, first_epoch)
            d = d.skip(tf.where(first, np.int64(first_position),
                                np.int64(0)))
            take = tf.where(first, np.int64(first_steps), np.int64(steps))
        if not sharded:
            d = d.shard(size, rank)
        return d.batch(batch_size).take(take)

    epochs = tf.data.Dataset.range(first_epoch, last_epoch)
    return epochs.flat_map(one_epoch).prefetch(2), steps


def eval_pipeline(dataset, n, *, rank, size, sharded, batch_size):
    """Returns (this rank's batched evaluation data, its example count)."""
    if sharded:
        return dataset.batch(batch_size), n
    return (dataset.shard(size, rank).batch(batch_size),
            shard_size(n, rank, size))
