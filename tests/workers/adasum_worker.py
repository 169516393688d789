"""op=Adasum against the numpy reference (tests/support/adasum_ref.py) on
real ranks: every float dtype, several tensors in one fused batch (each
with its own dot products), the zero and identical cases, scale factors,
the errors (integers, reducescatter, a non-power-of-two job), one
DistributedOptimizer step (`apply`, then a Keras `fit` step), a
DistributedGradientTape, and the JAX (eager and jit) and PyTorch front
ends.

    adasum_worker.py [--only CHECK,...] [--group G]

Group "pow2" (the default) at -np 2 or 4; group "np3" at -np 3 (the one
check there: the error). Every rank makes the inputs of every rank from one
seed, so each can compute the reference itself.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist._core import capi  # noqa: E402
from tests.support import adasum_ref as ref  # noqa: E402
from tests.support import checks  # noqa: E402
from tests.support.checks import check  # noqa: E402

kd.init()
R, N = kd.rank(), kd.size()
TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}


def inputs(seed, shape, dtype, scale=1.0):
    """Every rank's tensor for `seed` (the same list on every rank)."""
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(shape)).astype(dtype)
            for _ in range(N)]


def expect(got, want, what, tol):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        what, got.dtype, got.shape, want.dtype, want.shape)
    err = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)),
                 initial=0.0)
    bound = tol * max(1.0, np.max(np.abs(want.astype(np.float64)),
                                  initial=0.0))
    assert err <= bound, f"{what}: max error {err} > {bound}"


def expect_error(fn, words, what):
    try:
        fn()
    except Exception as e:  # TF raises its own error classes
        text = str(e)
        for w in words:
            assert w in text, f"{what}: {w!r} not in {text!r}"
        return
    raise AssertionError(f"{what}: no error")


checks.group("pow2")


@check("allreduce_dtypes")
def allreduce_dtypes():
    before = capi.backend_runs("adasum")
    for k, dtype in enumerate((np.float32, np.float64, np.float16)):
        for shape in ((1,), (7,), (5, 13), (300,)):
            per_rank = inputs(100 * k + len(shape) + shape[0], shape, dtype)
            got = kd.allreduce(per_rank[R], op=kd.Adasum,
                               name=f"dt.{k}.{shape}")
            expect(keras.ops.convert_to_numpy(got), ref.tree(per_rank),
                   f"{dtype.__name__}{shape}", TOL[dtype])
    assert capi.backend_runs("adasum") - before == 12, (
        capi.backend_runs("adasum") - before)


@check("grouped_per_tensor")
def grouped_per_tensor():
    # Different sizes and magnitudes in one fused batch: each tensor's
    # result is its own tree, not that of the concatenation.
    shapes = [(3,), (17,), (2, 5), (64,), (1,)]
    scales = [1.0, 100.0, 0.01, 3.0, 7.0]
    per = [inputs(7 + i, s, np.float32, c)
           for i, (s, c) in enumerate(zip(shapes, scales))]
    before = capi.backend_runs("adasum")
    got = kd.grouped_allreduce([p[R] for p in per], op=kd.Adasum,
                               name="grouped")
    assert capi.backend_runs("adasum") - before == 1, "not one batch"
    for i, (g, p) in enumerate(zip(got, per)):
        expect(keras.ops.convert_to_numpy(g), ref.tree(p), f"tensor {i}",
               TOL[np.float32])
    flat = ref.tree([np.concatenate([p[r].ravel() for p in per])
                     for r in range(N)])
    mine = np.concatenate([keras.ops.convert_to_numpy(g).ravel()
                           for g in got])
    assert np.max(np.abs(mine - flat)) > 1e-3, "per-tensor = whole batch"


@check("zero_and_identical")
def zero_and_identical():
    a = np.arange(1, 10, dtype=np.float64) / 3
    got = kd.allreduce(a, op=kd.Adasum, name="same")
    expect(keras.ops.convert_to_numpy(got), a, "adasum(a, a) = a", 1e-12)
    zero = np.zeros(6, np.float32)
    got = kd.allreduce(zero, op=kd.Adasum, name="zeros")
    expect(keras.ops.convert_to_numpy(got), zero, "all zero", 0.0)
    # Rank 0's gradient is zero: its coefficient stays 1, the others sum
    # as the tree says.
    per_rank = inputs(11, (6,), np.float32)
    per_rank[0] = np.zeros(6, np.float32)
    got = kd.allreduce(per_rank[R], op=kd.Adasum, name="one_zero")
    expect(keras.ops.convert_to_numpy(got), ref.tree(per_rank), "one zero",
           TOL[np.float32])
    # Orthogonal gradients add up.
    eye = np.eye(N, 8, dtype=np.float32)
    got = kd.allreduce(eye[R], op=kd.Adasum, name="orthogonal")
    expect(keras.ops.convert_to_numpy(got), eye.sum(0), "orthogonal", 1e-7)


@check("scale_factors")
def scale_factors():
    per_rank = inputs(21, (9,), np.float64)
    got = kd.allreduce(per_rank[R], op=kd.Adasum, name="scaled",
                       prescale_factor=0.5, postscale_factor=3.0)
    want = 3.0 * ref.tree([0.5 * p for p in per_rank])
    expect(keras.ops.convert_to_numpy(got), want, "scaled", 1e-12)


@check("errors")
def errors():
    expect_error(lambda: kd.allreduce(np.arange(4, dtype=np.int32),
                                      op=kd.Adasum, name="int"),
                 ["Adasum", "int32", "float32"], "int32")
    expect_error(lambda: kd.reducescatter(np.ones((N, 2), np.float32),
                                          op=kd.Adasum, name="rs"),
                 ["Adasum", "allreduce"], "reducescatter")
    # The runtime still works after the refusals.
    got = kd.allreduce(np.ones(2, np.float32), op=kd.Sum, name="after")
    expect(keras.ops.convert_to_numpy(got), np.full(2, N, np.float32),
           "sum after errors", 0.0)


@check("optimizer_step")
def optimizer_step():
    # One SGD step of a two-variable model: the update is lr times each
    # variable's own Adasum of the ranks' gradients, not divided by size.
    w0 = np.linspace(-1, 1, 6).reshape(2, 3).astype(np.float32)
    b0 = np.array([0.5, -0.25, 2.0], np.float32)
    gw = inputs(31, (2, 3), np.float32)
    gb = inputs(32, (3,), np.float32, 10.0)
    w, b = keras.Variable(w0), keras.Variable(b0)
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=kd.Adasum)
    opt.apply([gw[R], gb[R]], [w, b])
    expect(w.numpy(), w0 - np.float32(0.1) * ref.tree(gw), "kernel", 1e-6)
    expect(b.numpy(), b0 - np.float32(0.1) * ref.tree(gb), "bias", 1e-6)
    expect_error(lambda: kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), op=kd.Adasum,
        backward_passes_per_step=2, average_aggregated_gradients=True),
        ["Adasum", "average_aggregated_gradients"], "average_aggregated")


@check("fit_step")
def fit_step():
    # One `fit` step of Dense(3) under MSE, each rank its own batch: the
    # weights move by lr times the Adasum of the ranks' numpy gradients.
    n, lr = 4, 0.05
    xs = inputs(71, (n, 2), np.float32)
    ys = inputs(72, (n, 3), np.float32)
    w0 = np.array([[0.5, -1.0, 0.25], [1.5, 0.0, -0.5]], np.float32)
    b0 = np.array([0.1, 0.2, -0.3], np.float32)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.set_weights([w0, b0])
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(lr), op=kd.Adasum), loss="mse",
        jit_compile=False)
    model.fit(xs[R], ys[R], batch_size=n, epochs=1, verbose=0,
              shuffle=False)
    gw, gb = [], []
    for x, y in zip(xs, ys):
        # MSE averages over every element of the batch (n x 3).
        err = (x.astype(np.float64) @ w0 + b0 - y) * (2.0 / (n * 3))
        gw.append((x.T.astype(np.float64) @ err).astype(np.float32))
        gb.append(err.sum(0).astype(np.float32))
    w, b = model.get_weights()
    expect(w, w0 - np.float32(lr) * ref.tree(gw), "kernel", 1e-5)
    expect(b, b0 - np.float32(lr) * ref.tree(gb), "bias", 1e-5)


@check("gradient_tape")
def gradient_tape():
    # d(g . x)/dx = g: the tape's gradient is the Adasum of the ranks' g.
    import tensorflow as tf
    per_rank = inputs(61, (5,), np.float32)
    x = tf.Variable(np.ones(5, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.constant(per_rank[R]) * x)
    tape = kd.DistributedGradientTape(tape, op=kd.Adasum)
    (grad,) = tape.gradient(loss, [x])
    expect(grad.numpy(), ref.tree(per_rank), "tape", TOL[np.float32])


@check("jax_allreduce")
def jax_allreduce():
    import jax.numpy as jnp

    import kerasdist.jax as kdj
    per_rank = inputs(41, (33,), np.float32)
    got = kdj.allreduce(jnp.asarray(per_rank[R]), op=kdj.Adasum,
                        name="jax")
    expect(np.asarray(got), ref.tree(per_rank), "jax", TOL[np.float32])
    # Inside jax.jit: the same reduction through the FFI op.
    import jax
    jitted = jax.jit(lambda x: kdj.allreduce(x, op=kdj.Adasum,
                                             name="jax.jit"))
    got = jitted(jnp.asarray(per_rank[R]))
    expect(np.asarray(got), ref.tree(per_rank), "jax jit", TOL[np.float32])


@check("torch_allreduce")
def torch_allreduce():
    import torch

    import kerasdist.torch as kdt
    per_rank = inputs(51, (4, 5), np.float64)
    got = kdt.allreduce(torch.from_numpy(per_rank[R]), op=kdt.Adasum,
                        name="torch")
    expect(got.numpy(), ref.tree(per_rank), "torch", TOL[np.float64])


checks.group("np3", default=False)


@check("not_power_of_two")
def not_power_of_two():
    expect_error(lambda: kd.allreduce(np.ones(3, np.float32), op=kd.Adasum,
                                      name="np3"),
                 ["Adasum", "power-of-two", str(N)], "np3")
    got = kd.allreduce(np.ones(2, np.float32), op=kd.Sum, name="after")
    expect(keras.ops.convert_to_numpy(got), np.full(2, N, np.float32),
           "sum after the error", 0.0)


if __name__ == "__main__":
    checks.main(rank=R)
