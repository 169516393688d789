"""The TF front end: every op eagerly, inside tf.function and under
tf.GradientTape, checked against numpy; and the case that breaks plain MPI —
many independent collectives in one tf.function whose ranks enqueue them in
different orders (random per-rank delays).

    tf_ops_worker.py [--only CHECK,...]

Named checks (tests/support/checks.py): one per collective eagerly
(allreduce, grouped_allreduce, allgather, broadcast, alltoall,
reducescatter, barrier, broadcast_variables, allreduce_indexed_slices),
then tf_function, gradients and out_of_order. A failed check raises, which
fails the rank and the job."""

import numpy as np
import tensorflow as tf

import kerasdist as kd
from tests.support import checks
from tests.support.checks import check

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
kd.init()
r, n = kd.rank(), kd.size()


def expect(got, want, what, tol=0.0):
    got = np.asarray(got)
    want = np.asarray(want)
    if (got.shape != want.shape
            or not np.allclose(got, want, rtol=tol, atol=tol)):
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def vals(k, size=5):
    return np.arange(size, dtype=np.float64) + 10 * k


stack = np.stack([vals(k) for k in range(n)])


# eager
@check("allreduce")
def allreduce():
    expect(kd.allreduce(vals(r), op=kd.Sum, name="e.sum"), stack.sum(0),
           "eager sum")
    expect(kd.allreduce(vals(r), name="e.avg"), stack.mean(0),
           "eager average", 1e-12)
    expect(kd.allreduce(tf.constant(vals(r), tf.float16), op=kd.Max,
                        name="e.max"),
           stack.max(0), "eager max fp16")


@check("grouped_allreduce")
def grouped_allreduce():
    got = kd.grouped_allreduce([vals(r), vals(r)[:2],
                                tf.constant([r], tf.int32)],
                               op=kd.Sum, name="e.group")
    expect(got[0], stack.sum(0), "grouped 0")
    expect(got[2], [n * (n - 1) // 2], "grouped int")


@check("allgather")
def allgather():
    expect(kd.allgather(np.full([r + 1, 2], r), name="e.gather"),
           np.concatenate([np.full([k + 1, 2], k) for k in range(n)]),
           "allgather")


@check("broadcast")
def broadcast():
    expect(kd.broadcast(tf.constant([r, r + 1]), n - 1, name="e.bcast"),
           [n - 1, n], "broadcast")
    expect(kd.broadcast(tf.constant([r == 0, True]), 0, name="e.bool"),
           [True, True], "broadcast bool")


@check("alltoall")
def alltoall():
    recv, splits = kd.alltoall(np.full([n, 1], r, np.int64), name="e.a2a")
    expect(recv, np.arange(n).reshape(n, 1), "alltoall")
    expect(splits, np.ones(n), "alltoall splits")


@check("reducescatter")
def reducescatter():
    expect(kd.reducescatter(np.ones([2 * n, 2]) * (r + 1), op=kd.Sum,
                            name="e.rs"),
           np.full([2, 2], n * (n + 1) / 2), "reducescatter")


@check("barrier")
def barrier():
    kd.barrier()


@check("broadcast_variables")
def broadcast_variables():
    v = tf.Variable(vals(r))
    kd.broadcast_variables([v], root_rank=0)
    expect(v, vals(0), "broadcast_variables")


@check("allreduce_indexed_slices")
def allreduce_indexed_slices():
    sparse = tf.IndexedSlices(tf.constant([[1.0 * r, 2.0]]), tf.constant([r]),
                              dense_shape=tf.constant([n, 2]))
    dense = tf.convert_to_tensor(kd.allreduce(sparse, op=kd.Sum,
                                              name="e.sparse"))
    expect(dense, np.stack([[1.0 * k, 2.0] for k in range(n)]),
           "sparse allreduce")


# tf.function and gradients
@check("tf_function")
def tf_function():
    @tf.function
    def fn(x):
        return (kd.allreduce(x, op=kd.Sum, name="f.sum"),
                kd.allgather(x[:1 + r % 2], name="f.gather"),
                kd.broadcast(x, 0, name="f.bcast"))

    s, g, b = fn(tf.constant(vals(r)))
    expect(s, stack.sum(0), "function sum")
    expect(g, np.concatenate([vals(k)[:1 + k % 2] for k in range(n)]),
           "function gather")
    expect(b, vals(0), "function broadcast")


@check("gradients")
def gradients():
    x = tf.Variable(vals(r))
    with tf.GradientTape(persistent=True) as tape:
        y_sum = tf.reduce_sum(kd.allreduce(x * x, op=kd.Sum, name="g.sum"))
        y_avg = tf.reduce_sum(kd.allreduce(x * x, op=kd.Average,
                                           name="g.avg"))
        y_gather = tf.reduce_sum(kd.allgather(x * (r + 1),
                                              name="g.gather") ** 2)
        y_bcast = tf.reduce_sum(kd.broadcast(x, 0, name="g.bcast") * 3.0)
    # d/dx sum_k allreduce(x_k^2) on rank r: the gradient allreduce sums the
    # upstream ones (each rank's is 1) -> n * 2x
    expect(tape.gradient(y_sum, x), n * 2 * vals(r), "grad allreduce sum")
    expect(tape.gradient(y_avg, x), 2 * vals(r), "grad allreduce average",
           1e-12)
    # allgather: every rank's loss contains this rank's slice: n * 2 *
    # (r+1)^2 x
    expect(tape.gradient(y_gather, x), n * 2 * (r + 1) ** 2 * vals(r),
           "grad allgather")
    expect(tape.gradient(y_bcast, x),
           (3.0 * n if r == 0 else 0.0) * np.ones(5), "grad broadcast")


# 64 independent collectives whose ranks enqueue them in different orders
COUNT = 64


@tf.function
def many(delays):
    outs = []
    for i in range(COUNT):
        # the allreduce of tensor i waits for a per-rank random delay
        wait = tf.py_function(lambda t: __import__("time").sleep(float(t)) or t,
                              [delays[i]], tf.float32)
        val = tf.fill([3 + i % 4], tf.cast(r + i, tf.float32)) + 0.0 * wait
        outs.append(kd.allreduce(val, op=kd.Sum, name=f"many.{i}"))
    return outs


@check("out_of_order")
def out_of_order():
    rng = np.random.default_rng(100 + r)
    for rep in range(4):
        outs = many(tf.constant(rng.uniform(0, 0.004, COUNT), tf.float32))
        for i, o in enumerate(outs):
            expect(o, np.full([3 + i % 4], sum(k + i for k in range(n))),
                   f"many {i}")


if __name__ == "__main__":
    checks.main(rank=r)
