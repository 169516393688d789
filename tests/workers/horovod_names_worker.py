"""Horovod's names that kerasdist adds for drop-in scripts, on the Keras
backend that KERAS_BACKEND names (tensorflow, jax or torch), under
`kerasdist run -np N` (N >= 2):

    KERAS_BACKEND=jax python -m kerasdist.run -np 2 python \
        tests/workers/horovod_names_worker.py DIR [--only CHECK,...]

Named checks (tests/support/checks.py), grouped by the backends they run
on; a failure raises (non-zero exit). Truths are independent of the name
under test: numpy on values every rank can compute for every rank, the
ungrouped collective for a grouped one, the plain Keras optimizer's update
for the partial ones, an uninterrupted fit for `load_model`.
"""

import os
import sys

import keras
import numpy as np

import kerasdist as kd
from tests.support import checks
from tests.support.checks import check

BACKEND = keras.backend.backend()
kd.init()
R, N = kd.rank(), kd.size()
DIR = sys.argv[1]

if BACKEND == "tensorflow":
    import tensorflow as tf
elif BACKEND == "jax":
    import jax
    import jax.numpy as jnp
else:
    import torch


def np_of(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def expect(got, want, what, tol=0.0):
    got, want = np_of(got), np.asarray(want)
    if got.shape != want.shape or not np.allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=tol,
            atol=tol):
        raise AssertionError(f"{BACKEND} {what}: got {got!r}, want {want!r}")


def raises(error, needle, fn, what):
    try:
        fn()
    except error as e:
        assert needle in str(e), f"{what}: {e}"
    else:
        raise AssertionError(f"{what}: no {error.__name__}")


def grad_of(loss, x):
    """d loss / d x at numpy `x` on this backend, as numpy."""
    if BACKEND == "tensorflow":
        v = tf.Variable(x)
        with tf.GradientTape() as tape:
            y = loss(v)
        return tape.gradient(y, v).numpy()
    if BACKEND == "jax":
        return np.asarray(jax.grad(loss)(jnp.asarray(x)))
    t = torch.tensor(x, requires_grad=True)
    loss(t).backward()
    return t.grad.numpy()


def rows(k, count=None):
    """Rank k's allgather input: k + 1 rows of 3 (or `count` rows)."""
    count = k + 1 if count is None else count
    return (np.arange(count * 3, dtype=np.float32).reshape(count, 3)
            + 10 * k)


checks.group("tensorflow", "jax", "torch")


# ---- build and job probes ----------------------------------------------------


@check("ccl_built_ddl_built_gloo_built_gloo_enabled")
def ccl_ddl_gloo():
    # kerasdist has none of these backends (its build info names none).
    info = kd.build_info()
    for probe, key in ((kd.ccl_built, "ccl"), (kd.ddl_built, "ddl"),
                       (kd.gloo_built, "gloo")):
        assert probe() is False and key not in info, (probe, info)
    assert kd.gloo_enabled() is False


@check("cuda_built_rocm_built")
def cuda_rocm():
    # The one GPU backend is NCCL on CUDA: built exactly when NCCL is.
    gpu = kd.build_info().get("gpu_backend", "")
    assert kd.cuda_built() is kd.nccl_built(), (gpu, kd.nccl_built())
    assert kd.cuda_built() is ("CUDA" in gpu)
    assert kd.rocm_built() is False


@check("mpi_enabled_mpi_threads_supported")
def mpi_enabled_threads():
    assert kd.mpi_enabled() is True
    # The core starts MPI with MPI_THREAD_MULTIPLE (MPICH grants it).
    assert kd.mpi_threads_supported() is True


@check("adasum_is_horovods")
def adasum_is_horovods():
    # Horovod's number (2), and a reduction every collective takes: the
    # Adasum of identical gradients is that gradient (tests/workers/
    # adasum_worker.py checks the arithmetic).
    assert kd.Adasum == 2
    x = keras.ops.convert_to_tensor(np.full(3, 0.5, np.float32))
    expect(kd.allreduce(x, op=kd.Adasum), np.full(3, 0.5, np.float32),
           "allreduce(op=Adasum)")
    expect(kd.grouped_allreduce([x], op=kd.Adasum)[0],
           np.full(3, 0.5, np.float32), "grouped_allreduce(op=Adasum)")


@check("_executing_eagerly_util")
def executing_eagerly():
    assert kd._executing_eagerly() is True
    assert kd.util._executing_eagerly is kd._executing_eagerly
    if BACKEND == "tensorflow":
        seen = []

        @tf.function
        def traced():
            seen.append(kd._executing_eagerly())
            return tf.constant(0)

        traced()
        assert seen == [False], seen


@check("is_homogeneous")
def is_homogeneous():
    sizes = kd.allgather_object(kd.local_size(), name="test.local_sizes")
    assert kd.is_homogeneous() is (len(set(sizes)) == 1), sizes
    # `kerasdist run -np N` on one machine: one host of N ranks.
    assert sizes == [N] * N and kd.is_homogeneous() is True, sizes


@check("rank_op_local_rank_op_size_op_local_size_op")
def topology_ops():
    pairs = ((kd.rank_op, R), (kd.local_rank_op, kd.local_rank()),
             (kd.size_op, N), (kd.local_size_op, kd.local_size()))
    for op, want in pairs:
        got = op()
        assert np_of(got).dtype == np.int32, (op, got)
        expect(got, np.int32(want), op.__name__)
    expect(kd.size_op(0, name="size"), np.int32(N), "size_op(0)")
    raises(ValueError, "process set 1 does not exist", lambda: kd.size_op(1),
           "size_op(1)")
    raises(TypeError, "name", lambda: kd.rank_op(name=3), "rank_op(name=3)")
    if BACKEND == "tensorflow":
        @tf.function
        def ops():
            return [op() for op, _ in pairs]

        for got, (op, want) in zip(ops(), pairs):
            expect(got, np.int32(want), f"{op.__name__} in tf.function")
        # A TF1 graph reads the value when the session runs it.
        with tf.Graph().as_default():
            graph_ops = [op(name=f"q{i}") for i, (op, _) in enumerate(pairs)]
            with tf.compat.v1.Session() as session:
                got = session.run(graph_ops)
        for g, (op, want) in zip(got, pairs):
            expect(g, np.int32(want), f"{op.__name__} in a graph")
    if BACKEND == "jax":
        got = jax.jit(lambda: [op() for op, _ in pairs])()
        for g, (op, want) in zip(got, pairs):
            expect(g, np.int32(want), f"{op.__name__} in jax.jit")


# ---- Python objects ----------------------------------------------------------


def obj(k):
    """Rank k's object: sizes differ per rank, a lambda needs cloudpickle."""
    return {"rank": k, "data": np.arange(100 * k + 1) * 0.5,
            "name": "r" * (k + 3), "scale": lambda x, k=k: x * (k + 2)}


def same_obj(got, k, what):
    want = obj(k)
    assert got["rank"] == k and got["name"] == want["name"], (what, got)
    np.testing.assert_array_equal(got["data"], want["data"], err_msg=what)
    assert got["scale"](3) == want["scale"](3), what


@check("broadcast_object")
def broadcast_object():
    for root in range(N):
        got = kd.broadcast_object(obj(R) if R == root else None,
                                  root_rank=root)
        same_obj(got, root, f"broadcast_object root {root}")
    mine = obj(R)
    got = kd.broadcast_object(mine, 0, name="test.obj")
    if R == 0:
        assert got is mine  # the root keeps its own object, as Horovod's
    else:
        same_obj(got, 0, "broadcast_object named")
    raises(ValueError, "root_rank", lambda: kd.broadcast_object(1, N),
           "broadcast_object root N")


@check("broadcast_object_fn")
def broadcast_object_fn():
    bcast = kd.broadcast_object_fn(root_rank=N - 1)
    for step in range(3):  # made once, called as often as needed
        got = bcast({"step": step, "rank": R, "big": "x" * (R * 1000)})
        assert got == {"step": step, "rank": N - 1,
                       "big": "x" * ((N - 1) * 1000)}, got
    named = kd.broadcast_object_fn(0, name="test.fn")
    assert named([R]) == [0]


@check("allgather_object")
def allgather_object():
    got = kd.allgather_object(obj(R))
    assert len(got) == N, got
    for k, g in enumerate(got):
        same_obj(g, k, f"allgather_object entry {k}")
    assert kd.allgather_object(None, name="test.none") == [None] * N


# ---- grouped allgather and reducescatter -------------------------------------


@check("grouped_allgather")
def grouped_allgather():
    ints = np.full([R + 2], R, np.int32)
    got = kd.grouped_allgather([rows(R), ints, rows(R, count=0)],
                               name="test.gag")
    assert len(got) == 3
    expect(got[0], np.concatenate([rows(k) for k in range(N)]), "member 0")
    expect(got[1], np.concatenate([np.full([k + 2], k, np.int32)
                                   for k in range(N)]), "member 1")
    expect(got[2], np.zeros([0, 3], np.float32), "member 2 (no rows)")
    assert kd.grouped_allgather([]) == []
    raises(TypeError, "list", lambda: kd.grouped_allgather(rows(R)),
           "grouped_allgather(tensor)")
    # Unnamed, then gradients: the group's are the ungrouped ones'.
    expect(kd.grouped_allgather([rows(R)])[0],
           np.concatenate([rows(k) for k in range(N)]), "unnamed")
    x = rows(R)
    grouped = grad_of(lambda t: keras.ops.sum(
        kd.grouped_allgather([t * (R + 1), t], name="test.gag.g")[0] ** 2)
        + 3.0 * keras.ops.sum(kd.grouped_allgather(
            [t], name="test.gag.g2")[0]), x)
    alone = grad_of(lambda t: keras.ops.sum(
        kd.allgather(t * (R + 1), name="test.ag.g") ** 2)
        + 3.0 * keras.ops.sum(kd.allgather(t, name="test.ag.g2")), x)
    expect(grouped, alone, "grouped_allgather gradient", 1e-6)


@check("grouped_reducescatter")
def grouped_reducescatter():
    def member(k, i):
        return (np.arange((2 * N + i) * 2, dtype=np.float32)
                .reshape(2 * N + i, 2) + k * (i + 1))
    total = [sum(member(k, i) for k in range(N)) for i in range(2)]

    def mine(t, i):
        counts = [t.shape[0] // N + (k < t.shape[0] % N) for k in range(N)]
        start = sum(counts[:R])
        return t[start:start + counts[R]]

    got = kd.grouped_reducescatter([member(R, 0), member(R, 1)], op=kd.Sum,
                                   name="test.grs")
    for i in range(2):
        expect(got[i], mine(total[i], i), f"sum member {i}")
    got = kd.grouped_reducescatter([member(R, 0), member(R, 1)],
                                   name="test.grs.avg", prescale_factor=2.0,
                                   postscale_factor=0.25)
    for i in range(2):
        expect(got[i], mine(total[i], i) * 0.5 / N, f"average member {i}",
               1e-5)
    assert kd.grouped_reducescatter([], op=kd.Sum) == []
    raises(ValueError, "op", lambda: kd.grouped_reducescatter(
        [member(R, 0)], op=99), "grouped_reducescatter(op=99)")
    x = member(R, 0)

    def weighted(t):
        weights = keras.ops.convert_to_tensor(np.arange(1, 3) * (R + 1.0),
                                              "float32")
        return keras.ops.sum(keras.ops.multiply(t, weights))

    grouped = grad_of(lambda t: weighted(kd.grouped_reducescatter(
        [t, t * 2.0], name="test.grs.g")[1]), x)
    alone = grad_of(lambda t: weighted(kd.reducescatter(
        t * 2.0, name="test.rs.g")), x)
    expect(grouped, alone, "grouped_reducescatter gradient", 1e-6)


# ---- in-place broadcast ------------------------------------------------------


@check("broadcast__in_place")
def broadcast_in_place():
    a = keras.Variable(np.full([3], R, np.float32))
    b = keras.Variable(np.arange(4, dtype=np.float32) * (R + 1))
    values = kd.broadcast_([a, b], root_rank=N - 1, name="test.bi")
    expect(a, np.full([3], N - 1, np.float32), "variable a")
    expect(b, np.arange(4, dtype=np.float32) * N, "variable b")
    expect(values[1], np.arange(4, dtype=np.float32) * N, "returned b")
    raises(TypeError, "variables", lambda: kd.broadcast_(
        [np.ones(2)], 0), "broadcast_(array)")
    raises(ValueError, "root_rank", lambda: kd.broadcast_([a], -1),
           "broadcast_(root -1)")
    if BACKEND == "tensorflow":
        v = tf.Variable(np.full([2], R + 5.0))

        @tf.function
        def in_function():
            return kd.broadcast_([v], 0)

        expect(in_function()[0], np.full([2], 5.0), "returned in tf.function")
        expect(v, np.full([2], 5.0), "tf.Variable in tf.function")


# ---- DistributedOptimizer's local variables ----------------------------------


def dense(seed, units=2, inputs=3):
    layer = keras.layers.Dense(units)
    layer.build((None, inputs))
    rng = np.random.default_rng(seed)
    for w in layer.weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    return layer


def grads_for(variables, k):
    return [np.full(v.shape, float(k + 1 + i), np.float32)
            for i, v in enumerate(variables)]


@check("partial_distributed_optimizer_register_local_var")
def partial_optimizer():
    for scale in (True, False):
        shared, local = dense(1), dense(2)
        extra = keras.Variable(np.zeros([2], np.float32))
        variables = shared.trainable_weights + local.trainable_weights + [
            extra]
        before = [np_of(v) for v in variables]
        opt = kd.PartialDistributedOptimizer(
            keras.optimizers.SGD(1.0), local_layers=[local],
            scale_local_gradients=scale, name=f"test.pdo.{scale}")
        opt.register_local_var(extra)
        opt.build(variables)
        opt.apply([keras.ops.convert_to_tensor(g)
                   for g in grads_for(variables, R)], variables)
        # Truth: SGD(1) by the average over ranks for the shared layer, by
        # this rank's own gradient (divided by N if scaled) for the rest.
        every = [grads_for(variables, k) for k in range(N)]
        for i, v in enumerate(variables):
            if i < 2:
                step = np.mean([g[i] for g in every], 0)
            else:
                step = every[R][i] / (N if scale else 1)
            expect(v, before[i] - step, f"scale={scale} variable {i}", 1e-6)
    raises(ValueError, "keras.layers.Layer",
           lambda: kd.PartialDistributedOptimizer(
               keras.optimizers.SGD(1.0), local_layers=[extra]),
           "local_layers of a variable")
    raises(TypeError, "variable", lambda: opt.register_local_var(3),
           "register_local_var(3)")


@check("partial_distributed_optimizer_fit")
def partial_optimizer_fit():
    """model.fit (on JAX the jitted stateless step): the shared layer ends
    the same on every rank, the local head differs (rank-dependent data)."""
    head = keras.layers.Dense(1, name="head")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              head])
    model.set_weights([np.full(w.shape, 0.1, "float32")
                       for w in model.get_weights()])
    rng = np.random.default_rng(R)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32") * (R + 1)
    model.compile(kd.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=head), "mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    table = kd.allgather_object([np_of(w) for w in model.weights],
                                name="test.pdo.fit")
    for i in range(2):  # the shared Dense's kernel and bias
        np.testing.assert_array_equal(table[0][i], table[-1][i])
    assert not np.array_equal(table[0][2], table[-1][2]), "head not local"


# ---- BroadcastGlobalVariablesCallback(local_variables=...) -------------------


@check("broadcast_global_variables_callback_local_variables")
def callback_local_variables():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(1)])
    model.set_weights([np.full(w.shape, R + 1.0, "float32")
                       for w in model.get_weights()])
    local = model.layers[-1].kernel
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.0)), "mse")
    x = np.ones((8, 4), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[
        kd.callbacks.BroadcastGlobalVariablesCallback(
            0, verify=True, local_variables=local)])
    for w, v in zip(model.get_weights(), model.weights):
        want = R + 1.0 if v is local else 1.0  # lr 0: as broadcast
        np.testing.assert_array_equal(w, np.full(w.shape, want, "float32"))
    raises(ValueError, "local variables",
           lambda: kd.callbacks.BroadcastGlobalVariablesCallback(
               0, local_variables=[np.ones(2)]), "local_variables=[array]")


# ---- load_model --------------------------------------------------------------


@check("load_model")
def load_model():
    """A model saved after 1 epoch and loaded with kd.load_model trains its
    2nd epoch exactly as the uninterrupted model does: weights, optimizer
    state, averaging."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(8 * N, 4)).astype("float32")
    y = rng.normal(size=(8 * N, 1)).astype("float32")
    mine = slice(8 * R, 8 * R + 8)  # rank-dependent: averaging matters

    def fit(model):
        model.fit(x[mine], y[mine], batch_size=4, epochs=1, shuffle=False,
                  verbose=0)

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(1)])
    model.set_weights([np.full(w.shape, 0.2, "float32")
                       for w in model.get_weights()])
    model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  "mse", metrics=["mae"])
    fit(model)
    path = os.path.join(DIR, f"{BACKEND}.keras")
    if R == 0:
        model.save(path)
    kd.barrier(name="test.saved")
    loaded = kd.load_model(path)
    opt = loaded.optimizer
    assert getattr(opt, "_kerasdist_settings", None) is not None, opt
    assert isinstance(opt, keras.optimizers.Adam), type(opt)
    assert int(np_of(opt.iterations)) == 2, np_of(opt.iterations)
    for a, b in zip(opt.variables, model.optimizer.variables):
        expect(a, np_of(b), f"optimizer variable {b.name}")
    fit(model)
    fit(loaded)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        expect(a, b, "weights after the resumed epoch", 1e-6)
    raises(TypeError, "Optimizer subclasses", lambda: kd.load_model(
        path, custom_optimizers=["adam"]), "custom_optimizers=['adam']")


# ---- names that only TensorFlow graphs have ----------------------------------


@check("broadcast_global_variables_needs_a_graph", groups=("jax", "torch"))
def broadcast_global_variables_elsewhere():
    raises(RuntimeError, "broadcast_variables",
           lambda: kd.broadcast_global_variables(0),
           "broadcast_global_variables on " + BACKEND)


checks.group("tensorflow")


@check("broadcast_global_variables")
def broadcast_global_variables():
    raises(RuntimeError, "does not support eager execution",
           lambda: kd.broadcast_global_variables(0), "eagerly")
    with tf.Graph().as_default():
        a = tf.Variable(np.full([3], R, np.float32))
        b = tf.Variable(np.arange(2.0) * (R + 1))
        bcast = kd.broadcast_global_variables(N - 1)
        assert isinstance(bcast, tf.Operation), bcast
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(bcast)
            got_a, got_b = session.run([a, b])
    expect(got_a, np.full([3], N - 1, np.float32), "global a")
    expect(got_b, np.arange(2.0) * N, "global b")
    raises(ValueError, "root_rank",
           lambda: kd.broadcast_global_variables(N), "root N")


@check("partial_distributed_gradient_tape_register_local_source")
def partial_tape():
    for scale in (True, False):
        shared = tf.Variable(np.arange(3.0))
        local = keras.layers.Dense(1, use_bias=False)
        local.build((None, 2))
        local.kernel.assign(np.ones((2, 1)))
        extra = tf.Variable(np.ones(2))
        with tf.GradientTape() as tape:
            loss = (tf.reduce_sum(shared * (R + 1.0))
                    + (R + 2.0) * tf.reduce_sum(
                        tf.cast(local.kernel, tf.float64))
                    + (R + 3.0) * tf.reduce_sum(extra))
        tape = kd.PartialDistributedGradientTape(
            tape, local_layers=[local], scale_local_gradients=scale)
        tape.register_local_source(extra)
        g_shared, g_local, g_extra = tape.gradient(
            loss, [shared, local.kernel, extra])
        div = N if scale else 1
        expect(g_shared, np.full(3, np.mean(np.arange(1.0, N + 1))),
               f"shared scale={scale}", 1e-12)
        expect(g_local, np.full((2, 1), (R + 2.0) / div),
               f"local layer scale={scale}", 1e-6)
        expect(g_extra, np.full(2, (R + 3.0) / div),
               f"local source scale={scale}", 1e-12)
    raises(ValueError, "keras.layers.Layer",
           lambda: kd.PartialDistributedGradientTape(
               tf.GradientTape(), local_layers=[shared]), "local_layers")


if __name__ == "__main__":
    checks.main(rank=R)
