"""The sharded optimizer's layout (kerasdist/keras/sharding/): a pure function
of the variables' shapes and dtypes and the number of ranks; the shard a
rank slices from a gradient that is already reduced, and the record of
such gradients (kerasdist/keras/reduced.py). The training itself runs on real
ranks in tests/workers/keras_backend_worker.py and
keras_optimizer_worker.py (`pytest -k shard_`)."""

import numpy as np
import pytest

from kerasdist.keras.sharding import layout as _layout
from kerasdist.keras.sharding import step as _step


def test_partition_is_ceil_and_never_empty():
    assert _layout.partition([12, 3, 3, 1], 2) == [6, 2, 2, 1]
    assert _layout.partition([12, 3, 3, 1], 4) == [3, 1, 1, 1]
    assert _layout.partition([0, 7], 3) == [1, 3]
    with pytest.raises(ValueError, match="size must be >= 1"):
        _layout.partition([4], 0)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_every_element_owned_once_and_balanced(size):
    rng = np.random.default_rng(size)
    numels = [int(n) for n in rng.integers(1, 5000, size=40)]
    chunks = _layout.partition(numels, size)
    owned = np.zeros(size, np.int64)
    for n, c in zip(numels, chunks):
        seen = np.zeros(n, np.int64)
        for r in range(size):
            lo, hi = _layout.owned(n, c, r)
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
    layout = _layout.Layout(shapes, dtypes, 2)
    assert layout.chunks == [6, 2, 2, 1, 3]
    # Without a bucket size, one bucket a dtype, in the variables' order.
    assert layout.buckets == [[0, 1, 2, 3], [4]]
    assert layout.shard_bytes() == 11 * 4 + 3 * 2
    # With a bucket size (shard="gradients"): backprop order, dtypes apart,
    # as the replicated optimizer's buckets.
    tiny = _layout.Layout(shapes[:4], dtypes[:4], 2, bucket_bytes=16)
    assert tiny.buckets == [[3, 2], [1], [0]]


def test_same_layout_for_the_same_model_and_size():
    shapes = [(128, 64), (64,), (64, 10), (10,)]
    a = _layout.Layout(shapes, ["float32"] * 4, 3, bucket_bytes=4096)
    b = _layout.Layout(list(shapes), ("float32",) * 4, 3, bucket_bytes=4096)
    assert (a.chunks, a.buckets) == (b.chunks, b.buckets)


class _NumpyOps:
    """The two keras.ops functions the slicing uses, on numpy."""
    reshape = staticmethod(np.reshape)
    pad = staticmethod(np.pad)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_own_shard_is_the_row_a_reducescatter_gives(size):
    # A gradient a DistributedGradientTape reduced is the same on every
    # rank: the reduce-scatter's row r of it is what rank r slices.
    ops = _NumpyOps
    for shape in [(7,), (4, 3), (1,), (2, 2, 2), (3, 1)]:
        tensor = np.arange(1, np.prod(shape) + 1, dtype=np.float64)
        tensor = tensor.reshape(shape)
        numel = tensor.size
        (chunk,) = _layout.partition([numel], size)
        rows = _step._rows(ops, tensor, numel, chunk, size)
        for rank in range(size):
            np.testing.assert_array_equal(
                _step.own_shard(ops, tensor, numel, chunk, rank),
                rows[rank])


class _Tensor:
    """A stand-in for a framework tensor (weakly referenceable)."""


def test_reduced_gradients_are_known_while_they_live():
    import gc

    from kerasdist.keras import reduced as _reduced

    a, b, c = _Tensor(), _Tensor(), _Tensor()
    _reduced.note([a, None, b], 0)
    _reduced.note([c], 3)
    assert [_reduced.process_set_of(t) for t in (a, b, c)] == [0, 0, 3]
    assert _reduced.process_set_of(_Tensor()) is None
    assert _reduced.process_set_of(None) is None
    # Not weakly referenceable: never known (its consumer reduces it).
    _reduced.note([1.5], 0)
    assert _reduced.process_set_of(1.5) is None
    # Freed: forgotten, so an object that reuses its id is not taken for it.
    live = _reduced.count()
    del a
    gc.collect()
    assert _reduced.count() == live - 1
    assert all(_reduced.process_set_of(_Tensor()) is None
               for _ in range(1000))


def test_same_set_by_id_or_by_ranks():
    from kerasdist.keras import reduced as _reduced

    ranks = {0: [0, 1, 2], 1: [0, 2], 2: [0, 1, 2], 3: [0, 2]}.get
    assert _reduced.same_set(1, 1, ranks)
    assert _reduced.same_set(0, 2, ranks)   # the job's ranks, added again
    assert _reduced.same_set(1, 3, ranks)
    assert not _reduced.same_set(0, 1, ranks)
    assert not _reduced.same_set(7, 8, ranks)  # unknown ids
