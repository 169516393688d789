"""The sharded optimizer's layout (kerasdist/_sharding.py): a pure function
of the variables' shapes and dtypes and the number of ranks. The training
itself runs on real ranks in tests/workers/keras_backend_worker.py
(`pytest -k shard_`)."""

import numpy as np
import pytest

from kerasdist import _sharding


def test_partition_is_ceil_and_never_empty():
    assert _sharding.partition([12, 3, 3, 1], 2) == [6, 2, 2, 1]
    assert _sharding.partition([12, 3, 3, 1], 4) == [3, 1, 1, 1]
    assert _sharding.partition([0, 7], 3) == [1, 3]
    with pytest.raises(ValueError, match="size must be >= 1"):
        _sharding.partition([4], 0)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_every_element_owned_once_and_balanced(size):
    rng = np.random.default_rng(size)
    numels = [int(n) for n in rng.integers(1, 5000, size=40)]
    chunks = _sharding.partition(numels, size)
    owned = np.zeros(size, np.int64)
    for n, c in zip(numels, chunks):
        seen = np.zeros(n, np.int64)
        for r in range(size):
            lo, hi = _sharding.owned(n, c, r)
            seen[lo:hi] += 1
            owned[r] += hi - lo
        assert (seen == 1).all()
    # Balanced by bytes: every rank holds sum(chunks) elements (its shard
    # padded), of which at most size - 1 a variable are padding.
    assert owned.sum() == sum(numels)
    assert (sum(chunks) - owned).max() <= (size - 1) * len(numels)
    assert sum(chunks) * size - sum(numels) <= (size - 1) * len(numels)


def test_layout_rows_and_buckets():
    shapes = [(4, 3), (3,), (3, 1), (1,), (5,)]
    dtypes = ["float32"] * 4 + ["float16"]
    layout = _sharding.Layout(shapes, dtypes, 2)
    assert layout.chunks == [6, 2, 2, 1, 3]
    # Without a bucket size, one bucket a dtype, in the variables' order.
    assert layout.buckets == [[0, 1, 2, 3], [4]]
    assert layout.shard_bytes() == 11 * 4 + 3 * 2
    # With a bucket size (shard="gradients"): backprop order, dtypes apart,
    # as the replicated optimizer's buckets.
    tiny = _sharding.Layout(shapes[:4], dtypes[:4], 2, bucket_bytes=16)
    assert tiny.buckets == [[3, 2], [1], [0]]


def test_same_layout_for_the_same_model_and_size():
    shapes = [(128, 64), (64,), (64, 10), (10,)]
    a = _sharding.Layout(shapes, ["float32"] * 4, 3, bucket_bytes=4096)
    b = _sharding.Layout(list(shapes), ("float32",) * 4, 3, bucket_bytes=4096)
    assert (a.chunks, a.buckets) == (b.chunks, b.buckets)
