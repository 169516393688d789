"""Worker for tests/parallel/test_optimizer.py: runs under `kerasdist run`.

    python -m kerasdist.run -np 2 python \
        tests/workers/keras_optimizer_worker.py [--only CHECK,...] [--group G]

Named checks (tests/support/checks.py) in groups: equiv (training
equivalence against a single-process truth), math (hand-computed updates:
clipping, accumulation, Sum, predivide, groups, loss scaling), keras
(serialization, save/load, XLA, mixed precision, errors), odd (some equiv
and math checks, run at np=3 as well), np1 (run alone at np=1: no
collective is created). Default: all but np1. A failed check
raises, which fails the rank and the job.

The truth for an equivalence check is computed on every rank in-process,
with the plain Keras optimizer on the full data (batch size * ranks), from
the same initial weights. Float64 throughout, so the only difference between
the distributed and the single-process update is summation order: rtol 1e-9
over ~12 steps is far above that rounding (~1e-15 per step) and far below
any real mistake (a missing average changes weights at the 1e-2 level).
"""

import functools
import os
import tempfile
import time
import warnings

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
B = 4        # per-rank batch
STEPS = 12   # optimizer steps per equivalence check
RTOL = 1e-9  # float64; see the module docstring
_seq = [0]


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


def fit(model, opt, x, y, batch, jit_compile=False, run_eagerly=False):
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile,
                  run_eagerly=run_eagerly)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def truth_fit(model, opt, x, y, batch):
    """One process's fit without kerasdist, a truth to compare with: run
    eagerly, since tracing a step costs more CPU than the few small steps
    it runs, and the weights agree with a traced fit's to well within the
    tolerances here."""
    return fit(model, opt, x, y, batch, run_eagerly=True)


def check_fit(label, make_opt, make_model=dense_model, xy=None, rtol=RTOL,
              **kd_args):
    """Distributed fit on my part == single-process fit on everything."""
    x, y = xy if xy is not None else data()
    truth = truth_fit(make_model(), make_opt(), x, y, SIZE * B)
    dist_opt = kd.DistributedOptimizer(make_opt(), **kd_args)
    got = fit(make_model(), dist_opt, my_part(x), my_part(y), B)
    close(got, truth, label, rtol=rtol)
    same_on_all_ranks(got, label)
    # The truth moved: a run that did not train would also be "equal".
    assert not np.allclose(flat(got), flat(make_model().get_weights()))
    return dist_opt, got


# ---- equivalence -----------------------------------------------------------


checks.group("equiv")
# The checks also in group "odd" run at np=3 as well (tests/parallel/
# test_optimizer.py): an odd number of ranks for the averages, the
# predivision, the sparse gathers and the groups. The others run at np=2.


@check("fit_sgd", groups=("equiv", "odd"))
def fit_sgd():
    check_fit("fit_sgd", lambda: keras.optimizers.SGD(0.1))


@check("fit_adam", groups=("equiv", "odd"))
def fit_adam():
    check_fit("fit_adam", lambda: keras.optimizers.Adam(0.01))


@check("fit_sgd_momentum")
def fit_sgd_momentum():
    check_fit("fit_sgd_momentum",
              lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))


@check("fit_rmsprop")
def fit_rmsprop():
    check_fit("fit_rmsprop", lambda: keras.optimizers.RMSprop(0.01))


@check("fit_adamw")
def fit_adamw():
    check_fit("fit_adamw",
              lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1))


@check("fit_loss_scale")
def fit_loss_scale():
    check_fit("fit_loss_scale", lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10))


@check("fit_predivide", groups=("equiv", "odd"))
def fit_predivide():
    # The runtime's prescale/postscale factors are TF float attributes
    # (32-bit): 1/f and f/size carry a relative error up to ~6e-8 unless
    # they are powers of two, hence rtol 1e-6 here.
    check_fit("fit_predivide", lambda: keras.optimizers.SGD(0.1),
              rtol=1e-6, gradient_predivide_factor=float(SIZE))


@check("fit_global_clipnorm")
def fit_global_clipnorm():
    check_fit("fit_global_clipnorm",
              lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5))


# Groups change how gradients travel, not the result: 1 group, 3 groups
# of 4 tensors (2+1+1), more groups than tensors.
@check("fit_num_groups_1", num_groups=1)
@check("fit_num_groups_3", groups=("equiv", "odd"), num_groups=3)
@check("fit_num_groups_100", num_groups=100)
def fit_num_groups(num_groups):
    check_fit(f"fit_num_groups={num_groups}",
              lambda: keras.optimizers.Adam(0.01), num_groups=num_groups)


def embed_data():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 10, size=(SIZE * B * STEPS, 2)).astype("int32")
    ys = rng.normal(size=(len(ids), 1))
    return ids, ys


# SGD updates the same with sparse or dense gradients. Adam does not
# (Keras's sparse Adam leaves untouched rows' moments alone), so Adam is
# checked with the sparse path only, against Keras's sparse truth.
@check("fit_embedding_sgd_sparse_as_dense_false", dense=False)
@check("fit_embedding_sgd_sparse_as_dense_true", dense=True)
def fit_embedding_sgd(dense):
    check_fit(f"fit_embedding_sgd_sparse_as_dense={dense}",
              lambda: keras.optimizers.SGD(0.5), embed_model,
              xy=embed_data(), sparse_as_dense=dense)


@check("fit_embedding_adam_sparse", groups=("equiv", "odd"))
def fit_embedding_adam_sparse():
    check_fit("fit_embedding_adam_sparse",
              lambda: keras.optimizers.Adam(0.05), embed_model,
              xy=embed_data())


# The sharded optimizer at np=3 (its checks at np=2 on every backend are in
# tests/workers/keras_backend_worker.py): shards of unequal real length,
# ranks whose shard of a small variable is all padding, in float64.
@check("shard_fit_sgd_momentum_np3", groups=("odd",))
def shard_fit_sgd_momentum_np3():
    check_fit("shard_fit_sgd_momentum_np3",
              lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              shard="optimizer_state")


@check("shard_fit_adam_np3", groups=("odd",))
def shard_fit_adam_np3():
    check_fit("shard_fit_adam_np3", lambda: keras.optimizers.Adam(0.05),
              shard="gradients")


@check("shard_fit_adamw_global_clipnorm_np3", groups=("odd",))
def shard_fit_adamw_global_clipnorm_np3():
    check_fit("shard_fit_adamw_global_clipnorm_np3",
              lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1,
                                             global_clipnorm=0.1),
              shard="gradients", overlap=True, bucket_bytes=32)


@check("shard_fit_embedding_np3", groups=("odd",))
def shard_fit_embedding_np3():
    check_fit("shard_fit_embedding_np3", lambda: keras.optimizers.SGD(0.5),
              embed_model, xy=embed_data(), shard="optimizer_state")


@check("shard_fit_adam_process_set_np3", groups=("odd",))
def shard_fit_adam_process_set_np3():
    """shard= over a process set of two of the three ranks: the shards are
    cut over the set's two ranks, which equal one process on the set's
    batch of 2 B; rank 2 only takes part in creating the set."""
    pair = kd.add_process_set([0, 1])
    try:
        if RANK > 1:
            return
        x, y = data()
        n = 2 * B * STEPS
        x, y = x[:n], y[:n]
        truth = truth_fit(dense_model(), keras.optimizers.Adam(0.05), x, y,
                          2 * B)
        opt = kd.DistributedOptimizer(keras.optimizers.Adam(0.05),
                                      shard="gradients", process_set=pair)
        mine = x.reshape(STEPS, 2, B, -1)[:, RANK].reshape(STEPS * B, -1)
        ys = y.reshape(STEPS, 2, B, -1)[:, RANK].reshape(STEPS * B, -1)
        got = fit(dense_model(), opt, mine, ys, B)
        close(got, truth, "shard_fit_adam_process_set_np3")
        assert not np.allclose(flat(got), flat(dense_model().get_weights()))
        both = kd.allgather(tf.constant(flat(got)[None, :]),
                            name="check.shard_process_set",
                            process_set=pair).numpy()
        assert np.array_equal(both[0], both[1]), "the pair's ranks differ"
        # The optimizer's variables hold half of each variable (padded).
        sizes = [int(np.prod(v.shape))
                 for v in opt.kerasdist_sharded_variables]
        whole, slots = sum(w.size for w in got), len(sizes) // len(got)
        assert sum(sizes) <= slots * (whole / 2 + len(got)), (sizes, whole)
    finally:
        kd.remove_process_set(pair)


# The sharded and the replicated optimizer average the same float32
# gradients (on CPU bit for bit; another summation order moves float32 by
# ~1e-7 a step). One process rounds its bfloat16 activations on another
# batch (8 significant bits; measured 7e-4 after 12 steps, weights of
# order 1 that move by ~1).
TOL_BF16 = 1e-5
TOL_BF16_ONE_PROCESS = 5e-3


@check("shard_fit_mixed_bfloat16_np3", groups=("odd",))
def shard_fit_mixed_bfloat16_np3():
    """The mixed_bfloat16 policy (float32 weights and gradients, bfloat16
    activations, no loss scaling) with shards of unequal real length.
    Against the replicated optimizer, which reduces the same float32
    gradients, and against one process on the concatenated batch: see
    TOL_BF16."""
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        x, y = data()
        got = fit(dense_model(), kd.DistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            shard="optimizer_state"), my_part(x), my_part(y), B)
        replicated = fit(dense_model(), kd.DistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9)), my_part(x),
            my_part(y), B)
        truth = fit(dense_model(), keras.optimizers.SGD(0.05, momentum=0.9),
                    x, y, SIZE * B)
    finally:
        keras.mixed_precision.set_dtype_policy(previous)
    assert all(w.dtype == np.float32 for w in got), [w.dtype for w in got]
    moved = np.max(np.abs(flat(truth) - flat(dense_model().get_weights())))
    print(f"mixed_bfloat16 np3: max diff against replicated "
          f"{np.max(np.abs(flat(got) - flat(replicated))):.2e}, against "
          f"one process {np.max(np.abs(flat(got) - flat(truth))):.2e}; "
          f"the truth moved {moved:.2e}", flush=True)
    close(got, replicated, "mixed_bfloat16 np3: against replicated",
          rtol=0, atol=TOL_BF16)
    close(got, truth, "mixed_bfloat16 np3: against one process", rtol=0,
          atol=TOL_BF16_ONE_PROCESS)
    same_on_all_ranks(got, "mixed_bfloat16 np3")
    assert moved > 100 * TOL_BF16_ONE_PROCESS, moved


@functools.cache
def uncompressed_ref():
    """The uncompressed weights fit_fp16 compares with (checked once)."""
    _, exact = check_fit("fit_uncompressed_ref",
                         lambda: keras.optimizers.SGD(0.1))
    return exact


@check("fit_uncompressed_ref")
def fit_uncompressed_ref():
    uncompressed_ref()


@check("fit_compression_fp16")
def fit_fp16():
    # fp16 on the wire: float16 has an 11-bit significand (relative rounding
    # 2**-11 ~ 5e-4 per gradient element); over 12 SGD steps of lr 0.1 the
    # weights, of order 1, may move by ~1e-3 from the float64 result.
    x, y = data()
    exact = uncompressed_ref()
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression=kd.Compression.fp16),
        my_part(x), my_part(y), B)
    close(got, exact, "fit_fp16", rtol=0, atol=2e-3)
    assert not np.array_equal(flat(got), flat(exact)), \
        "fp16 gave bit-identical weights: the gradients were not compressed"
    assert all(w.dtype == np.float64 for w in got)
    same_on_all_ranks(got, "fit_fp16")


@check("distributed_gradient_tape_eager", groups=("equiv", "odd"),
       mode="eager")
@check("distributed_gradient_tape_function", mode="function")
@check("distributed_gradient_tape_function_groups3", mode="function",
       num_groups=3)
def check_tape(mode, num_groups=0, bucket_bytes=None):
    x, y = data()
    truth = truth_fit(dense_model(), keras.optimizers.SGD(0.1), x, y,
                      SIZE * B)
    model = dense_model()
    opt = keras.optimizers.SGD(0.1)  # plain: the tape does the averaging
    xs, ys = my_part(x), my_part(y)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = kd.DistributedGradientTape(tape, num_groups=num_groups,
                                          bucket_bytes=bucket_bytes)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    if mode == "function":
        step = tf.function(step)
    for s in range(STEPS):
        step(tf.constant(xs[s * B:(s + 1) * B]),
             tf.constant(ys[s * B:(s + 1) * B]))
    what = f"tape_{mode}" + (f"_groups{num_groups}" if num_groups else "") \
        + (f"_buckets{bucket_bytes}" if bucket_bytes else "")
    close(model.get_weights(), truth, what)
    same_on_all_ranks(model.get_weights(), what)


# DistributedGradientTape in front of a sharded optimizer: the tape's
# gradients are averaged already, so the optimizer slices its shard of
# each (no reduce-scatter) and allgathers the weights; a gradient the loop
# changed is reduce-scattered as before. Counted on the real program: the
# collectives the step calls (a spy that passes each call on) eagerly, the
# collective ops in the traced graph in a tf.function.


class CountCalls:
    """Counts the calls of the TF collectives kerasdist's gradient code
    makes (the TF package's collectives module, which the Keras layer calls
    straight), each passed on to the real collective."""

    NAMES = ("grouped_allreduce", "reducescatter", "allgather")

    def __enter__(self):
        import kerasdist.tensorflow.collectives
        self.api = kerasdist.tensorflow.collectives
        self.real = {n: getattr(self.api, n) for n in self.NAMES}
        self.calls = dict.fromkeys(self.NAMES, 0)
        for n in self.NAMES:
            setattr(self.api, n, self._spy(n))
        return self.calls

    def _spy(self, name):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return self.real[name](*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for n in self.NAMES:
            setattr(self.api, n, self.real[n])


def collective_ops(fn, *specs):
    """{op type: count} of the kerasdist collective ops in `fn`'s traced
    graph, nested functions included."""
    graph_def = fn.get_concrete_function(*specs).graph.as_graph_def()
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    out = {}
    for node in nodes:
        if node.op.startswith("Kerasdist"):
            out[node.op] = out.get(node.op, 0) + 1
    return out


def tape_loop(opt, function, change=None, make_model=dense_model, xy=None,
              **tape_args):
    """STEPS steps of a custom loop on this rank's part: a
    DistributedGradientTape's gradients (passed through `change`) to
    `opt.apply`. Returns the weights and the step function."""
    x, y = xy if xy is not None else data()
    xs, ys = my_part(x), my_part(y)
    model = make_model()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            loss = opt.scale_loss(loss)  # a LossScaleOptimizer's scale
        tape = kd.DistributedGradientTape(tape, **tape_args)
        grads = tape.gradient(loss, model.trainable_variables)
        if change is not None:
            grads = change(grads)
        opt.apply(grads, model.trainable_variables)

    if function:
        step = tf.function(step)
    for s in range(STEPS):
        step(tf.constant(xs[s * B:(s + 1) * B]),
             tf.constant(ys[s * B:(s + 1) * B]))
    return model.get_weights(), step


STEP_SPECS = (tf.TensorSpec([B, 4], tf.float64),
              tf.TensorSpec([B, 1], tf.float64))


def momentum(lr=0.05):
    return keras.optimizers.SGD(lr, momentum=0.9)


@functools.cache
def momentum_truth(lr=0.05):
    """One process on the concatenated batches, SGD with momentum (fit
    once for the checks below)."""
    x, y = data()
    return fit(dense_model(), momentum(lr), x, y, SIZE * B)


def second_reductions(function, shard, change=None, loss_scale=False,
                      **loop_args):
    """(weights, reduce-scatters of the sharded optimizer, the tape's
    allreduces, allgathers) of a tape loop: eagerly calls of the
    collectives, in a tf.function ops of the graph. loss_scale: behind a
    LossScaleOptimizer (scale 16, exact in float64)."""
    opt = kd.DistributedOptimizer(momentum(), shard=shard)
    if loss_scale:
        opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=16.0)
    with CountCalls() as calls:
        got, step = tape_loop(opt, function, change, **loop_args)
    if function:
        ops = collective_ops(step, *STEP_SPECS)
        return (got, ops.get("KerasdistReducescatter", 0),
                ops.get("KerasdistGroupedAllreduce", 0),
                ops.get("KerasdistAllgather", 0))
    return (got, calls["reducescatter"], calls["grouped_allreduce"],
            calls["allgather"])


@check("shard_tape_eager", groups=("equiv",), function=False,
       shard="optimizer_state")
@check("shard_tape_function", groups=("equiv",), function=True,
       shard="gradients")
def shard_tape(function, shard):
    """The tape's gradients to a sharded optimizer: one process on the
    concatenated batch, and the replicated optimizer behind the same tape;
    no reduce-scatter, eagerly or traced, also behind a LossScaleOptimizer
    (a changed gradient is reduce-scattered, and still right)."""
    what = f"shard_tape_{tag_of(function)}"
    truth = momentum_truth()
    got, scatters, allreduces, gathers = second_reductions(function, shard)
    close(got, truth, f"{what}: against one process")
    same_on_all_ranks(got, what)
    # Eagerly one call a step; traced, one op in the graph.
    calls = 1 if function else STEPS
    assert (scatters, allreduces) == (0, calls), (scatters, allreduces)
    assert gathers >= calls, gathers
    replicated, _ = tape_loop(kd.DistributedOptimizer(momentum()), function)
    close(got, replicated, f"{what}: against replicated")
    changed, scatters, _, _ = second_reductions(
        function, shard, change=lambda grads: [g * 1.0 for g in grads])
    assert scatters >= calls, scatters
    close(changed, truth, f"{what}: changed gradients")
    assert not np.allclose(flat(got), flat(dense_model().get_weights()))
    # Unscaled by a LossScaleOptimizer, still the tape's: sliced.
    scaled, scatters, _, _ = second_reductions(function, shard,
                                               loss_scale=True)
    assert scatters == 0, scatters
    close(scaled, truth, f"{what}: behind a LossScaleOptimizer")


@check("shard_tape_sum_process_sets_refusal", groups=("equiv",))
def shard_tape_sum_process_sets_refusal():
    """The tape's op decides: Sum gives a step of SIZE times the average
    (the truth with SIZE times the learning rate), sliced all the same; an
    optimizer with op=Sum refuses the tape's gradients; a tape over
    another process set is reduced again (rank 1 is outside it, so it
    gets its own gradients back), with a warning on rank 0. An
    Embedding's gradient (a tf.IndexedSlices the tape allgathers) is
    sliced from its dense form."""
    sparse, scatters, _, _ = second_reductions(
        False, "gradients", make_model=embed_model, xy=embed_data())
    assert scatters == 0, scatters
    close(sparse, fit(embed_model(), momentum(), *embed_data(), SIZE * B),
          "tape Embedding")
    summed, scatters, _, _ = second_reductions(False, "optimizer_state",
                                               op=kd.Sum)
    assert scatters == 0, scatters
    close(summed, momentum_truth(0.05 * SIZE), "tape op=Sum")
    opt = kd.DistributedOptimizer(momentum(), shard="optimizer_state",
                                  op=kd.Sum)
    try:
        tape_loop(opt, False)
    except ValueError as e:
        assert "op=Average" in str(e) and "DistributedGradientTape" in \
            str(e), e
    else:
        raise AssertionError("op=Sum took the tape's gradients")
    first = kd.add_process_set([0])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, scatters, _, _ = second_reductions(
                False, "gradients", process_set=first)
        warned = [w for w in caught if "process_set" in str(w.message)]
        assert len(warned) == (1 if RANK == 0 else 0), \
            [str(w.message) for w in caught]
    finally:
        kd.remove_process_set(first)
    assert scatters == STEPS, scatters
    close(got, momentum_truth(), "tape over another process set")


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


checks.group("math")
BASE = np.array([1.0, -2.0, 2.0])
MEAN_R = (SIZE + 1) / 2  # mean of (r + 1) over ranks


def tag_of(function):
    return "function" if function else "eager"


@check("op_sum_eager", groups=("math", "odd"), function=False)
@check("op_sum_function", function=True)
def op_sum(function):
    # op=Sum and predivide.
    base, mean_r, tag = BASE, MEAN_R, tag_of(function)
    got = apply_steps(kd.DistributedOptimizer(
        keras.optimizers.SGD(1.0), op=kd.Sum),
        [base * (RANK + 1)], function)
    close(got[0], -base * SIZE * mean_r, f"sum_{tag}")


# backward_passes_per_step=2: local sum (or mean) of two gradients,
# averaged over ranks, applied once; the first step changes nothing.
@check("backward_passes_avg_false_eager", avg=False, function=False)
@check("backward_passes_avg_true_eager", groups=("math", "odd"), avg=True,
       function=False)
@check("backward_passes_avg_false_function", avg=False, function=True)
@check("backward_passes_avg_true_function", avg=True, function=True)
def backward_passes(avg, function):
    base, mean_r = BASE, MEAN_R
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


@check("backward_passes_survive_a_second_build")
def backward_passes_second_build():
    """A LossScaleOptimizer builds its inner optimizer again (the Trainer
    builds the inner one first): a partial accumulation survives it."""
    base, mean_r = BASE, MEAN_R
    inner = kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                    backward_passes_per_step=2)
    var = keras.Variable(np.zeros(3), name="bpps_rebuilt")
    inner.apply([tf.constant(base * (RANK + 1))], [var])  # builds; 1 of 2
    opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
    opt.build([var])  # builds `inner` a second time
    opt.apply([tf.constant(base * (RANK + 1) * 2 * 4.0)], [var])
    close(var.numpy(), -base * mean_r * (1 + 2), "bpps second build")
    assert int(inner.iterations.numpy()) == 1, inner.iterations


@check("num_groups_eager", function=False)
@check("num_groups_function", function=True)
def num_groups(function):
    # num_groups: two variables in two groups, eagerly (the group runs
    # as one function) and in a tf.function.
    base, mean_r, tag = BASE, MEAN_R, tag_of(function)
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), num_groups=2)
    va = keras.Variable(np.zeros(3), name="ga")
    vb = keras.Variable(np.zeros(2), name="gb")

    def gstep(a, b):
        opt.apply([a, b], [va, vb])

    if function:
        gstep = tf.function(gstep)
    for _ in range(2):
        gstep(tf.constant(base * (RANK + 1)),
              tf.constant([1.0, -1.0]) * (RANK + 1))
    close(va.numpy(), -2 * base * mean_r, f"groups a {tag}")
    close(vb.numpy(), -2 * np.array([1.0, -1.0]) * mean_r,
          f"groups b {tag}")


@check("clip_on_averaged_gradient_eager", groups=("math", "odd"),
       function=False)
@check("clip_on_averaged_gradient_function", function=True)
def clip_on_averaged_gradient(function):
    # Clipping acts on the averaged gradient. Rank r sends
    # small + (r - mean) * big: every local norm exceeds the clip
    # threshold (at np >= 2), the average is `small`, below it.
    base, mean_r, tag = BASE, MEAN_R, tag_of(function)
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


@check("loss_scale_outside_eager", function=False)
@check("loss_scale_outside_function", function=True)
def check_loss_scale_outside(function):
    """LossScaleOptimizer(DistributedOptimizer): ranks agree on finiteness.

    Step 0: only the last rank's gradient is infinite. Without agreement the
    other ranks would apply (and wait in the allreduce) while it skips; with
    it every rank skips the step and halves the scale. Step 1: all finite,
    every rank applies the average of the unscaled gradients.
    """
    tag = tag_of(function)
    inner = kd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=8.0)
    assert type(opt).__name__ == "LossScaleOptimizer"
    assert getattr(type(opt), "_kerasdist_synced", False), type(opt)
    var = keras.Variable(np.zeros(3), name="ls")
    base = np.array([1.0, -2.0, 2.0])

    def step(g):
        opt.apply([g], [var])

    if function:
        step = tf.function(step)
    bad = base * (np.inf if RANK == SIZE - 1 else 1.0)
    step(tf.constant(bad * 8.0))
    close(var.numpy(), np.zeros(3), f"loss scale skip {tag}")
    assert float(opt.dynamic_scale.numpy()) == 4.0, opt.dynamic_scale
    step(tf.constant(base * (RANK + 1) * 4.0))
    close(var.numpy(), -base * (SIZE + 1) / 2, f"loss scale apply {tag}")
    same_on_all_ranks([var.numpy(), opt.dynamic_scale.numpy()],
                      f"loss_scale_{tag}")


# ---- Keras integration -----------------------------------------------------


checks.group("keras")


# The bucket checks run at np=2 only (the keras group): one launch.
@check("fit_buckets")
def fit_buckets():
    # 8-byte buckets: every gradient its own grouped allreduce in fit's
    # train function (the graph path every Keras fit on TF takes).
    check_fit("fit_buckets", lambda: keras.optimizers.Adam(0.01),
              bucket_bytes=8)


@check("distributed_gradient_tape_function_buckets")
def tape_buckets():
    check_tape("function", bucket_bytes=8)


def grouped_ops(fn, *specs):
    """The KerasdistGroupedAllreduce ops of `fn`'s graph: each one's input
    dtypes."""
    graph = fn.get_concrete_function(*specs).graph
    return [[t.dtype.name for t in op.inputs] for op in graph.get_operations()
            if op.type == "KerasdistGroupedAllreduce"]


@check("buckets_in_graph")
def buckets_in_graph():
    """One grouped op per bucket in a tf.function, dtypes never mixed;
    one for all eagerly, with overlap off (argument or environment) and
    the num_groups of old; the update is the average every way."""
    va = keras.Variable(np.zeros(3), name="bva")                  # 24 B
    vb = keras.Variable(np.zeros(2), name="bvb")                  # 16 B
    vc = keras.Variable(np.zeros(2, np.float32), name="bvc")      # 8 B
    variables = [va, vb, vc]
    specs = [tf.TensorSpec([3], tf.float64), tf.TensorSpec([2], tf.float64),
             tf.TensorSpec([2], tf.float32)]
    grads = [tf.constant(BASE * (RANK + 1)),
             tf.constant([1.0, -1.0], tf.float64) * (RANK + 1),
             tf.constant([2.0, 4.0], tf.float32) * (RANK + 1)]
    want = [-BASE * MEAN_R, -np.array([1.0, -1.0]) * MEAN_R,
            -np.array([2.0, 4.0]) * MEAN_R]

    def run(opt, function=True):
        for v in variables:
            v.assign(np.zeros(v.shape))

        def step(a, b, c):
            opt.apply([a, b, c], variables)

        if function:
            step = tf.function(step)
        step(*grads)
        for v, w in zip(variables, want):
            close(v.numpy(), w, f"buckets {opt.name}")
        return grouped_ops(step, *specs) if function else None

    # Backprop order (the last variable first), 16-byte buckets: [vc]
    # (float32), [vb], [va] (24 bytes: alone).
    ops = run(kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                      bucket_bytes=16))
    assert sorted(ops) == [["float32"], ["float64"], ["float64"]], ops
    ops = run(kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                      bucket_bytes=64))
    assert sorted(ops) == [["float32"], ["float64", "float64"]], ops
    run(kd.DistributedOptimizer(keras.optimizers.SGD(1.0), bucket_bytes=16),
        function=False)
    ops = run(kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                      bucket_bytes=16, overlap=False))
    assert len(ops) == 1 and len(ops[0]) == 3, ops
    ops = run(kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                      bucket_bytes=16, num_groups=2))
    assert len(ops) == 2, ops
    os.environ["KERASDIST_OVERLAP"] = "0"
    try:
        off = kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                      bucket_bytes=16)
    finally:
        del os.environ["KERASDIST_OVERLAP"]
    ops = run(off)
    assert len(ops) == 1, ops
    os.environ["KERASDIST_BUCKET_BYTES"] = "16"
    try:
        env = kd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    finally:
        del os.environ["KERASDIST_BUCKET_BYTES"]
    assert len(run(env)) == 3
    # Adasum keeps one group (its result depends on what is reduced
    # together); only the graph is built.
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kd.Adasum,
                                  bucket_bytes=16)
    opt.build(variables)
    ops = grouped_ops(tf.function(lambda a, b, c: opt.apply([a, b, c],
                                                            variables)),
                      *specs)
    assert len(ops) == 1, ops
    for bad in (0, -1, 1.5, "1"):
        try:
            kd.DistributedOptimizer(keras.optimizers.SGD(), bucket_bytes=bad)
        except ValueError as e:
            assert "bucket_bytes" in str(e), e
        else:
            raise AssertionError(f"bucket_bytes={bad!r} accepted")


def trace_events(path, rows, steps):
    """The timeline's events once each of `rows` has `steps` NEGOTIATE
    and ALLREDUCE events (rank 0 writes it; its writer flushes at least
    once a second)."""
    import json
    import time
    deadline = time.monotonic() + 30
    while True:
        try:
            with open(path) as f:
                events = json.load(f)
            tid = {e["args"].get("tensor", e["args"]["name"]): e["tid"]
                   for e in events if e.get("name") == "thread_name"}
            count = {}
            for e in events:
                if e.get("ph") == "X":
                    key = (e["tid"], e["name"])
                    count[key] = count.get(key, 0) + 1
            if all(count.get((tid.get(r), p), 0) >= steps for r in rows
                   for p in ("NEGOTIATE", "ALLREDUCE")):
                return events, tid
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: {steps} steps of rows "
                                 f"{sorted(rows)} never appeared")
        time.sleep(0.05)


@check("overlap_timeline")
def overlap_timeline():
    """Communication overlaps backprop: in some step one bucket's
    ALLREDUCE has finished before any rank has even submitted another
    bucket, i.e. while every rank was still computing that bucket's
    gradients. A fact of order in rank 0's timeline (one clock), not a
    timing threshold: with one group for all gradients nothing is
    submitted before the last gradient exists. The backward pass waits
    0.3 s before the first layer's gradients, as a long backprop would,
    so that a loaded machine cannot make the other buckets' reduction
    outlast the rest of backprop."""
    rng = np.random.default_rng(5)

    @tf.custom_gradient
    def slow_backward(h):
        def grad(dy):
            def wait(t):
                time.sleep(0.3)
                return t
            out = tf.py_function(wait, [dy], dy.dtype)
            out.set_shape(dy.shape)
            return out
        return tf.identity(h), grad

    model = keras.Sequential([keras.Input((512,)),
                              keras.layers.Dense(512, activation="tanh"),
                              keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)
    x = tf.constant(rng.normal(size=(256, 512)) + RANK)
    y = tf.constant(rng.normal(size=(256, 1)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = slow_backward(model.layers[0](x, training=True))
            for layer in model.layers[1:]:
                h = layer(h, training=True)
            loss = tf.reduce_mean(tf.square(h - y))
        tape = kd.DistributedGradientTape(tape, name="ovl",
                                          bucket_bytes=64 * 1024)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    step()  # trace and warm up outside the timeline
    n = len(grouped_ops(step))
    assert n >= 3, n
    path = os.path.join(tempfile.gettempdir(), f"kd_ovl_{os.getppid()}.json")
    steps = 5
    kd.timeline.start_timeline(path)
    for _ in range(steps):
        step()
    kd.timeline.stop_timeline()
    if RANK != 0:
        return
    rows = [f"ovl.bucket{b}of{n}.0" for b in range(n)]
    events, tid = trace_events(path, rows, steps)
    os.unlink(path)

    def phases(row, name):
        return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("ph") == "X" and e["tid"] == tid[row]
                      and e["name"] == name)

    # Per step: the earliest end of a bucket's allreduce, and the latest
    # first report of a bucket (its NEGOTIATE starts at the first rank's).
    done = list(zip(*[[end for _, end in phases(r, "ALLREDUCE")][:steps]
                      for r in rows]))
    asked = list(zip(*[[ts for ts, _ in phases(r, "NEGOTIATE")][:steps]
                       for r in rows]))
    ahead = [max(a) - min(d) for d, a in zip(done, asked)]
    print(f"overlap: per step, a bucket reduced {ahead} us before the last "
          "bucket was first submitted", flush=True)
    assert max(ahead) > 0, (done, asked)


@functools.cache
def adam_pair():
    """(plain Adam, its DistributedOptimizer), shared by the checks below
    (save_load_model trains the wrapped one)."""
    orig = keras.optimizers.Adam(0.01, beta_1=0.8)
    return orig, kd.DistributedOptimizer(orig)


@check("distributed_optimizer_isinstance")
def is_instance():
    _, opt = adam_pair()
    assert isinstance(opt, keras.optimizers.Adam)
    assert type(opt) is not keras.optimizers.Adam


@check("get_config_round_trip")
def get_config_round_trip():
    orig, opt = adam_pair()
    cfg = opt.get_config()
    assert cfg == orig.get_config(), cfg
    plain = keras.optimizers.Adam.from_config(cfg)
    assert type(plain) is keras.optimizers.Adam
    again = type(opt).from_config(cfg)
    assert again._kerasdist_settings is opt._kerasdist_settings
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is keras.optimizers.Adam
    assert restored.get_config() == cfg


@check("double_wrap_error")
def double_wrap_error():
    _, opt = adam_pair()
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


@functools.cache
def saved_and_loaded():
    """Trains adam_pair's optimizer on a model, saves it to a .keras file
    and loads it back: (model, opt, loaded, x, y)."""
    _, opt = adam_pair()
    x, y = data()
    model = dense_model()
    fit(model, opt, my_part(x), my_part(y), B)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    return model, opt, loaded, x, y


@check("save_load_model")
def save_load_model():
    # Save and load: the file loads without kerasdist custom objects.
    model, opt, loaded, _, _ = saved_and_loaded()
    assert type(loaded.optimizer) is keras.optimizers.Adam
    close(loaded.get_weights(), model.get_weights(), "load weights", rtol=0,
          atol=0)
    assert int(loaded.optimizer.iterations) == STEPS
    close(flat(loaded.optimizer.variables[1:]), flat(opt.variables[1:]),
          "load slots", rtol=0, atol=0)


@check("wrap_built_optimizer")
def wrap_built_optimizer():
    # Wrapping a built optimizer keeps its state, and training continues.
    _, _, loaded, x, y = saved_and_loaded()
    rewrapped = kd.DistributedOptimizer(loaded.optimizer)
    assert int(rewrapped.iterations) == STEPS
    close(flat(rewrapped.variables), flat(loaded.optimizer.variables),
          "rewrap state", rtol=0, atol=0)
    loaded.compile(optimizer=rewrapped, loss="mse", jit_compile=False)
    loaded.fit(my_part(x)[:B], my_part(y)[:B], batch_size=B, verbose=0)
    assert int(rewrapped.iterations) == STEPS + 1
    same_on_all_ranks(loaded.get_weights(), "rewrap")


def kerasdist_warnings(caught):
    return [w for w in caught if "kerasdist: XLA was turned off"
            in str(w.message)]


@check("jit_compile")
def check_xla():
    """jit_compile=True on the CPU: the collectives have XLA kernels, so XLA
    stays on (no warning) and trains as one process on the whole batch; a
    custom step in tf.function(jit_compile=True) runs too. Where they have
    none (a GPU, a TF_XLA=0 build): XLA off with one warning, same
    training as without it, and the clear error for a custom step."""
    from kerasdist.tensorflow import _keras_layer
    why = _keras_layer.xla_unsupported()
    x, y = data()
    if why is None:
        print("XLA mode: kernels", flush=True)
        truth = truth_fit(dense_model(), keras.optimizers.SGD(0.1), x, y,
                          SIZE * B)
        model = dense_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fit(model, kd.DistributedOptimizer(
                keras.optimizers.SGD(0.1)), my_part(x), my_part(y), B,
                jit_compile=True)
        assert not kerasdist_warnings(caught), [str(w.message)
                                                for w in caught]
        assert model.jit_compile is True
        close(got, truth, "xla == one process", rtol=1e-5, atol=1e-8)
        same_on_all_ranks(got, "jit_compile_true")
        assert not np.allclose(flat(got), flat(dense_model().get_weights()))

        # A custom step compiled with XLA: the gradients are averaged.
        var = keras.Variable(np.zeros(3), name="xla_v")
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        step = tf.function(lambda g: opt.apply([g], [var]), jit_compile=True)
        step(tf.constant(np.ones(3) * (RANK + 1)))
        close(np.asarray(var), np.full(3, -0.1 * (SIZE + 1) / 2),
              "xla custom step")
        return
    print(f"XLA mode: off ({why})", flush=True)
    plain = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1)), my_part(x), my_part(y), B)
    model = dense_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fit(model, kd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  my_part(x), my_part(y), B, jit_compile=True)
        # A second fit on the same model does not warn again.
        model.fit(my_part(x)[:B], my_part(y)[:B], batch_size=B, verbose=0)
    mine = kerasdist_warnings(caught)
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "jit_compile=False" in str(mine[0].message), mine[0].message
    assert model.jit_compile is False
    close(got, plain, "xla off == no xla", rtol=0, atol=0)
    same_on_all_ranks(got, "jit_compile_true")
    print(f"XLA warning: {mine[0].message}", flush=True)

    # The same model compiled without kerasdist keeps XLA and no warning.
    ref = dense_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ref, keras.optimizers.SGD(0.1), x[:B], y[:B], B,
            jit_compile=True)
    assert not kerasdist_warnings(caught) and ref.jit_compile is True

    # A custom step compiled with XLA cannot be intercepted: clear error.
    var = keras.Variable(np.zeros(3), name="xla_v")
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    step = tf.function(lambda g: opt.apply([g], [var]), jit_compile=True)
    try:
        step(tf.constant(np.ones(3)))
    except RuntimeError as e:
        assert "cannot run inside an XLA-compiled function" in str(e), e
        assert "jit_compile=False" in str(e), e
        print("XLA message: " + " ".join(str(e).split()), flush=True)
    else:
        raise AssertionError("an XLA-compiled apply ran without an error")


@check("shard_jit_compile")
def check_shard_xla():
    """A sharded optimizer in a model compiled with jit_compile=True: on the
    CPU its reducescatter and allgather compile, XLA stays on and it trains
    as one process on the whole batch. Where those two have no XLA kernel
    (a GPU today, where the grouped allreduce has one): XLA off with one
    warning naming the sharded optimizer, and the same training."""
    from kerasdist.tensorflow import _keras_layer
    x, y = data()
    truth = truth_fit(dense_model(), keras.optimizers.Adam(0.05), x, y,
                      SIZE * B)

    def fit_xla(rows, **kd_args):
        """(model, weights, kerasdist's XLA warnings) of a fit on `rows`
        of my part with jit_compile=True."""
        model = dense_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fit(model, kd.DistributedOptimizer(
                keras.optimizers.Adam(0.05), **kd_args),
                my_part(x)[:rows], my_part(y)[:rows], B, jit_compile=True)
        return model, got, kerasdist_warnings(caught)

    if _keras_layer.xla_unsupported("reducescatter") is None:
        model, got, said = fit_xla(len(x), shard="gradients")
        assert not said, [str(w.message) for w in said]
        assert model.jit_compile is True
        close(got, truth, "shard xla == one process", rtol=1e-5, atol=1e-8)
        same_on_all_ranks(got, "shard_jit_compile")
    # What a GPU says today: the grouped allreduce compiles, the sharded
    # optimizer's reducescatter and allgather do not.
    real = _keras_layer.xla_unsupported
    _keras_layer.xla_unsupported = lambda collective=None: (
        "for GPUs yet" if collective in ("reducescatter", "allgather")
        else None)
    try:
        model, got, said = fit_xla(len(x), shard="optimizer_state")
        assert len(said) == 1, [str(w.message) for w in said]
        assert "shard='optimizer_state'" in str(said[0].message), said[0]
        assert model.jit_compile is False
        # A replicated optimizer keeps XLA there.
        plain, _, said = fit_xla(B)
        assert not said and plain.jit_compile is True
    finally:
        _keras_layer.xla_unsupported = real
    close(got, truth, "shard, xla off == one process", rtol=1e-5, atol=1e-8)
    same_on_all_ranks(got, "shard_jit_compile_off")


@check("trainer_jit_compile")
def check_trainer_xla():
    """kerasdist.Trainer(jit_compile=True): where the collectives have XLA
    kernels, XLA stays on, nothing is said, and an unshuffled epoch trains
    as one process on the concatenated batches (rank r takes examples r,
    r + size, ..., so a step's ranks hold one global batch between them).
    Elsewhere XLA goes off with the optimizer's one warning, same result.
    rtol 1e-5: XLA may fuse and reorder the float64 arithmetic."""
    from kerasdist.tensorflow import _keras_layer
    why = _keras_layer.xla_unsupported()
    x, y = data()

    class Linear(kd.Trainer):
        def build_model(self):
            return dense_model()

        def train_data(self):
            return x, y

        def build_optimizer(self, learning_rate):
            return keras.optimizers.SGD(learning_rate)

        def build_loss(self):
            return "mse"

        def build_metrics(self):
            return []

    truth = truth_fit(dense_model(), keras.optimizers.SGD(0.1), x, y,
                      SIZE * B)
    trainer = Linear(epochs=1, batch_size=B, learning_rate=0.1,
                     scale_lr=False, shuffle=False, verbose=0,
                     jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    said = kerasdist_warnings(caught)
    got = trainer.model.get_weights()
    close(got, truth, "Trainer(jit_compile=True) == one process", rtol=1e-5,
          atol=1e-8)
    same_on_all_ranks(got, "trainer_jit_compile")
    assert not np.allclose(flat(got), flat(dense_model().get_weights()))
    if why is None:
        assert trainer.model.jit_compile is True
        assert not said, [str(w.message) for w in said]
    else:
        assert trainer.model.jit_compile is False
        assert len(said) == 1, [str(w.message) for w in said]


@check("jit_compile_auto")
def check_xla_auto():
    """jit_compile="auto": no warning on a CPU-only machine (it resolves to
    no XLA there), and the same training."""
    if tf.config.list_physical_devices("GPU"):
        return
    x, y = data()
    plain = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1)), my_part(x), my_part(y), B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fit(dense_model(), kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1)), my_part(x), my_part(y), B,
            jit_compile="auto")
    assert not kerasdist_warnings(caught)
    close(got, plain, "auto", rtol=0, atol=0)


@check("fit_mixed_float16")
def check_mixed_float16():
    """Keras wraps the DistributedOptimizer in its own LossScaleOptimizer
    under mixed_float16; the wrapper's finiteness check is rank-agreed and
    training keeps the ranks identical."""
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        x, y = data()
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1, dtype="float32")])
        rng = np.random.default_rng(4)
        model.set_weights([rng.normal(size=w.shape) * 0.5
                           for w in model.get_weights()])
        inner = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
        model.compile(optimizer=inner, loss="mse", jit_compile=False)
        opt = model.optimizer
        assert isinstance(opt, keras.optimizers.LossScaleOptimizer), opt
        assert getattr(type(opt), "_kerasdist_synced", False), type(opt)
        before = flat(model.get_weights())
        model.fit(my_part(x).astype("float32"), my_part(y).astype("float32"),
                  batch_size=B, epochs=1, shuffle=False, verbose=0)
        after = model.get_weights()
        assert not np.allclose(flat(after), before)
        same_on_all_ranks(after + [opt.dynamic_scale.numpy()],
                          "mixed_float16")
        assert opt.get_config()["inner_optimizer"]["class_name"] == "SGD"
    finally:
        keras.mixed_precision.set_dtype_policy(previous)


@check("bad_args")
def bad_args():
    try:
        kd.DistributedOptimizer(keras.optimizers.SGD(), op=kd.Max)
    except ValueError as e:
        assert "op must be" in str(e), e
    else:
        raise AssertionError("op=Max accepted")
    try:
        kd.DistributedGradientTape(tf.GradientTape(), num_groups=-1)
    except ValueError as e:
        assert "num_groups must be an int >= 0" in str(e), e
    else:
        raise AssertionError("tape num_groups=-1 accepted")


checks.group("np1", default=False)


@check("np1_fit_equals_keras")
def np1_fit_equals_keras():
    """At np=1 training equals Keras."""
    assert SIZE == 1, "group np1 runs at np=1"
    x, y = data()
    truth = fit(dense_model(), keras.optimizers.Adam(0.01), x, y, B)
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01)), x, y, B)
    close(got, truth, "np1 fit", rtol=0, atol=0)


@check("np1_no_collectives")
def np1_no_collectives():
    """At np=1 no collective op is created."""
    assert SIZE == 1, "group np1 runs at np=1"
    var = keras.Variable(np.zeros(3), name="np1")
    for kw in ({}, {"num_groups": 2}, {"op": kd.Sum},
               {"gradient_predivide_factor": 2.0}):
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), **kw)
        lso = keras.optimizers.LossScaleOptimizer(
            kd.DistributedOptimizer(keras.optimizers.SGD(1.0)))
        for o in (opt, lso):
            fn = tf.function(lambda g, o=o: o.apply([g], [var]))
            graph = fn.get_concrete_function(
                tf.TensorSpec([3], tf.float64)).graph
            kinds = {op.type for op in graph.get_operations()}
            assert not any(k.startswith("Kerasdist") for k in kinds), kinds
    # fp16 compression still rounds at np=1.
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                  compression=kd.Compression.fp16)
    var.assign(np.zeros(3))
    opt.apply([tf.constant([1.0 / 3.0, 0.0, 0.0], tf.float64)], [var])
    assert var.numpy()[0] == -float(np.float16(1.0 / 3.0)), var.numpy()


if __name__ == "__main__":
    checks.main(rank=RANK)
