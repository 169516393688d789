"""Checks of kerasdist.data under `kerasdist run -np N`.

Named checks (tests/support/checks.py); a failure raises. Uneven shards:
without an agreed step count these jobs would hang in the gradient
allreduce (the test's launch timeout would catch it).
"""

import functools
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
warnings.filterwarnings("ignore")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist import callbacks as kcb  # noqa: E402
from tests.support import checks  # noqa: E402
from tests.support.checks import check  # noqa: E402

kd.init()
R, N = kd.rank(), kd.size()
keras.utils.set_random_seed(50 + R)


def gathered(values, name):
    """All ranks' 1-D int64 `values`, concatenated in rank order."""
    return kd.allgather(np.asarray(values, np.int64), name=name).numpy()


@check("shard_disjoint_and_covering")
def check_shard_cover():
    total = 10
    x = np.arange(total)
    y = np.arange(total) * 10
    sx, sy = kd.data.shard((x, y))
    np.testing.assert_array_equal(sy, sx * 10)  # rows stay paired
    all_x = gathered(sx, "test.shard.np")
    assert sorted(all_x.tolist()) == list(range(total)), all_x  # disjoint+cover
    ds = kd.data.shard(tf.data.Dataset.range(total))
    all_ds = gathered(list(ds.as_numpy_iterator()), "test.shard.ds")
    assert sorted(all_ds.tolist()) == list(range(total)), all_ds
    d = kd.data.shard({"a": x, "b": y})
    np.testing.assert_array_equal(d["a"], sx)


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


def model():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                          keras.layers.Dense(1)])
    m.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05)), "mse")
    return m


def assert_same_weights(m, tag):
    for i, w in enumerate(m.weights):
        a = np.array(w)
        table = kd.allgather(a.reshape((1,) + a.shape),
                             name=f"test.{tag}.{i}").numpy()
        for r in range(N):
            np.testing.assert_array_equal(table[r], table[0])


def fit_and_check(tag, x, expected_local, expected_steps, **fit_kwargs):
    m = model()
    counter = CountSteps()
    stopper = keras.callbacks.EarlyStopping("loss", patience=100)
    equal = kcb.EqualizeStepsCallback()
    m.fit(x, epochs=3, verbose=0, callbacks=[
        kcb.BroadcastGlobalVariablesCallback(0), equal, stopper, counter],
        **fit_kwargs)
    local = gathered([expected_local], f"test.{tag}.local")
    assert len(set(local.tolist())) > 1, f"shards should be uneven: {local}"
    assert equal.steps == expected_steps, (equal.steps, expected_steps)
    assert counter.per_epoch == [expected_steps] * 3, counter.per_epoch
    assert_same_weights(m, tag)


@functools.cache
def uneven_arrays():
    """(n, x, y, sx, sy): one rank gets one more example than the others."""
    n = 2 * N + 1
    x = np.random.default_rng(0).normal(size=(n, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    sx, sy = kd.data.shard((x, y))
    return n, x, y, sx, sy


@functools.cache
def uneven_dataset():
    # Sharding AFTER batch splits batches: 2N+1 batches of 2.
    _, x, y, _, _ = uneven_arrays()
    ds = tf.data.Dataset.from_tensor_slices(
        (np.tile(x, (2, 1)), np.tile(y, (2, 1)))).batch(2)
    return kd.data.shard(ds)


@check("uneven_arrays")
def check_uneven_arrays():
    n, _, _, sx, sy = uneven_arrays()
    # batch_size=1: steps = examples per rank (3 on rank 0, 2 elsewhere).
    fit_and_check("arrays", sx, len(sx), n // N, y=sy, batch_size=1)


@check("uneven_dataset_min_steps")
def check_uneven_dataset():
    sds = uneven_dataset()
    local = int(sds.cardinality())
    fit_and_check("dataset", sds, local, kd.data.min_steps(local))


@check("uneven_equalize_steps_repeat")
def check_uneven_equalize_steps_repeat():
    # equalize_steps + repeat(): the other documented way.
    n, _, _, _, _ = uneven_arrays()
    sds = uneven_dataset()
    steps = kd.data.equalize_steps(sds)
    assert steps == n // N, steps
    m = model()
    counter = CountSteps()
    m.fit(sds.repeat(), steps_per_epoch=steps, epochs=2, verbose=0,
          callbacks=[kcb.BroadcastGlobalVariablesCallback(0), counter])
    assert counter.per_epoch == [steps, steps], counter.per_epoch
    assert_same_weights(m, "repeat")


@check("equalize_steps_arrays")
def check_equalize_steps_arrays():
    _, x, _, sx, sy = uneven_arrays()
    steps = kd.data.equalize_steps((sx, sy), batch_size=2)
    assert steps == min(-(-len(kd.data.shard(x, r, N)) // 2)
                        for r in range(N)), steps


if __name__ == "__main__":
    checks.main(rank=R)
