"""kerasdist.data: sharding rules in one process (explicit rank/size), and
a real job with uneven shards that must finish with equal steps."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402

_WORKER = os.path.join(REPO_ROOT, "tests", "workers", "data_shard_worker.py")
_CHECKS = ["shard_disjoint_and_covering", "uneven_arrays", "uneven_dataset",
           "uneven_equalize_steps_repeat", "equalize_steps_arrays"]


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


def test_shard_rejects_bad_input():
    from kerasdist import data
    with pytest.raises(ValueError, match="same length"):
        data.shard((np.zeros(3), np.zeros(4)), rank=0, size=2)
    with pytest.raises(ValueError, match="rank must be"):
        data.shard(np.zeros(3), rank=2, size=2)
    with pytest.raises(ValueError, match="batch_size"):
        data.num_batches(np.zeros(3))
    assert data.num_batches(np.zeros(5), batch_size=2) == 3


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.timeout(400)  # its launch may take 300 s
@pytest.mark.parametrize("np_", [2, 3])
def test_uneven_shards_finish_with_equal_steps(np_):
    out = launch(np_, [sys.executable, _WORKER], timeout=300,
                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stdout[-6000:]
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        assert [line[3:] for line in lines if line.startswith("OK ")] == \
            _CHECKS, out.stdout[-6000:]
        assert lines[-1] == "DONE"
