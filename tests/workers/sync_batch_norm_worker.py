"""kerasdist.SyncBatchNormalization on the Keras backend that KERAS_BACKEND
names (tensorflow, jax or torch), under `kerasdist run -np N`:

    KERAS_BACKEND=jax python -m kerasdist.run -np 2 python \
        tests/workers/sync_batch_norm_worker.py DIR [--only CHECK,...]

Named checks (tests/support/checks.py), grouped by the backends they run
on (group "np1": the checks of a one-rank job). The truth is independent of
kerasdist: Keras' own BatchNormalization, in one process, on the global
batch (every rank's rows concatenated, rank 0's first), trained with the
plain optimizer. Each rank's rows are drawn around a different mean and
scale, so that a rank's own statistics are far from the global ones (the
checks show that plain BatchNormalization on a rank's rows misses the truth
by more than 100 * ATOL).

Ranks with unequal batches weight their loss by n_r * N / n_total, so the
average of the ranks' gradients is the gradient of the mean loss over the
global batch, as the truth computes it.

Float32: the global variance is E[x^2] - E[x]^2 of the reduced sums where
the truth takes the mean squared deviation, a difference of about 1e-7
relative; ATOL = 1e-5 on values of order 1.
"""

import importlib
import os
import sys

import keras
import numpy as np
from keras import ops

import kerasdist as kd
from tests.support import checks
from tests.support.checks import check

BACKEND = keras.backend.backend()
# The collectives on this backend's tensors (for the checks' own gathers).
FRONT = importlib.import_module(
    {"tensorflow": "kerasdist", "jax": "kerasdist.jax",
     "torch": "kerasdist.torch"}[BACKEND])
kd.init()
R, N = kd.rank(), kd.size()
DIR = sys.argv[1]
ATOL = 1e-5
STEPS = 4
LR = 0.1
EQUAL = [4] * N                          # rows per rank
UNEQUAL = [3 + 2 * r for r in range(N)]  # 3 and 5 at N = 2
_seq = [0]


def to_np(x):
    return np.asarray(ops.convert_to_numpy(x))


def gather(value):
    """[N, ...] numpy array of every rank's `value`."""
    _seq[0] += 1
    a = np.asarray(value, np.float32)
    out = FRONT.allgather(a.reshape((1,) + a.shape),
                          name=f"test.gather.{_seq[0]}")
    return to_np(out)


def flat(arrays):
    return np.concatenate([np.ravel(np.asarray(a, np.float64))
                           for a in arrays])


def assert_close(got, truth, what, atol=ATOL):
    diff = np.max(np.abs(flat(got) - flat(truth)))
    assert diff <= atol, f"{what}: max abs diff {diff} > {atol}"
    return diff


def same_on_all_ranks(arrays, what):
    table = gather(flat(arrays).astype(np.float32))
    for r in range(N):
        np.testing.assert_array_equal(table[r], table[0],
                                      err_msg=f"{what}: rank {r} differs")


def mine(a, sizes):
    """This rank's rows of a global batch made of `sizes` rows per rank."""
    start = sum(sizes[:R])
    return a[start:start + sizes[R]]


def global_batches(sizes, shape, seed, steps=STEPS):
    """`steps` global batches (x, y); rank r's rows of x are drawn around
    2r with scale 1 + r."""
    rng = np.random.default_rng(seed)
    coef = rng.normal(size=(int(np.prod(shape)), 1))
    out = []
    for _ in range(steps):
        x = np.concatenate([rng.normal(size=(n,) + tuple(shape)) * (1 + r)
                            + 2.0 * r for r, n in enumerate(sizes)])
        y = x.reshape(len(x), -1) @ coef / np.sqrt(coef.size)
        out.append((x.astype("float32"), y.astype("float32")))
    return out


def model(norm, shape, seed=1):
    """Input(shape) -> Dense(3, or 4 on 2-d samples) -> norm -> Flatten ->
    Dense(1), with weights (the norm's moving statistics too) drawn from
    `seed`."""
    units = 3 if len(shape) == 1 else 4
    m = keras.Sequential([keras.Input(shape), keras.layers.Dense(units), norm,
                          keras.layers.Flatten(), keras.layers.Dense(1)])
    rng = np.random.default_rng(seed)
    weights = []
    for v in m.weights:
        w = rng.normal(size=v.shape) * 0.5
        if v.path.endswith("variance"):
            w = np.abs(w) + 0.5
        weights.append(w.astype("float32"))
    m.set_weights(weights)
    return m


def stats(layer):
    return [to_np(layer.moving_mean), to_np(layer.moving_variance)]


def train(norm, sizes, shape, distributed, seed=0, jit_compile="auto"):
    """STEPS training steps of `model(norm)` (one `train_on_batch` each,
    preceded by an eager call in training mode, which also updates the
    moving statistics); distributed: on this rank's rows with
    `DistributedOptimizer`. Returns a record per step and the inference
    outputs on fresh data; the compiled model's `jit_compile` after
    training is in the last record ("jit_compile")."""
    m = model(norm, shape)
    opt = keras.optimizers.SGD(LR, momentum=0.5)
    if distributed:
        opt = kd.DistributedOptimizer(opt)
    m.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    weight = sizes[R] * N / sum(sizes) if distributed else 1.0
    records = []
    for x, y in global_batches(sizes, shape, seed):
        if distributed:
            x, y = mine(x, sizes), mine(y, sizes)
        out = to_np(m(x, training=True))
        called = stats(norm)
        m.train_on_batch(x, y, sample_weight=np.full(len(x), weight,
                                                     "float32"))
        records.append({"out": out, "called": called, "stats": stats(norm),
                        "weights": m.get_weights()})
    records[-1]["jit_compile"] = m.jit_compile
    (test_x, _), = global_batches(sizes, shape, seed + 100, steps=1)
    if distributed:
        test_x = mine(test_x, sizes)
    infer = [to_np(m(test_x, training=False)),
             np.asarray(m.predict(test_x, verbose=0))]
    return records, infer


def check_training(label, sizes, shape, axis, jit_compile="auto"):
    """SyncBatchNormalization with DistributedOptimizer on this rank's
    rows == BatchNormalization with the plain optimizer on the global
    batch: the training-mode outputs (this rank's rows), the moving
    statistics after every call and step, the weights after every step and
    the inference outputs. Returns the distributed model's `jit_compile`
    after training."""
    truth, truth_infer = train(keras.layers.BatchNormalization(axis=axis),
                               sizes, shape, distributed=False,
                               jit_compile=jit_compile)
    got, got_infer = train(kd.SyncBatchNormalization(axis=axis), sizes,
                           shape, distributed=True, jit_compile=jit_compile)
    worst = 0.0
    for s, (g, t) in enumerate(zip(got, truth)):
        worst = max(worst, assert_close(
            g["out"], mine(t["out"], sizes), f"{label} step {s}: output"))
        worst = max(worst, assert_close(
            g["called"], t["called"], f"{label} step {s}: moving stats "
            "after the training-mode call"))
        worst = max(worst, assert_close(
            g["stats"], t["stats"], f"{label} step {s}: moving stats"))
        worst = max(worst, assert_close(
            g["weights"], t["weights"], f"{label} step {s}: weights"))
        same_on_all_ranks(g["weights"], f"{label} step {s}: weights")
    for what, g, t in zip(("call", "predict"), got_infer, truth_infer):
        worst = max(worst, assert_close(g, mine(t, sizes),
                                        f"{label}: inference ({what})"))
    # The truth trained, and each rank's own statistics are far from the
    # global ones: a layer that skipped the reduction would fail above.
    assert_moved(truth, label)
    (x, _), = global_batches(sizes, shape, seed=0, steps=1)
    local = model(keras.layers.BatchNormalization(axis=axis), shape)
    miss = np.max(np.abs(to_np(local(mine(x, sizes), training=True))
                         - mine(truth[0]["out"], sizes)))
    assert miss > 100 * ATOL, f"{label}: rank statistics are too close"
    print(f"{label}: max diff {worst:.2e}, local statistics {miss:.2e}",
          flush=True)
    return got[-1]["jit_compile"]


def assert_moved(records, label):
    first, last = records[0]["weights"], records[-1]["weights"]
    moved = np.max(np.abs(flat(first) - flat(last)))
    assert moved > 100 * ATOL, f"{label}: the truth did not train"


checks.group("tensorflow", "jax", "torch")


@check("sync_batch_normalization_fit")
def fit_equal():
    check_training("fit", EQUAL, (4,), axis=-1)


@check("sync_batch_normalization_unequal_batches")
def fit_unequal():
    check_training("unequal", UNEQUAL, (4,), axis=-1)


@check("sync_batch_normalization_xla", groups=("tensorflow",))
def fit_xla():
    # TensorFlow with jit_compile=True: the layer's allreduce is compiled
    # into the XLA train step (a custom call on the CPU), which keeps XLA.
    kept = check_training("xla", UNEQUAL, (4,), axis=-1, jit_compile=True)
    from kerasdist.tensorflow import collectives
    assert kept == (collectives.xla_unsupported() is None), kept


@check("sync_batch_normalization_channels_first")
def fit_channels_first():
    # (batch, channels=3, 5) -> Dense(4) acts on the last axis: the layer
    # normalises axis 1 (3 channels) over the batch and the last axis.
    check_training("channels_first", UNEQUAL, (3, 5), axis=1)


# ---- gradients, taken directly ----------------------------------------------


def loss_and_grads(m, x, y, scale, jit=False):
    """The loss scale * sum((y - m(x))**2) in training mode and its
    gradients for m's trainable weights; the moving statistics are
    updated."""
    y = ops.convert_to_tensor(y)
    if BACKEND == "tensorflow":
        import tensorflow as tf
        with tf.GradientTape() as tape:
            loss = ops.sum(ops.square(y - m(x, training=True))) * scale
        grads = tape.gradient(loss, m.trainable_variables)
    elif BACKEND == "jax":
        import jax
        trainable = [v.value for v in m.trainable_variables]
        rest = [v.value for v in m.non_trainable_variables]

        def f(trainable):
            out, new = m.stateless_call(trainable, rest, x, training=True)
            return ops.sum(ops.square(y - out)) * scale, new

        step = jax.value_and_grad(f, has_aux=True)
        if jit:
            step = jax.jit(step)
        (loss, new), grads = step(trainable)
        for v, value in zip(m.non_trainable_variables, new):
            v.assign(value)
    else:
        import torch
        loss = ops.sum(ops.square(y - m(x, training=True))) * scale
        grads = torch.autograd.grad(
            loss, [v.value for v in m.trainable_variables])
    return to_np(loss), [to_np(g) for g in grads]


def check_gradients(label, jit=False):
    """The backward pass through SyncBatchNormalization on this rank's
    rows, averaged over the ranks, == BatchNormalization's on the global
    batch, at every one of STEPS steps (weights updated by plain SGD from
    the averaged gradients on both sides)."""
    sizes, shape = UNEQUAL, (4,)
    total = sum(sizes)
    sync = model(kd.SyncBatchNormalization(), shape)
    plain = model(keras.layers.BatchNormalization(), shape)
    worst = 0.0
    for s, (x, y) in enumerate(global_batches(sizes, shape, seed=7)):
        loss, grads = loss_and_grads(sync, mine(x, sizes), mine(y, sizes),
                                     N / total, jit)
        grads = [to_np(g) for g in FRONT.grouped_allreduce(
            grads, op=kd.Average, name=f"test.grads.{label}.{s}")]
        loss = float(gather(loss).mean())
        truth_loss, truth = loss_and_grads(plain, x, y, 1.0 / total, jit)
        assert abs(loss - float(truth_loss)) <= ATOL, (label, s, loss,
                                                      truth_loss)
        worst = max(worst, assert_close(grads, truth,
                                        f"{label} step {s}: gradients"))
        assert_close(stats(sync.layers[1]), stats(plain.layers[1]),
                     f"{label} step {s}: moving stats")
        for m, g in ((sync, grads), (plain, truth)):
            m.set_weights([w - LR * d if v.trainable else w for v, w, d in
                           zip(m.weights, m.get_weights(), _dense(m, g))])
    assert np.max(np.abs(flat(truth))) > 100 * ATOL, "zero gradients"
    print(f"{label}: max gradient diff {worst:.2e}", flush=True)


def _dense(m, grads):
    """`grads` (one per trainable weight) aligned with `m.weights`, zeros
    for the others."""
    it = iter(grads)
    return [next(it) if v.trainable else 0.0 for v in m.weights]


@check("sync_batch_normalization_gradients")
def gradients_eager():
    check_gradients("gradients")


@check("sync_batch_normalization_gradients_jit", groups=("jax",))
def gradients_jit():
    check_gradients("gradients_jit", jit=True)


# ---- arguments ---------------------------------------------------------------


def layer_pair(**kwargs):
    """(SyncBatchNormalization, BatchNormalization), same arguments."""
    return (kd.SyncBatchNormalization(**kwargs),
            keras.layers.BatchNormalization(**kwargs))


def check_calls(label, sync, plain, xs, masks=None, extra=()):
    """Training-mode calls of `sync` on this rank's rows and of `plain` on
    the global batch agree (outputs, moving statistics, `extra` weights)."""
    sizes = UNEQUAL
    for i, x in enumerate(xs):
        mask = None if masks is None else masks[i]
        got = sync(mine(x, sizes), training=True,
                   mask=None if mask is None else mine(mask, sizes))
        truth = plain(x, training=True, mask=mask)
        assert_close(to_np(got), mine(to_np(truth), sizes),
                     f"{label} call {i}: output")
        for name in ("moving_mean", "moving_variance") + tuple(extra):
            assert_close(to_np(getattr(sync, name)),
                         to_np(getattr(plain, name)),
                         f"{label} call {i}: {name}")
    same_on_all_ranks(stats(sync), f"{label}: moving stats")


def rank_data(shape, seed, calls=3):
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.normal(size=(n,) + shape) * (1 + r) + 2.0 * r
                            for r, n in enumerate(UNEQUAL)]).astype("float32")
            for _ in range(calls)]


@check("sync_batch_normalization_arguments")
def arguments():
    # momentum, epsilon, no scale or centre, initializers.
    sync, plain = layer_pair(momentum=0.5, epsilon=0.01, center=False,
                             scale=False, moving_variance_initializer="zeros")
    check_calls("arguments", sync, plain, rank_data((6,), seed=3))
    sync, plain = layer_pair(axis=2, beta_initializer="ones",
                             gamma_initializer="random_normal")
    plain.build((None, 2, 3))
    sync.build((None, 2, 3))
    sync.gamma.assign(plain.gamma)
    check_calls("axis=2", sync, plain, rank_data((2, 3), seed=4))


@check("sync_batch_normalization_mask")
def masked():
    # A mask one dimension short of the inputs: the masked elements count
    # for nothing in the statistics (BatchNormalization's semantics).
    rng = np.random.default_rng(5)
    xs = rank_data((3, 2), seed=6)
    masks = [rng.random((sum(UNEQUAL), 3)) > 0.4 for _ in xs]
    sync, plain = layer_pair()
    check_calls("mask", sync, plain, xs, masks)


@check("sync_batch_normalization_renorm")
def renorm():
    sync, plain = layer_pair(renorm=True, renorm_momentum=0.5, renorm_clipping={
        "rmax": 2.0, "rmin": 0.5, "dmax": 1.0})
    check_calls("renorm", sync, plain, rank_data((4,), seed=8),
                extra=("renorm_mean", "renorm_stddev", "moving_stddev"))


@check("sync_batch_normalization_unsynchronized")
def unsynchronized():
    # synchronized=False: this rank's statistics, as BatchNormalization on
    # this rank's rows alone.
    x = mine(rank_data((4,), seed=9, calls=1)[0], UNEQUAL)
    sync, plain = layer_pair(synchronized=False)
    np.testing.assert_allclose(to_np(sync(x, training=True)),
                               to_np(plain(x, training=True)), atol=1e-6)
    assert sync.get_config()["synchronized"] is False


@check("sync_batch_normalization_inference_communicates_nothing")
def inference_only_rank0():
    # Inference and a frozen layer communicate nothing: rank 0 alone calls
    # them; a collective would wait for the other ranks (and the named
    # gather below would then mismatch).
    layer = kd.SyncBatchNormalization()
    x = rank_data((4,), seed=10, calls=1)[0]
    if R == 0:
        layer(x, training=False)
        layer.trainable = False
        layer(x, training=True)
    same_on_all_ranks([np.float32(1.0)], "after rank 0's calls")


# ---- one rank ----------------------------------------------------------------

checks.group("np1")


@check("sync_batch_normalization_size_1_is_plain")
def size_1():
    # One rank: Keras' own moments, bit for bit, no collective.
    assert N == 1, N
    sizes = [8]
    truth, truth_infer = train(keras.layers.BatchNormalization(), sizes,
                               (4,), distributed=False)
    got, got_infer = train(kd.SyncBatchNormalization(), sizes, (4,),
                           distributed=True)
    for g, t in zip(got, truth):
        for key in ("out", "called", "stats", "weights"):
            np.testing.assert_array_equal(flat(g[key]), flat(t[key]),
                                          err_msg=key)
    np.testing.assert_array_equal(flat(got_infer), flat(truth_infer))


@check("sync_batch_normalization_config_and_save")
def config_and_save():
    layer = kd.SyncBatchNormalization(axis=1, momentum=0.9, epsilon=1e-4,
                                      synchronized=True, name="sbn")
    assert isinstance(layer, keras.layers.BatchNormalization)
    config = layer.get_config()
    again = kd.SyncBatchNormalization.from_config(config)
    assert again.get_config() == config, (again.get_config(), config)
    assert config["synchronized"] is True and config["axis"] == 1
    for bad, match in ((dict(fused=True), "fused"),
                       (dict(synchronized="yes"), "synchronized")):
        try:
            kd.SyncBatchNormalization(**bad)
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"{bad} accepted")
    kd.SyncBatchNormalization(fused=False)  # Horovod's default
    m = model(kd.SyncBatchNormalization(), (4,))
    path = os.path.join(DIR, f"sync_bn_rank{R}.keras")
    m.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.layers[1]) is kd.SyncBatchNormalization
    x = rank_data((4,), seed=11, calls=1)[0]
    np.testing.assert_array_equal(to_np(loaded(x)), to_np(m(x)))


if __name__ == "__main__":
    checks.main(rank=R)
