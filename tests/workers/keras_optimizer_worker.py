"""Worker for tests/parallel/test_optimizer.py: runs under `kerasdist run`.

    python -m kerasdist.run -np 2 python tests/workers/keras_optimizer_worker.py [group ...]

Groups: equiv (training equivalence against a single-process truth), math
(hand-computed updates: clipping, accumulation, Sum, predivide), keras
(serialization, save/load, XLA, errors). Default: all. Each check prints
`OK <check>`; any failure raises, which fails the rank and the job.

The truth for an equivalence check is computed on every rank in-process,
with the plain Keras optimizer on the full data (batch size * ranks), from
the same initial weights. Float64 throughout, so the only difference between
the distributed and the single-process update is summation order: rtol 1e-9
over ~12 steps is far above that rounding (~1e-15 per step) and far below
any real mistake (a missing average changes weights at the 1e-2 level).
"""

import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import kerasdist as kd  # noqa: E402

tf.get_logger().setLevel("ERROR")
kd.init()
keras.backend.set_floatx("float64")
RANK, SIZE = kd.rank(), kd.size()
B = 4        # per-rank batch
STEPS = 12   # optimizer steps per equivalence check
RTOL = 1e-9  # float64; see the module docstring
_seq = [0]


def ok(check):
    print(f"OK {check}", flush=True)


def close(a, b, what, rtol=RTOL, atol=1e-12):
    if isinstance(a, list):
        a, b = flat(a), flat(b)
    a, b = np.asarray(a), np.asarray(b)
    if not np.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: max abs diff "
                             f"{np.max(np.abs(a - b))}\n{a}\n{b}")


def flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def same_on_all_ranks(weights, what):
    """Every rank holds bit-identical weights."""
    _seq[0] += 1
    mine = flat(weights)[None, :]
    every = kd.allgather(tf.constant(mine),
                         name=f"check.{what}.{_seq[0]}").numpy()
    for r in range(SIZE):
        if not np.array_equal(every[r], every[0]):
            raise AssertionError(f"{what}: rank {r} differs from rank 0")


def data(n_feat=4, seed=0):
    rng = np.random.default_rng(seed)
    n = SIZE * B * STEPS
    x = rng.normal(size=(n, n_feat))
    y = x @ rng.normal(size=(n_feat, 1)) + 0.1 * rng.normal(size=(n, 1))
    return x, y


def my_part(a):
    """Rank r's share: rows r*B..(r+1)*B of every global batch of SIZE*B."""
    g = a.reshape(STEPS, SIZE, B, *a.shape[1:])
    return g[:, RANK].reshape(STEPS * B, *a.shape[1:])


def dense_model():
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(size=w.shape) * 0.5
                       for w in model.get_weights()])
    return model


def embed_model():
    model = keras.Sequential([keras.Input((2,), dtype="int32"),
                              keras.layers.Embedding(10, 3),
                              keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(2)
    model.set_weights([rng.normal(size=w.shape) * 0.5
                       for w in model.get_weights()])
    return model


def fit(model, opt, x, y, batch, jit_compile=False):
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def check_fit(label, make_opt, make_model=dense_model, xy=None, rtol=RTOL,
              **kd_args):
    """Distributed fit on my part == single-process fit on everything."""
    x, y = xy if xy is not None else data()
    truth = fit(make_model(), make_opt(), x, y, SIZE * B)
    dist_opt = kd.DistributedOptimizer(make_opt(), **kd_args)
    got = fit(make_model(), dist_opt, my_part(x), my_part(y), B)
    close(got, truth, label, rtol=rtol)
    same_on_all_ranks(got, label)
    # The truth moved: a run that did not train would also be "equal".
    assert not np.allclose(flat(got), flat(make_model().get_weights()))
    ok(label)
    return dist_opt, got


# ---- equivalence -----------------------------------------------------------


def group_equiv():
    check_fit("fit_sgd", lambda: keras.optimizers.SGD(0.1))
    check_fit("fit_adam", lambda: keras.optimizers.Adam(0.01))
    check_fit("fit_sgd_momentum",
              lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
    check_fit("fit_rmsprop", lambda: keras.optimizers.RMSprop(0.01))
    check_fit("fit_adamw",
              lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1))
    check_fit("fit_loss_scale", lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10))
    # The runtime's prescale/postscale factors are TF float attributes
    # (32-bit): 1/f and f/size carry a relative error up to ~6e-8 unless
    # they are powers of two, hence rtol 1e-6 here.
    check_fit("fit_predivide", lambda: keras.optimizers.SGD(0.1),
              rtol=1e-6, gradient_predivide_factor=float(SIZE))
    check_fit("fit_global_clipnorm",
              lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5))

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 10, size=(SIZE * B * STEPS, 2)).astype("int32")
    ys = rng.normal(size=(len(ids), 1))
    # SGD updates the same with sparse or dense gradients. Adam does not
    # (Keras's sparse Adam leaves untouched rows' moments alone), so Adam is
    # checked with the sparse path only, against Keras's sparse truth.
    for dense in (False, True):
        check_fit(f"fit_embedding_sgd_sparse_as_dense={dense}",
                  lambda: keras.optimizers.SGD(0.5), embed_model,
                  xy=(ids, ys), sparse_as_dense=dense)
    check_fit("fit_embedding_adam_sparse",
              lambda: keras.optimizers.Adam(0.05), embed_model, xy=(ids, ys))

    # fp16 on the wire: float16 has an 11-bit significand (relative rounding
    # 2**-11 ~ 5e-4 per gradient element); over 12 SGD steps of lr 0.1 the
    # weights, of order 1, may move by ~1e-3 from the float64 result.
    x, y = data()
    _, exact = check_fit("fit_uncompressed_ref",
                         lambda: keras.optimizers.SGD(0.1))
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression=kd.Compression.fp16),
        my_part(x), my_part(y), B)
    close(got, exact, "fit_fp16", rtol=0, atol=2e-3)
    assert not np.array_equal(flat(got), flat(exact)), \
        "fp16 gave bit-identical weights: the gradients were not compressed"
    assert all(w.dtype == np.float64 for w in got)
    same_on_all_ranks(got, "fit_fp16")
    ok("fit_fp16")

    for mode in ("eager", "function"):
        check_tape(mode)


def check_tape(mode):
    x, y = data()
    truth = fit(dense_model(), keras.optimizers.SGD(0.1), x, y, SIZE * B)
    model = dense_model()
    opt = keras.optimizers.SGD(0.1)  # plain: the tape does the averaging
    xs, ys = my_part(x), my_part(y)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = kd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    if mode == "function":
        step = tf.function(step)
    for s in range(STEPS):
        step(tf.constant(xs[s * B:(s + 1) * B]),
             tf.constant(ys[s * B:(s + 1) * B]))
    close(model.get_weights(), truth, f"tape_{mode}")
    same_on_all_ranks(model.get_weights(), f"tape_{mode}")
    ok(f"tape_{mode}")


# ---- hand-computed updates -------------------------------------------------


def apply_steps(opt, grads_per_step, function):
    """Applies rank-dependent gradients to a fresh variable; returns the
    value after each step."""
    var = keras.Variable(np.zeros(3), name="v")

    def step(g):
        opt.apply([g], [var])

    if function:
        step = tf.function(step)
    seen = []
    for g in grads_per_step:
        step(tf.constant(g))
        seen.append(var.numpy().copy())
    return seen


def group_math():
    base = np.array([1.0, -2.0, 2.0])
    mean_r = (SIZE + 1) / 2  # mean of (r + 1) over ranks
    for function in (False, True):
        tag = "function" if function else "eager"

        # op=Sum and predivide.
        got = apply_steps(kd.DistributedOptimizer(
            keras.optimizers.SGD(1.0), op=kd.Sum),
            [base * (RANK + 1)], function)
        close(got[0], -base * SIZE * mean_r, f"sum_{tag}")
        ok(f"op_sum_{tag}")

        # backward_passes_per_step=2: local sum (or mean) of two gradients,
        # averaged over ranks, applied once; the first step changes nothing.
        for avg in (False, True):
            opt = kd.DistributedOptimizer(
                keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                average_aggregated_gradients=avg)
            grads = [base * (RANK + 1) * (t + 1) for t in range(4)]
            got = apply_steps(opt, grads, function)
            first = -base * mean_r * (1 + 2) / (2 if avg else 1)
            second = first - base * mean_r * (3 + 4) / (2 if avg else 1)
            close(got[0], np.zeros(3), f"bpps avg={avg} step0")
            close(got[1], first, f"bpps avg={avg} step1")
            close(got[2], first, f"bpps avg={avg} step2")
            close(got[3], second, f"bpps avg={avg} step3")
            assert int(opt.iterations.numpy()) == 2, opt.iterations
            ok(f"backward_passes_avg={avg}_{tag}")

        # Clipping acts on the averaged gradient. Rank r sends
        # small + (r - mean) * big: every local norm exceeds the clip
        # threshold (at np >= 2), the average is `small`, below it.
        small = np.array([0.3, 0.0, 0.4])  # norm 0.5
        big = np.array([10.0, 10.0, 10.0])
        g = small + (RANK - (SIZE - 1) / 2) * big
        for kw in ({"clipnorm": 1.0}, {"global_clipnorm": 1.0},
                   {"clipvalue": 1.0}):
            got = apply_steps(kd.DistributedOptimizer(
                keras.optimizers.SGD(1.0, **kw)), [g], function)
            close(got[0], -small, f"clip {kw} {tag}")
        # ...and does clip when the average is large: mean of (r+1)*base.
        got = apply_steps(kd.DistributedOptimizer(
            keras.optimizers.SGD(1.0, clipnorm=1.0)),
            [base * (RANK + 1)], function)
        avg_g = base * mean_r
        close(got[0], -avg_g / np.linalg.norm(avg_g), f"clipnorm big {tag}")
        ok(f"clip_on_averaged_gradient_{tag}")


# ---- Keras integration -----------------------------------------------------


def group_keras():
    orig = keras.optimizers.Adam(0.01, beta_1=0.8)
    opt = kd.DistributedOptimizer(orig)
    assert isinstance(opt, keras.optimizers.Adam)
    assert type(opt) is not keras.optimizers.Adam
    ok("isinstance")

    cfg = opt.get_config()
    assert cfg == orig.get_config(), cfg
    plain = keras.optimizers.Adam.from_config(cfg)
    assert type(plain) is keras.optimizers.Adam
    again = type(opt).from_config(cfg)
    assert again._kerasdist_settings is opt._kerasdist_settings
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is keras.optimizers.Adam
    assert restored.get_config() == cfg
    ok("get_config_round_trip")

    try:
        kd.DistributedOptimizer(opt)
    except ValueError as e:
        assert "already" in str(e), e
    else:
        raise AssertionError("double wrap did not raise")
    try:
        kd.DistributedGradientTape(kd.DistributedGradientTape(
            tf.GradientTape()))
    except ValueError as e:
        assert "already" in str(e), e
    else:
        raise AssertionError("double tape wrap did not raise")
    ok("double_wrap_error")

    # Save and load: the file loads without kerasdist custom objects.
    x, y = data()
    model = dense_model()
    fit(model, opt, my_part(x), my_part(y), B)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.Adam
    close(loaded.get_weights(), model.get_weights(), "load weights", rtol=0,
          atol=0)
    assert int(loaded.optimizer.iterations) == STEPS
    close(flat(loaded.optimizer.variables[1:]), flat(opt.variables[1:]),
          "load slots", rtol=0, atol=0)
    ok("save_load_model")

    # Wrapping a built optimizer keeps its state, and training continues.
    rewrapped = kd.DistributedOptimizer(loaded.optimizer)
    assert int(rewrapped.iterations) == STEPS
    close(flat(rewrapped.variables), flat(loaded.optimizer.variables),
          "rewrap state", rtol=0, atol=0)
    loaded.compile(optimizer=rewrapped, loss="mse", jit_compile=False)
    loaded.fit(my_part(x)[:B], my_part(y)[:B], batch_size=B, verbose=0)
    assert int(rewrapped.iterations) == STEPS + 1
    same_on_all_ranks(loaded.get_weights(), "rewrap")
    ok("wrap_built_optimizer")

    # XLA: a clear error, before any collective runs.
    model = dense_model()
    try:
        fit(model, kd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
            my_part(x), my_part(y), B, jit_compile=True)
    except RuntimeError as e:
        assert "cannot run inside an XLA-compiled function" in str(e), e
        assert "jit_compile=False" in str(e), e
        print(f"XLA message: {e}", flush=True)
    else:
        raise AssertionError("jit_compile=True trained without an error")
    # "auto" resolves to no XLA on a CPU-only machine, so it trains.
    if not tf.config.list_physical_devices("GPU"):
        got = fit(dense_model(), kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1)), my_part(x), my_part(y), B,
            jit_compile="auto")
        same_on_all_ranks(got, "auto")
    ok("jit_compile")

    try:
        kd.DistributedOptimizer(keras.optimizers.SGD(), op=kd.Max)
    except ValueError as e:
        assert "op must be" in str(e), e
    else:
        raise AssertionError("op=Max accepted")
    ok("bad_args")


GROUPS = {"equiv": group_equiv, "math": group_math, "keras": group_keras}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(GROUPS):
        GROUPS[name]()
    print("DONE", flush=True)
