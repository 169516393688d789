"""kerasdist.data: sharding rules in one process (explicit rank/size), and
a real job with uneven shards that must finish with equal steps."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.worker_checks import WorkerChecks  # noqa: E402


def test_shard_arrays_strided_rule():
    from kerasdist import data
    x = np.arange(10)
    parts = [data.shard(x, rank=r, size=3) for r in range(3)]
    assert [p.tolist() for p in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    xs, ys = data.shard((x, x * 2), rank=1, size=3)
    assert xs.tolist() == [1, 4, 7] and ys.tolist() == [2, 8, 14]
    assert isinstance(data.shard([x, x], rank=0, size=2), list)


def test_shard_dataset_same_rule_as_arrays():
    import tensorflow as tf

    from kerasdist import data
    ds = tf.data.Dataset.range(10)
    for r in range(3):
        got = list(data.shard(ds, rank=r, size=3).as_numpy_iterator())
        assert got == data.shard(np.arange(10), rank=r, size=3).tolist()


def test_shard_and_num_batches_reject_bad_input():
    from kerasdist import data
    with pytest.raises(ValueError, match="same length"):
        data.shard((np.zeros(3), np.zeros(4)), rank=0, size=2)
    with pytest.raises(ValueError, match="rank must be"):
        data.shard(np.zeros(3), rank=2, size=2)
    with pytest.raises(ValueError, match="batch_size"):
        data.num_batches(np.zeros(3))
    assert data.num_batches(np.zeros(5), batch_size=2) == 3


# The uneven-shard checks of tests/workers/data_shard_worker.py, one test
# per check and size, one launch per size (its launch may take 300 s).
NP2 = WorkerChecks("data_shard_worker.py", np=2, timeout=300)
NP3 = WorkerChecks("data_shard_worker.py", np=3, timeout=300)
np2_job = NP2.fixture("np2_job")
np3_job = NP3.fixture("np3_job")


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.timeout(400)
@NP2.parametrize
def test_uneven_shards_equal_steps_np2(check, np2_job):
    np2_job.assert_passed(check)


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.timeout(400)
@NP3.parametrize
def test_uneven_shards_equal_steps_np3(check, np3_job):
    np3_job.assert_passed(check)
