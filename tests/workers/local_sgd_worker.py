"""Worker for tests/parallel/test_local_sgd.py: runs under `kerasdist run`.

    python -m kerasdist.run -np 2 python \
        tests/workers/local_sgd_worker.py [--only CHECK,...]

Checks ModelAverageCallback (local SGD), as named checks
(tests/support/checks.py); a failure raises, which fails the rank and the
job. Float64 throughout:
K=1 local SGD and synchronous training differ only in summation order
(~1e-15 per step), so rtol 1e-9 separates rounding from a real mistake.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import kerasdist as kd  # noqa: E402
from tests.support import checks  # noqa: E402
from tests.support.checks import check  # noqa: E402

tf.get_logger().setLevel("ERROR")
kd.init()
keras.backend.set_floatx("float64")
RANK, SIZE = kd.rank(), kd.size()
B = 4  # per-rank batch
_seq = [0]


# Every check is in group "all"; the np=3 job runs "schedule_and_uneven".
checks.group("all")


def flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def close(a, b, what, rtol=1e-9, atol=1e-12):
    a, b = flat(a), flat(b)
    if not np.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: max abs diff {np.max(np.abs(a - b))}")


def identical_on_all_ranks(weights):
    """True when every rank holds bit-identical weights (all ranks call)."""
    _seq[0] += 1
    every = kd.allgather(tf.constant(flat(weights)[None, :]),
                         name=f"check.{_seq[0]}").numpy()
    return all(np.array_equal(row, every[0]) for row in every)


def data(steps, seed=0):
    """A learnable regression task, SIZE*B*steps rows; rank r's share is
    rows r*B..(r+1)*B of every global batch of SIZE*B."""
    rng = np.random.default_rng(seed)
    n = SIZE * B * steps
    x = rng.normal(size=(n, 4))
    y = np.tanh(x @ rng.normal(size=(4, 1))) + 0.05 * rng.normal(size=(n, 1))
    return x, y


def my_part(a, steps):
    g = a.reshape(steps, SIZE, B, *a.shape[1:])
    return g[:, RANK].reshape(steps * B, *a.shape[1:])


def model_fn():
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(1)  # the same start on every rank
    model.set_weights([rng.normal(size=w.shape) * 0.5
                       for w in model.get_weights()])
    return model


def train(opt, x, y, epochs=1, callbacks=(), model=None, **kw):
    if model is None:
        model = model_fn()
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks), **kw)
    return model


@check("k1_equals_sync",
       groups=("all", "schedule_and_uneven"))
def check_k1_equals_sync():
    """SGD without momentum, K=1: the average of the ranks' updated weights
    is the update by the averaged gradient."""
    steps = 12
    x, y = data(steps)
    xs, ys = my_part(x, steps), my_part(y, steps)
    sync = train(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), xs, ys,
                 epochs=2)
    local = train(keras.optimizers.SGD(0.1), xs, ys, epochs=2,
                  callbacks=[kd.callbacks.ModelAverageCallback(1)])
    close(local.get_weights(), sync.get_weights(), "K=1 vs sync")
    assert identical_on_all_ranks(local.get_weights())
    assert not np.allclose(flat(local.get_weights()),
                           flat(model_fn().get_weights()))
    # Momentum is linear in the gradients: K=1 gives the synchronous
    # weights; with average_optimizer_state each rank's slots match too
    # (without it they differ, so the slot check tests the option).
    sync = train(kd.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9)), xs, ys, epochs=2)
    local = train(keras.optimizers.SGD(0.05, momentum=0.9), xs, ys,
                  epochs=2, callbacks=[kd.callbacks.ModelAverageCallback(
                      1, average_optimizer_state=True)])
    close(local.get_weights(), sync.get_weights(), "K=1 momentum vs sync")
    close(local.optimizer.variables, sync.optimizer.variables,
          "K=1 momentum slots")


class _Probe(keras.callbacks.Callback):
    """Records whether the ranks agree after every batch and epoch."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        same = identical_on_all_ranks(self.model.get_weights())
        self.batches.append((step, same))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(identical_on_all_ranks(self.model.get_weights()))


@check("k4_identical_at_averaging_points",
       groups=("all", "schedule_and_uneven"))
def check_k4_schedule():
    """K=4, 6 batches per epoch, 2 epochs: identical right after steps
    4, 8, 12 and at both epoch ends, different everywhere else."""
    steps = 6
    x, y = data(steps)
    probe = _Probe()
    model = train(keras.optimizers.SGD(0.1, momentum=0.5),
                  my_part(x, steps), my_part(y, steps), epochs=2,
                  callbacks=[kd.callbacks.ModelAverageCallback(4), probe])
    want = [(s, SIZE == 1 or s % 4 == 0) for s in range(1, 13)]
    assert probe.batches == want, probe.batches
    assert probe.epochs == [True, True], probe.epochs
    assert int(model.optimizer.iterations.numpy()) == 12


def eval_loss(model, x, y):
    return float(np.mean((model.predict(x, batch_size=256, verbose=0)
                          - y) ** 2))


@check("k8_converges_like_sync")
def check_k8_converges():
    """K=8 reaches a loss close to synchronous training in as many epochs.

    Tolerance: final full-data MSE within 1.5x of synchronous training's
    plus 0.01 (measured at np=2: 0.0092 for both), and both far below the start
    (< 1/4 of it), so a run that does not learn fails.
    """
    steps, epochs = 32, 6
    x, y = data(steps, seed=5)
    xs, ys = my_part(x, steps), my_part(y, steps)
    start = eval_loss(model_fn(), x, y)
    sync = train(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), xs, ys,
                 epochs=epochs)
    local = train(keras.optimizers.SGD(0.1), xs, ys, epochs=epochs,
                  callbacks=[kd.callbacks.ModelAverageCallback(8)])
    assert identical_on_all_ranks(local.get_weights())
    l_sync, l_local = eval_loss(sync, x, y), eval_loss(local, x, y)
    print(f"LOSS start={start:.5f} sync={l_sync:.5f} k8={l_local:.5f}",
          flush=True)
    assert l_sync < start / 4 and l_local < start / 4, (start, l_sync,
                                                        l_local)
    assert l_local <= 1.5 * l_sync + 0.01, (l_sync, l_local)


def _shared_dir():
    """A fresh directory every rank knows: rank 0 makes it, sends its name."""
    path = tempfile.mkdtemp(prefix="kd-localsgd-") if RANK == 0 else ""
    raw = np.frombuffer(path.encode().ljust(256), dtype=np.uint8)
    got = kd.broadcast(tf.constant(raw), 0, name="check.dir").numpy()
    return bytes(got).decode().strip()


@check("resume_mid_period_exact")
def check_resume():
    """A checkpoint after epoch 1 (4 steps, K=3: one step into a period),
    resumed on rank 0 and broadcast, ends bit-identical to the job that
    ran straight through (the next average is at step 6, not 7)."""
    steps, k = 4, 3
    x, y = data(steps, seed=7)
    xs, ys = my_part(x, steps), my_part(y, steps)
    tmp = _shared_dir()

    def opt():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    def callbacks(path):
        return [kd.callbacks.BroadcastGlobalVariablesCallback(0),
                kd.callbacks.ModelAverageCallback(
                    k, average_optimizer_state=True),
                kd.callbacks.ModelCheckpoint(path)]

    pattern = os.path.join(tmp, "e{epoch}.weights.h5")
    straight = train(opt(), xs, ys, epochs=3, callbacks=callbacks(pattern))
    kd.barrier(name="check.saved")

    model = model_fn()
    model.compile(optimizer=opt(), loss="mse", jit_compile=False)
    if RANK == 0:
        first = kd.callbacks.load_checkpoint(
            os.path.join(tmp, "e1.weights.h5"), model)
        assert first == 1 and int(model.optimizer.iterations) == steps
    resumed = train(None, xs, ys, epochs=3, model=model, initial_epoch=1,
                    callbacks=callbacks(os.path.join(tmp, "r.weights.h5")))
    close(resumed.get_weights(), straight.get_weights(), "resume",
          rtol=0, atol=0)
    close(resumed.optimizer.variables, straight.optimizer.variables,
          "resume optimizer", rtol=0, atol=0)
    assert identical_on_all_ranks(resumed.get_weights())
    kd.barrier(name="check.compared")
    if RANK == 0:
        shutil.rmtree(tmp)


@check("uneven_shards",
       groups=("all", "schedule_and_uneven"))
def check_uneven_shards():
    """One more example than ranks * batches: rank 0 holds an extra (partial)
    batch; EqualizeStepsCallback keeps the averaging points matched."""
    steps = 5
    x, y = data(steps)
    x, y = np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]])
    xs, ys = kd.data.shard((x, y))
    model = train(keras.optimizers.SGD(0.1), xs, ys, epochs=2,
                  callbacks=[kd.callbacks.EqualizeStepsCallback(),
                             kd.callbacks.ModelAverageCallback(2)])
    assert identical_on_all_ranks(model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 2 * steps


@check("bad_args")
def check_bad_args():
    for bad in (0, -1, 2.0, True):
        try:
            kd.callbacks.ModelAverageCallback(bad)
        except ValueError as e:
            assert "every_n_batches" in str(e), e
        else:
            raise AssertionError(f"every_n_batches={bad!r} accepted")
    x, y = data(1)
    try:
        train(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              my_part(x, 1), my_part(y, 1),
              callbacks=[kd.callbacks.ModelAverageCallback(2)])
    except ValueError as e:
        assert "plain optimizer" in str(e), e
    else:
        raise AssertionError("a DistributedOptimizer was accepted")


if __name__ == "__main__":
    checks.main(rank=RANK)
