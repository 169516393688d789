"""The order of `model.fit`'s examples under recovery in place
(kerasdist/keras/elastic_fit.py): which examples each rank trains at each step
of an epoch resumed at any batch, at any size. numpy only.

An epoch's examples, in its order, are cut into batches of `batch_size`
(the last may be smaller). From batch `start` at `size` ranks, every step
but the last trains the next `size` batches, batch `start + step * size +
rank` on `rank`; the last takes what is left, from `size` to `2 * size -
1` batches (fewer only where the epoch was resumed near its end), split
over the ranks: one batch each if exactly `size`, else the examples by
`np.array_split` (bigger batches than `batch_size`, so that no step is
left with less than a batch a rank). Where fewer examples than ranks are
left (an epoch resumed at its last, small batch, or fewer examples than
ranks), some ranks repeat one.
"""

import numpy as np


def epoch_order(n, shuffle, seed, epoch):
    """The order of the `n` examples in epoch `epoch`."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


def _batches(n, batch_size):
    return -(-n // batch_size)


def epoch_steps(n, batch_size, start, size):
    """The steps of an epoch of `n` examples left from batch `start` at
    `size` ranks."""
    left = _batches(n, batch_size) - start
    return max(1, left // size) if left > 0 else 0


def step_rows(order, batch_size, start, step, rank, size):
    """The positions in `order` that `rank` of `size` trains at step `step`
    of an epoch resumed at batch `start`."""
    n = len(order)
    first = start + step * size
    if step + 1 < epoch_steps(n, batch_size, start, size) or \
            _batches(n, batch_size) - first == size:
        j = first + rank
        return order[j * batch_size:min((j + 1) * batch_size, n)]
    rest = order[first * batch_size:]
    if len(rest) >= size:
        return np.array_split(rest, size)[rank]
    return rest[rank % len(rest):rank % len(rest) + 1]


def batches_done(n, batch_size, start, steps, size):
    """The epoch's batches done after `steps` steps from `start` (the
    job's count, all ranks together)."""
    if steps >= epoch_steps(n, batch_size, start, size):
        return _batches(n, batch_size)
    return start + steps * size
