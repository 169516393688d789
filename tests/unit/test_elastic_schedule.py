"""The order of model.fit's examples under recovery in place
(kerasdist/keras/elastic_schedule.py, ElasticBatches' shares): an epoch
resumed at any committed batch at any size trains every example once."""

import itertools

import numpy as np

from kerasdist.keras.elastic_schedule import batches_done
from kerasdist.keras.elastic_schedule import epoch_order
from kerasdist.keras.elastic_schedule import epoch_steps
from kerasdist.keras.elastic_schedule import step_rows


def _epoch(order, batch_size, plan):
    """The examples trained over an epoch run as `plan`: [(size, steps)],
    each part resumed where the one before stopped (steps None: to the
    epoch's end)."""
    trained, start = [], 0
    for size, steps in plan:
        total = epoch_steps(len(order), batch_size, start, size)
        steps = total if steps is None else min(steps, total)
        for step in range(steps):
            for rank in range(size):
                trained += list(step_rows(order, batch_size, start, step,
                                          rank, size))
        start = batches_done(len(order), batch_size, start, steps, size)
    return trained


def test_elastic_batches_resumed_at_any_size_train_each_example_once():
    for n, batch_size in ((60, 4), (61, 4), (23, 5), (7, 3), (2, 4)):
        order = epoch_order(n, True, 3, 1)
        assert sorted(order) == list(range(n))
        for first, second in itertools.product((1, 2, 3, 4), repeat=2):
            # Uninterrupted: every example once (given one a rank).
            assert sorted(_epoch(order, batch_size, [(first, None)])) == \
                list(range(n)) or n < first, (n, batch_size, first)
            for steps in range(epoch_steps(n, batch_size, 0, first)):
                trained = _epoch(order, batch_size,
                                 [(first, steps), (second, None)])
                left = n - batch_size * batches_done(n, batch_size, 0,
                                                     steps, first)
                if left >= second:
                    assert sorted(trained) == list(range(n)), (
                        n, batch_size, first, second, steps)
                else:
                    # Resumed with fewer examples left than ranks: each
                    # is trained, some by two ranks.
                    assert sorted(set(trained)) == list(range(n))
                    assert len(trained) == n - left + second


def test_elastic_batches_order_is_the_jobs():
    # Rank r trains batch start + r: at one rank the epoch is the order's
    # batches one after another; shuffled by seed and epoch only.
    order = epoch_order(10, True, 7, 2)
    assert (order == epoch_order(10, True, 7, 2)).all()
    assert not (order == epoch_order(10, True, 7, 3)).all()
    assert (epoch_order(5, False, 7, 2) == np.arange(5)).all()
    rows = [list(step_rows(order, 4, 0, s, 0, 1)) for s in range(3)]
    assert rows == [list(order[:4]), list(order[4:8]), list(order[8:])]
    assert list(step_rows(order, 2, 1, 0, 1, 6)) == list(order[4:6])
    # From batch 1 of 5 at 3 ranks: one step, 8 examples split 3, 3, 2.
    assert list(step_rows(order, 2, 1, 0, 1, 3)) == list(order[5:8])
    # The last step splits what is left over the ranks: 3 batches (10
    # examples) at 2 ranks are one step of 5 examples each.
    assert epoch_steps(10, 4, 0, 2) == 1
    assert [list(step_rows(order, 4, 0, 0, r, 2)) for r in (0, 1)] == [
        list(order[:5]), list(order[5:])]
    assert batches_done(10, 4, 0, 1, 2) == 3
