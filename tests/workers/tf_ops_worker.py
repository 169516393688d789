"""The TF front end: every op eagerly, inside tf.function and under
tf.GradientTape, checked against numpy; and the case that breaks plain MPI —
many independent collectives in one tf.function whose ranks enqueue them in
different orders (random per-rank delays)."""

import sys

import numpy as np
import tensorflow as tf

import kerasdist as kd

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
kd.init()
r, n = kd.rank(), kd.size()


def check(got, want, what, tol=0.0):
    got = np.asarray(got)
    want = np.asarray(want)
    if (got.shape != want.shape
            or not np.allclose(got, want, rtol=tol, atol=tol)):
        print(f"FAIL {what}: got {got!r}, want {want!r}", flush=True)
        sys.exit(1)


def vals(k, size=5):
    return np.arange(size, dtype=np.float64) + 10 * k


stack = np.stack([vals(k) for k in range(n)])

# eager
check(kd.allreduce(vals(r), op=kd.Sum, name="e.sum"), stack.sum(0), "eager sum")
check(kd.allreduce(vals(r), name="e.avg"), stack.mean(0), "eager average",
      1e-12)
check(kd.allreduce(tf.constant(vals(r), tf.float16), op=kd.Max, name="e.max"),
      stack.max(0), "eager max fp16")
got = kd.grouped_allreduce([vals(r), vals(r)[:2], tf.constant([r], tf.int32)],
                           op=kd.Sum, name="e.group")
check(got[0], stack.sum(0), "grouped 0")
check(got[2], [n * (n - 1) // 2], "grouped int")
check(kd.allgather(np.full([r + 1, 2], r), name="e.gather"),
      np.concatenate([np.full([k + 1, 2], k) for k in range(n)]), "allgather")
check(kd.broadcast(tf.constant([r, r + 1]), n - 1, name="e.bcast"), [n - 1, n],
      "broadcast")
check(kd.broadcast(tf.constant([r == 0, True]), 0, name="e.bool"), [True, True],
      "broadcast bool")
recv, splits = kd.alltoall(np.full([n, 1], r, np.int64), name="e.a2a")
check(recv, np.arange(n).reshape(n, 1), "alltoall")
check(splits, np.ones(n), "alltoall splits")
check(kd.reducescatter(np.ones([2 * n, 2]) * (r + 1), op=kd.Sum, name="e.rs"),
      np.full([2, 2], n * (n + 1) / 2), "reducescatter")
kd.barrier()
v = tf.Variable(vals(r))
kd.broadcast_variables([v], root_rank=0)
check(v, vals(0), "broadcast_variables")
sparse = tf.IndexedSlices(tf.constant([[1.0 * r, 2.0]]), tf.constant([r]),
                          dense_shape=tf.constant([n, 2]))
dense = tf.convert_to_tensor(kd.allreduce(sparse, op=kd.Sum, name="e.sparse"))
check(dense, np.stack([[1.0 * k, 2.0] for k in range(n)]), "sparse allreduce")
print("OK eager", flush=True)


# tf.function and gradients
@tf.function
def fn(x):
    return (kd.allreduce(x, op=kd.Sum, name="f.sum"),
            kd.allgather(x[:1 + r % 2], name="f.gather"),
            kd.broadcast(x, 0, name="f.bcast"))


s, g, b = fn(tf.constant(vals(r)))
check(s, stack.sum(0), "function sum")
check(g, np.concatenate([vals(k)[:1 + k % 2] for k in range(n)]),
      "function gather")
check(b, vals(0), "function broadcast")

x = tf.Variable(vals(r))
with tf.GradientTape(persistent=True) as tape:
    y_sum = tf.reduce_sum(kd.allreduce(x * x, op=kd.Sum, name="g.sum"))
    y_avg = tf.reduce_sum(kd.allreduce(x * x, op=kd.Average, name="g.avg"))
    y_gather = tf.reduce_sum(kd.allgather(x * (r + 1), name="g.gather") ** 2)
    y_bcast = tf.reduce_sum(kd.broadcast(x, 0, name="g.bcast") * 3.0)
# d/dx sum_k allreduce(x_k^2) on rank r: the gradient allreduce sums the
# upstream ones (each rank's is 1) -> n * 2x
check(tape.gradient(y_sum, x), n * 2 * vals(r), "grad allreduce sum")
check(tape.gradient(y_avg, x), 2 * vals(r), "grad allreduce average", 1e-12)
# allgather: every rank's loss contains this rank's slice: n * 2 * (r+1)^2 x
check(tape.gradient(y_gather, x), n * 2 * (r + 1) ** 2 * vals(r),
      "grad allgather")
check(tape.gradient(y_bcast, x), (3.0 * n if r == 0 else 0.0) * np.ones(5),
      "grad broadcast")
print("OK function+gradients", flush=True)

# 64 independent collectives whose ranks enqueue them in different orders
COUNT = 64
rng = np.random.default_rng(100 + r)


def delayed(i):
    def sleep(t):
        import time
        time.sleep(float(t))
        return t
    return tf.py_function(sleep, [tf.constant(0.0)], tf.float32)


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


for rep in range(4):
    outs = many(tf.constant(rng.uniform(0, 0.004, COUNT), tf.float32))
    for i, o in enumerate(outs):
        check(o, np.full([3 + i % 4], sum(k + i for k in range(n))),
              f"many {i}")
print("OK out-of-order x4", flush=True)
print("OK all", flush=True)
