"""Checks of kerasdist.callbacks under `kerasdist run -np N` (N >= 2).

    python -m kerasdist.run -np 2 python \
        tests/workers/keras_callbacks_worker.py train DIR   # all checks
    python -m kerasdist.run -np 2 python \
        tests/workers/keras_callbacks_worker.py resume DIR  # fresh job

`train` writes checkpoints and expected states under DIR; `resume` loads
the epoch-2 checkpoint in a new job and compares.

Prints `OK <check>` per passed check; any failure raises (non-zero exit).
Truths are computed independently: allgathered raw values, closed-form
learning rates, a numpy simulation of SGD with momentum.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist import callbacks as kcb  # noqa: E402

kd.init()
R, N = kd.rank(), kd.size()
keras.utils.set_random_seed(1000 + R)  # ranks initialise differently


def gather(value, name):
    """[N, ...] numpy array of every rank's value."""
    a = np.asarray(value)
    return kd.allgather(a.reshape((1,) + a.shape), name=name).numpy()


def state(model):
    return [np.array(v) for v in model.weights] + \
        [np.array(v) for v in model.optimizer.variables]


def assert_same_on_all_ranks(arrays, tag):
    for i, a in enumerate(arrays):
        table = gather(a, f"test.{tag}.{i}")
        for r in range(N):
            np.testing.assert_array_equal(table[r], table[0], err_msg=tag)


def mlp(with_input=True, units=4):
    layers = [keras.layers.Dense(units, activation="tanh"),
              keras.layers.Dense(1)]
    if with_input:
        layers.insert(0, keras.Input((3,)))
    return keras.Sequential(layers)


def data(n=8, seed=0):
    rng = np.random.default_rng(seed + R)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.normal(size=(n, 1)).astype("float32"))


def ok(check):
    print(f"OK {check}", flush=True)


# ---- broadcast --------------------------------------------------------------

def check_broadcast():
    x, y = data()
    # lr=0: after fit every rank must hold root's *initial* weights.
    for root in (0, N - 1):
        for built in (True, False):
            model = mlp(with_input=built)
            model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                          "mse")
            if built:
                initial = [np.array(v) for v in model.weights]
                table = gather(initial[0], f"test.init.{root}")
                assert not np.array_equal(table[0], table[1]), \
                    "ranks should start from different weights"
                root_initial = [
                    gather(a, f"test.root_init.{root}.{i}")[root]
                    for i, a in enumerate(initial)]
            # Not built: the broadcast runs after the first batch (lr=0, so
            # that batch changes nothing); ranks must then agree.
            model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
                      callbacks=[kcb.BroadcastGlobalVariablesCallback(root)])
            if built:
                for w, expected in zip(model.weights, root_initial):
                    np.testing.assert_array_equal(np.array(w), expected)
            assert_same_on_all_ranks(state(model), f"bcast.{root}.{built}")
            ok(f"broadcast_root{root}_{'built' if built else 'deferred'}")

    # Optimizer built before fit, with rank-dependent state (as after a
    # checkpoint loaded on one rank only): Adam slots and iterations.
    model = mlp()
    model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse")
    model.optimizer.build(model.trainable_variables)
    for v in model.optimizer.variables:
        if "iteration" in v.path:
            v.assign(7 + R)
        elif v.dtype == "float32" and len(v.shape):
            v.assign(np.full(v.shape, 0.1 * (R + 1), "float32"))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[kcb.BroadcastGlobalVariablesCallback(0)])
    assert int(model.optimizer.iterations) == 7 + 2, \
        int(model.optimizer.iterations)
    assert_same_on_all_ranks(state(model), "bcast.prebuilt")
    ok("broadcast_optimizer_state")

    # verify=True passes when ranks agree ...
    model = mlp()
    model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0,
              callbacks=[kcb.BroadcastGlobalVariablesCallback(0, verify=True)])
    ok("verify_passes")

    # ... and names the variable when one rank's weights are perturbed.
    class Perturb(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if R == 1:
                k = self.model.layers[1].kernel
                k.assign(k + 1.0)

    model = mlp()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
    try:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[
            Perturb(), kcb.BroadcastGlobalVariablesCallback(0, verify=True)])
    except RuntimeError as e:
        assert model.layers[1].kernel.path in str(e), str(e)
        assert "rank 1" in str(e), str(e)
        ok("verify_raises")
    else:
        raise AssertionError("verify=True did not detect the perturbation")


# ---- metric averaging -------------------------------------------------------

class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.batches = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def check_metric_average(directory):
    x, y = data(8, seed=5)
    vx, vy = data(4, seed=9)
    for every_batch in (False, True):
        model = mlp()
        model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                      "mse", metrics=["mae"])
        before, after = Record(), Record()
        stopper = keras.callbacks.EarlyStopping(monitor="val_mae",
                                                patience=10)
        ckpt = kcb.ModelCheckpoint(
            os.path.join(directory, f"best{R}.weights.h5"), monitor="val_mae",
            save_best_only=True)
        hist = model.fit(
            x, y, batch_size=2, epochs=2, verbose=0, shuffle=False,
            validation_data=(vx, vy), callbacks=[
                kcb.BroadcastGlobalVariablesCallback(0), before,
                kcb.MetricAverageCallback(every_batch=every_batch), after,
                stopper, ckpt])
        keys = sorted(before.epochs[0])
        assert {"loss", "mae", "val_loss", "val_mae"} <= set(keys), keys
        raw = np.array([[e[k] for k in keys] for e in before.epochs])
        truth = gather(raw, f"test.metric.{every_batch}").mean(axis=0)
        got = np.array([[e[k] for k in keys] for e in after.epochs])
        np.testing.assert_allclose(got, truth, rtol=1e-12)
        raw_table = gather(raw, f"test.metric_raw.{every_batch}")
        assert not np.allclose(raw_table[0], raw_table[1]), \
            "per-rank metrics should differ (different shards)"
        for i, k in enumerate(keys):
            np.testing.assert_allclose(hist.history[k], truth[:, i],
                                       rtol=1e-12)
        # Callbacks placed after it saw the averaged value.
        assert stopper.best == min(truth[:, keys.index("val_mae")])
        assert ckpt.best == min(truth[:, keys.index("val_mae")])
        if every_batch:
            bkeys = sorted(before.batches[0])
            raw_b = np.array([[b[k] for k in bkeys] for b in before.batches])
            truth_b = gather(raw_b, "test.metric_batch").mean(axis=0)
            got_b = np.array([[b[k] for k in bkeys] for b in after.batches])
            np.testing.assert_allclose(got_b, truth_b, rtol=1e-12)
        ok(f"metric_average_every_batch_{every_batch}")


# ---- learning rate ----------------------------------------------------------

class RecordLR(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(np.array(self.model.optimizer.learning_rate)))


def linear_model():
    # loss = mean(x @ w) with x = 1: the gradient is 1 for every weight at
    # every step, so the update can be simulated exactly in numpy.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    return model


def simulate_momentum(lrs, momentum, correction):
    w = v = 0.0
    prev = None
    for lr in lrs:
        ratio = lr / prev if (correction and prev) else 1.0
        v = momentum * ratio * v - lr * 1.0
        w += v
        prev = lr
    return w


def check_learning_rate():
    steps, epochs, warm = 4, 3, 2
    x = np.ones((steps * 2, 3), "float32")
    y = np.zeros((steps * 2, 1), "float32")
    finals = {}
    for correction in (True, False):
        model = linear_model()
        model.compile(
            kd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
            loss=lambda t, p: keras.ops.mean(p))
        rec = RecordLR()
        model.fit(x, y, batch_size=2, epochs=epochs, verbose=0, callbacks=[
            kcb.BroadcastGlobalVariablesCallback(0),
            kcb.LearningRateWarmupCallback(
                0.4, warmup_epochs=warm, momentum_correction=correction),
            rec])
        expected = []
        for e in range(epochs):
            for b in range(steps):
                ep = min(e + (b + 1) / steps, warm)
                expected.append(0.4 / N * (ep * (N - 1) / warm + 1))
        np.testing.assert_allclose(rec.lrs, expected, rtol=1e-6)
        # Float32 weights against a float64 simulation over 12 steps.
        w = np.array(model.layers[0].kernel)
        sim = simulate_momentum(rec.lrs, 0.9, correction)
        np.testing.assert_allclose(w, np.full((3, 1), sim), rtol=1e-5)
        finals[correction] = sim
        ok(f"warmup_lr_and_momentum_correction_{correction}")
    assert abs(finals[True] - finals[False]) > 1e-3

    # Schedules: staircase in [1, 3), fractional, constant multiplier.
    for staircase in (True, False):
        model = linear_model()
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
        rec = RecordLR()
        model.fit(x, y, batch_size=2, epochs=4, verbose=0, callbacks=[
            kcb.LearningRateScheduleCallback(
                0.8, lambda e: 0.5 ** e, start_epoch=1, end_epoch=3,
                staircase=staircase),
            rec])
        expected = []
        lr = 0.1
        for e in range(4):
            for b in range(steps):
                if 1 <= e < 3 and (not staircase or b == 0):
                    lr = 0.8 * 0.5 ** (e + (0 if staircase else b / steps))
                expected.append(lr)
        np.testing.assert_allclose(rec.lrs, expected, rtol=1e-6)
        ok(f"learning_rate_schedule_staircase_{staircase}")
    model = linear_model()
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    rec = RecordLR()
    hist = model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[
        kcb.LearningRateScheduleCallback(0.8, 0.25, start_epoch=1), rec])
    np.testing.assert_allclose(rec.lrs, [0.1] * steps + [0.2] * steps,
                               rtol=1e-6)
    np.testing.assert_allclose(hist.history["learning_rate"], [0.1, 0.2],
                               rtol=1e-6)
    ok("learning_rate_schedule_constant_multiplier")


# ---- checkpoint -------------------------------------------------------------

def ckpt_model():
    model = mlp()
    model.compile(kd.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9)), "mse")
    return model


def check_checkpoint_train(directory):
    x, y = data(8, seed=21)

    class SaveExpected(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                np.savez(os.path.join(directory, f"expected{R}.npz"),
                         *state(self.model))

    model = ckpt_model()
    mine = os.path.join(directory, f"rank{R}")
    model.fit(x, y, batch_size=2, epochs=3, verbose=0, shuffle=False,
              callbacks=[
                  kcb.BroadcastGlobalVariablesCallback(0),
                  kcb.ModelCheckpoint(
                      os.path.join(mine, "epoch{epoch}.weights.h5")),
                  SaveExpected()])
    np.savez(os.path.join(directory, f"final{R}.npz"), *state(model))
    kd.barrier(name="test.ckpt_written")
    listing = sorted(os.listdir(mine)) if os.path.isdir(mine) else []
    if R == 0:
        assert listing == [f"epoch{e}.weights.h5" for e in (1, 2, 3)], listing
        assert kcb.latest_checkpoint(mine).endswith("epoch3.weights.h5")
    else:
        assert listing == [], listing
    ok("checkpoint_rank0_only")


def check_checkpoint_resume(directory):
    x, y = data(8, seed=21)
    model = ckpt_model()
    path = os.path.join(directory, "rank0", "epoch2.weights.h5")
    initial_epoch = kcb.load_checkpoint(path, model)
    assert initial_epoch == 2, initial_epoch
    with np.load(os.path.join(directory, "expected0.npz")) as f:
        expected = [f[k] for k in sorted(f.files, key=lambda s: int(s[4:]))]
    got = state(model)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 2 * 4
    ok("checkpoint_loaded_state")
    model.fit(x, y, batch_size=2, epochs=3, initial_epoch=initial_epoch,
              verbose=0, shuffle=False,
              callbacks=[kcb.BroadcastGlobalVariablesCallback(0)])
    with np.load(os.path.join(directory, "final0.npz")) as f:
        final = [f[k] for k in sorted(f.files, key=lambda s: int(s[4:]))]
    for a, b in zip(state(model), final):
        # Same data, same order, same ops: only summation order may differ.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    ok("checkpoint_resume_matches_uninterrupted")


if __name__ == "__main__":
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "train":
        check_broadcast()
        check_metric_average(directory)
        check_learning_rate()
        check_checkpoint_train(directory)
    else:
        check_checkpoint_resume(directory)
    print("DONE", flush=True)
