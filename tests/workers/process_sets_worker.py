"""Process sets against numpy at -np 3: the sets {0,2}, {1} and {0,1,2}.

    process_sets_worker.py [--group tf|frontends] [--only CHECK,...]

Group "tf" (default): every collective on a set gives the numpy result of
that set's members only (TF ops, eagerly and in a tf.function), sets
negotiated independently (different orders on different ranks), errors
naming the set, adding and removing sets at run time, the process ops,
objects, and DistributedOptimizer(process_set=) against one process
training on the set's concatenated batches. Group "frontends": JAX
(eager and inside jax.jit) and PyTorch collectives on a set.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from tests.support import checks  # noqa: E402
from tests.support.checks import check  # noqa: E402

kd.init(process_sets=[kd.ProcessSet([0, 2]), kd.ProcessSet([1])])
RANK, SIZE = kd.rank(), kd.size()
assert SIZE == 3, "run at -np 3"
EVEN = kd.ProcessSet([0, 2])
ODD = kd.ProcessSet([1])
# init's objects got ids 1 and 2; look them up again by their ranks.
EVEN.process_set_id, ODD.process_set_id = 1, 2
ALL = kd.global_process_set
SETS = [EVEN, ODD, ALL]


def mine():
    """The sets this rank is in."""
    return [s for s in SETS if RANK in s.ranks]


def data(rank, shape, dtype, salt=0):
    n = int(np.prod(shape))
    return ((np.arange(n) % 5 + rank * 3 + salt) % 11).reshape(shape).astype(
        dtype)


def expect(got, want, what, tol=0.0):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.allclose(got.astype(np.float64), want.astype(np.float64),
                       rtol=tol, atol=tol), (
        f"{what}: got {got.ravel()[:6]}, want {want.ravel()[:6]}")


def expect_error(fn, *needles):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (TF and core errors alike)
        text = str(e)
        missing = [n for n in needles if n not in text]
        assert not missing, f"error lacks {missing}: {text}"
        return text
    raise AssertionError(f"no error (wanted {needles})")


checks.group("tf")


@check("global_process_set_and_sizes")
def global_process_set_and_sizes():
    assert EVEN.size() == 2 and ODD.size() == 1 and ALL.size() == 3
    assert EVEN.included() == (RANK in (0, 2))
    assert EVEN.rank() == {0: 0, 1: -1, 2: 1}[RANK]
    assert ALL.rank() == RANK
    import tensorflow as tf  # noqa: F401

    import kerasdist.tensorflow as kdt
    assert int(kdt.size_op(process_set_id=1)) == 2
    if RANK in (0, 2):
        assert int(kdt.rank_op(process_set_id=1)) == EVEN.rank()


@check("process_set_included_op")
def process_set_included_op():
    import kerasdist.tensorflow as kdt
    for ps in (EVEN, ODD, ALL):
        assert int(kdt.process_set_included_op(
            process_set_id=ps.process_set_id)) == int(RANK in ps.ranks)
        assert int(kd.process_set_included_op(ps.process_set_id)) == int(
            RANK in ps.ranks)


@check("tf_allreduce")
def tf_allreduce():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    ops = {kd.Sum: np.sum, kd.Min: np.min, kd.Max: np.max}
    for ps in mine():
        for dtype in (np.float32, np.int32, np.float64):
            for op, fn in ops.items():
                x = data(RANK, (4, 3), dtype)
                want = fn(np.stack([data(r, (4, 3), dtype) for r in ps.ranks]),
                          axis=0)
                got = kdt.allreduce(tf.constant(x), op=op, process_set=ps,
                                    name=f"ar.{ps.process_set_id}.{op}."
                                    f"{np.dtype(dtype).name}")
                expect(got, want, f"allreduce {op} on {ps}")
            x = data(RANK, (5,), np.float32)
            want = np.mean([data(r, (5,), np.float32) for r in ps.ranks], 0)
            expect(kdt.allreduce(tf.constant(x), op=kd.Average,
                                 process_set=ps), want, f"average on {ps}",
                   1e-6)


@check("tf_grouped_and_function")
def tf_grouped_and_function():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    for ps in mine():
        xs = [data(RANK, (3,), np.float32, k) for k in range(3)]
        got = kdt.grouped_allreduce([tf.constant(x) for x in xs], op=kd.Sum,
                                    process_set=ps)
        for k, g in enumerate(got):
            expect(g, sum(data(r, (3,), np.float32, k) for r in ps.ranks),
                   f"grouped {k} on {ps}")

        @tf.function
        def step(x):
            return kdt.allreduce(x, op=kd.Sum, process_set=ps,
                                 name=f"fn.{ps.process_set_id}")
        x = data(RANK, (2,), np.float32)
        for _ in range(2):
            expect(step(tf.constant(x)),
                   sum(data(r, (2,), np.float32) for r in ps.ranks),
                   f"tf.function on {ps}")


@check("tf_allgather_broadcast")
def tf_allgather_broadcast():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    for ps in mine():
        x = data(RANK, (RANK + 1, 2), np.float32)
        want = np.concatenate([data(r, (r + 1, 2), np.float32)
                               for r in ps.ranks])
        expect(kdt.allgather(tf.constant(x), process_set=ps), want,
               f"allgather on {ps}")
        got = kdt.grouped_allgather([tf.constant(x), tf.constant(x * 2)],
                                    process_set=ps)
        expect(got[1], want * 2, f"grouped_allgather on {ps}")
        for root in ps.ranks:
            got = kdt.broadcast(tf.constant(data(RANK, (3,), np.int32)), root,
                                process_set=ps)
            expect(got, data(root, (3,), np.int32), f"broadcast {root} {ps}")
        v = tf.Variable(data(RANK, (2,), np.float32))
        kdt.broadcast_variables([v], root_rank=ps.ranks[-1], process_set=ps)
        expect(v.numpy(), data(ps.ranks[-1], (2,), np.float32),
               f"broadcast_variables {ps}")


@check("tf_alltoall_reducescatter")
def tf_alltoall_reducescatter():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    for ps in mine():
        n, me = len(ps.ranks), ps.ranks.index(RANK)
        x = data(RANK, (2 * n, 2), np.float32)
        got = kdt.alltoall(tf.constant(x), process_set=ps)
        want = np.concatenate([data(r, (2 * n, 2), np.float32)[2 * me:
                                                               2 * me + 2]
                               for r in ps.ranks])
        expect(got, want, f"alltoall on {ps}")
        rows = 2 * n + 1
        x = data(RANK, (rows, 2), np.float32)
        total = sum(data(r, (rows, 2), np.float32) for r in ps.ranks)
        counts = [rows // n + (k < rows % n) for k in range(n)]
        start = sum(counts[:me])
        got = kdt.reducescatter(tf.constant(x), op=kd.Sum, process_set=ps)
        expect(got, total[start:start + counts[me]], f"reducescatter {ps}")
        got = kdt.grouped_reducescatter([tf.constant(x)], op=kd.Sum,
                                        process_set=ps)
        expect(got[0], total[start:start + counts[me]],
               f"grouped_reducescatter {ps}")


@check("tf_gradients")
def tf_gradients():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    for ps in mine():
        x = tf.Variable(data(RANK, (RANK + 1, 2), np.float32))
        with tf.GradientTape() as tape:
            y = kdt.allgather(x, process_set=ps)
            loss = tf.reduce_sum(y * y)
        g = tape.gradient(loss, x)
        # Average over the set of every member's 2*y for this rank's rows.
        expect(g, 2 * x.numpy(), f"allgather gradient {ps}", 1e-5)


@check("tf_xla")
def tf_xla():
    """The collectives on a set inside tf.function(jit_compile=True), through
    the XLA kernels (ops/tf/xla_kernels.cc): the set, fixed at compile time,
    fixes the shapes too (its size and this rank's place in it)."""
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    from kerasdist.tensorflow import _keras_layer
    if _keras_layer.xla_unsupported():
        return
    for ps in mine():
        n, me = len(ps.ranks), ps.ranks.index(RANK)
        rows = 2 * n + 1

        @tf.function(jit_compile=True)
        def step(x, y, z):
            name = f"xla.{ps.process_set_id}"
            return (kdt.allreduce(x, op=kd.Sum, process_set=ps,
                                  name=name + ".sum"),
                    kdt.allgather(x[None], process_set=ps,
                                  name=name + ".gather"),
                    kdt.broadcast(x, ps.ranks[-1], process_set=ps,
                                  name=name + ".bcast"),
                    kdt.alltoall(y, process_set=ps, name=name + ".a2a"),
                    kdt.reducescatter(z, op=kd.Sum, process_set=ps,
                                      name=name + ".rs"))

        x = data(RANK, (3,), np.float32)
        y = data(RANK, (2 * n, 2), np.float32, 1)
        z = data(RANK, (rows, 2), np.float32, 2)
        total = sum(data(r, (rows, 2), np.float32, 2) for r in ps.ranks)
        counts = [rows // n + (k < rows % n) for k in range(n)]
        start = sum(counts[:me])
        for _ in range(2):
            s, g, b, a, rs = step(tf.constant(x), tf.constant(y),
                                  tf.constant(z))
            expect(s, sum(data(r, (3,), np.float32) for r in ps.ranks),
                   f"xla allreduce on {ps}")
            expect(g, np.stack([data(r, (3,), np.float32) for r in ps.ranks]),
                   f"xla allgather on {ps}")
            expect(b, data(ps.ranks[-1], (3,), np.float32),
                   f"xla broadcast on {ps}")
            expect(a, np.concatenate([
                data(r, (2 * n, 2), np.float32, 1)[2 * me:2 * me + 2]
                for r in ps.ranks]), f"xla alltoall on {ps}")
            expect(rs, total[start:start + counts[me]],
                   f"xla reducescatter on {ps}")


@check("interleaved_orders")
def interleaved_orders():
    """Each rank enqueues its sets' allreduces in its own order (rank 0
    reversed) before waiting for any: every set negotiates on its own, so
    all complete."""
    from kerasdist._core import capi
    from tests.support.collectives import start_allreduce
    order = mine() if RANK != 0 else list(reversed(mine()))
    for round_ in range(3):
        started = []
        for ps in order:
            x = data(RANK, (4,), np.float32, round_)
            with capi.process_set_scope(ps.process_set_id):
                started.append((ps, start_allreduce(x, f"inter.{round_}",
                                                    op=kd.Sum)))
        for ps, (h, _, out) in reversed(started):
            h.wait(timeout=60)
            want = sum(data(r, (4,), np.float32, round_) for r in ps.ranks)
            expect(out, want, f"interleaved {ps}")


@check("errors")
def errors():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    if RANK == 1:
        expect_error(lambda: kdt.allreduce(tf.ones([2]), process_set=EVEN),
                     "rank 1 is not in process set 1 (ranks 0,2)")
    else:
        # A shape mismatch inside the set fails on its members, naming it.
        expect_error(lambda: kdt.allreduce(tf.ones([RANK + 1]),
                                           process_set=EVEN, name="bad"),
                     "process set 1 (ranks 0,2)", "shape")
        expect_error(lambda: kdt.broadcast(tf.ones([2]), 1, process_set=EVEN),
                     "root_rank 1 is not in the set")
    expect_error(lambda: kdt.allreduce(tf.ones([2]),
                                       process_set=kd.ProcessSet([0])),
                 "has not been added")
    # The global set is untouched by the failures.
    expect(kdt.allreduce(tf.ones([2]), op=kd.Sum), [3.0, 3.0], "after errors")


@check("add_process_set_remove_process_set")
def add_process_set_remove_process_set():
    import tensorflow as tf

    import kerasdist.tensorflow as kdt
    ps = kd.add_process_set([1, 2])
    assert ps.process_set_id == 3, ps
    if RANK in (1, 2):
        expect(kdt.allreduce(tf.constant([float(RANK)]), op=kd.Sum,
                             process_set=ps), [3.0], "added set")
    expect_error(lambda: kd.add_process_set([1, 2]), "exists already")
    assert kd.remove_process_set(ps)
    assert ps.process_set_id is None
    stale = kd.ProcessSet([1, 2])
    stale.process_set_id = 3
    if RANK in (1, 2):
        expect_error(lambda: kdt.allreduce(tf.ones([1]), process_set=stale),
                     "process set 3 does not exist")
    again = kd.add_process_set(kd.ProcessSet([0, 1]))
    if RANK in (0, 1):
        expect(kdt.allreduce(tf.constant([float(RANK + 1)]), op=kd.Sum,
                             process_set=again), [3.0], "re-added set")
    kd.remove_process_set(again)


@check("objects")
def objects():
    for ps in mine():
        got = kd.allgather_object({"r": RANK}, process_set=ps)
        assert got == [{"r": r} for r in ps.ranks], got
        obj = kd.broadcast_object(RANK * 10, root_rank=ps.ranks[-1],
                                  process_set=ps)
        assert obj == ps.ranks[-1] * 10, obj


@check("optimizer")
def optimizer():
    """DistributedOptimizer(process_set=EVEN) on ranks 0 and 2 equals one
    process training on both ranks' batches (the mean loss of their
    concatenation); rank 1 trains alone meanwhile, on its own set."""
    import keras
    import tensorflow as tf
    ps = EVEN if RANK in (0, 2) else ODD

    def model():
        keras.utils.set_random_seed(7)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(1)])
        return m

    rng = np.random.default_rng(0)
    batches = {r: (rng.normal(size=(8, 4)).astype(np.float32),
                   rng.normal(size=(8, 1)).astype(np.float32))
               for r in range(SIZE)}
    m = model()
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=ps)
    m.compile(optimizer=opt, loss="mse")
    x, y = batches[RANK]
    m.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    ref = model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    xs = np.concatenate([batches[r][0] for r in ps.ranks])
    ys = np.concatenate([batches[r][1] for r in ps.ranks])
    ref.fit(xs, ys, batch_size=len(xs), epochs=3, shuffle=False, verbose=0)
    for a, b in zip(m.get_weights(), ref.get_weights()):
        expect(a, b, f"optimizer on {ps}", 1e-5)
    del tf


checks.group("frontends", default=False)


@check("jax_set")
def jax_set():
    import jax.numpy as jnp

    import kerasdist.jax as kdj
    for ps in mine():
        x = data(RANK, (3,), np.float32)
        expect(kdj.allreduce(jnp.asarray(x), op=kd.Sum, process_set=ps),
               sum(data(r, (3,), np.float32) for r in ps.ranks),
               f"jax allreduce {ps}")
        x = data(RANK, (RANK + 1, 2), np.float32)
        expect(kdj.allgather(jnp.asarray(x), process_set=ps),
               np.concatenate([data(r, (r + 1, 2), np.float32)
                               for r in ps.ranks]), f"jax allgather {ps}")
        expect(kdj.broadcast(jnp.asarray(data(RANK, (2,), np.float32)),
                             ps.ranks[0], process_set=ps),
               data(ps.ranks[0], (2,), np.float32), f"jax broadcast {ps}")


@check("jax_jit_set")
def jax_jit_set():
    """One jitted function on each set this rank is in, the whole job
    included: its collectives run on the set it was traced with."""
    import functools

    import jax
    import jax.numpy as jnp

    import kerasdist.jax as kdj
    from kerasdist._core import capi
    from kerasdist._core.host import scatter_rows

    @functools.partial(jax.jit, static_argnums=1)
    def step(x, ps):
        n = len(ps.ranks)
        return (kdj.allreduce(x, op=kd.Sum, process_set=ps),
                kdj.allgather(x, process_set=ps),
                kdj.broadcast(x, ps.ranks[-1], process_set=ps),
                kdj.reducescatter(x, op=kd.Sum, process_set=ps),
                kdj.alltoall(x[:n], process_set=ps),
                jax.grad(lambda v: jnp.sum(
                    kdj.allreduce(v, op=kd.Sum, process_set=ps)))(x))

    for ps in mine():
        xs = {r: data(r, (4, 2), np.float32) for r in ps.ranks}
        n, i = len(ps.ranks), ps.ranks.index(RANK)
        got = step(jnp.asarray(xs[RANK]), ps)
        total = sum(xs.values())
        start = sum(scatter_rows(4, n)[:i])
        want = (total, np.concatenate([xs[r] for r in ps.ranks]),
                xs[ps.ranks[-1]], total[start:start + scatter_rows(4, n)[i]],
                np.stack([xs[r][i] for r in ps.ranks]),
                np.full((4, 2), n, np.float32))
        for what, g, w in zip(("allreduce", "allgather", "broadcast",
                               "reducescatter", "alltoall", "grad"),
                              got, want):
            expect(g, w, f"jitted {what} on {ps}")

    # Unnamed calls, set members only: the set's names are counted apart,
    # so the job-wide call after them matches on every rank. A program
    # traced inside a set's scope keeps the set when called outside it.
    def mixed(x):
        a = x
        if RANK in EVEN.ranks:
            a = kdj.allreduce(x, op=kd.Sum, process_set=EVEN)
        return a, kdj.allreduce(x, op=kd.Sum)

    x = data(RANK, (3,), np.float32)
    a, b = jax.jit(mixed)(jnp.asarray(x))
    expect(b, sum(data(r, (3,), np.float32) for r in range(SIZE)),
           "jitted job-wide allreduce after a set's")
    if RANK in EVEN.ranks:
        expect(a, sum(data(r, (3,), np.float32) for r in EVEN.ranks),
               "jitted unnamed allreduce on {0,2}")
        scoped = jax.jit(lambda v: kdj.allreduce(v, op=kd.Sum))
        with capi.process_set_scope(EVEN.process_set_id):
            scoped(jnp.asarray(x)).block_until_ready()
        expect(scoped(jnp.asarray(x)),
               sum(data(r, (3,), np.float32) for r in EVEN.ranks),
               "jitted program traced in a set's scope, called outside")


@check("torch_set")
def torch_set():
    import torch

    import kerasdist.torch as kdt
    for ps in mine():
        x = data(RANK, (3,), np.float32)
        expect(kdt.allreduce(torch.from_numpy(x), op=kd.Sum,
                             process_set=ps).numpy(),
               sum(data(r, (3,), np.float32) for r in ps.ranks),
               f"torch allreduce {ps}")
        x = data(RANK, (RANK + 1, 2), np.float32)
        expect(kdt.allgather(torch.from_numpy(x), process_set=ps).numpy(),
               np.concatenate([data(r, (r + 1, 2), np.float32)
                               for r in ps.ranks]), f"torch allgather {ps}")


if __name__ == "__main__":
    checks.main(rank=RANK)
    # A rank's shutdown stops the job's runtime, and with it every set's:
    # wait for the others first (as Horovod's tests do).
    from kerasdist._core import host
    host.host_barrier("process_sets_worker.done")
    kd.shutdown()
