"""join(): a rank that ran out of data takes part in the other ranks'
allreduces with zeros until every rank has joined, checked against numpy.
Runs at -np 2 or more.

    join_worker.py [--only CHECK,...] [--group G]

Group "tf" (default), on TensorFlow: each rank in turn joins first while
the others allreduce tensors of several dtypes eagerly, as a fused batch
(one tf.function), as a grouped allreduce and as response-cache hits; the
sum is the non-joined ranks' only, Average divides by size() (as Horovod);
join() returns the last rank to join, the same on every rank, inside a
tf.function too; unnamed collectives match again after join(); an
allgather or broadcast while a rank has joined fails
with a clear error on the ranks that called it and nothing hangs; a custom
training loop on uneven data (rank r has 3 + 2r batches) with
DistributedGradientTape, then join(), ends with the weights of a numpy
replay. Group "frameworks": one check each for kerasdist.jax.join() and
kerasdist.torch.join() (in the same process and runtime).
A failed check raises, which fails the rank and the job.
"""

import numpy as np
import tensorflow as tf

import kerasdist.tensorflow as kd
from tests.support import checks
from tests.support.checks import check

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

kd.init()
r, n = kd.rank(), kd.size()

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]


def expect(got, want, what, tol=0.0):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=tol,
            atol=tol):
        raise AssertionError(f"rank {r}: {what}: got {got!r}, want {want!r}")


def vals(rank, k, dtype, size=6):
    return (np.arange(size) % 5 + 10 * rank + k).astype(dtype)


def others_sum(joiner, k, dtype, size=6):
    return sum(vals(q, k, dtype, size).astype(np.float64)
               for q in range(n) if q != joiner)


def last_rank_of(joiner):
    # The ranks that did not join first join in turn; the last one of them
    # runs one more allreduce alone first (it completes only once every
    # other rank has joined), so it is the last to join.
    return max(q for q in range(n) if q != joiner)


def finish(joiner, tag):
    """Every rank but `joiner` ends its part with join(); the last of them
    first runs an allreduce all others serve with zeros."""
    if r == last_rank_of(joiner):
        expect(kd.allreduce(np.ones(3, np.float32), op=kd.Sum,
                            name=f"{tag}.alone"),
               np.ones(3), f"{tag}: the last rank's lone allreduce")
    return int(kd.join())


checks.group("tf")


@tf.function
def fused_step(tensors):
    # Independent allreduces in one function: fused into one batch.
    return [kd.allreduce(t, op=kd.Sum, name=f"fused.{i}")
            for i, t in enumerate(tensors)]


@check("joined_rank_contributes_zeros")
def joined_rank_contributes_zeros():
    # First with every rank (the responses enter the cache), then with
    # each rank joined in turn: the others' collectives are cache hits.
    for step, joiner in enumerate([None] + list(range(n))):
        tag = f"zeros.{step}"
        if r == joiner:
            last = int(kd.join())
        else:
            for k, dtype in enumerate(DTYPES):
                got = kd.allreduce(vals(r, k, dtype), op=kd.Sum,
                                   name=f"zeros.{k}")
                expect(got, others_sum(joiner, k, dtype),
                       f"joiner {joiner}: sum of {dtype.__name__}")
            got = kd.grouped_allreduce(
                [vals(r, k, dtype) for k, dtype in enumerate(DTYPES)],
                op=kd.Sum, name="zeros.group")
            for k, dtype in enumerate(DTYPES):
                expect(got[k], others_sum(joiner, k, dtype),
                       f"joiner {joiner}: grouped {dtype.__name__}")
            got = fused_step([tf.constant(vals(r, k, np.float32, 4 + k))
                              for k in range(6)])
            for k in range(6):
                expect(got[k], others_sum(joiner, k, np.float32, 4 + k),
                       f"joiner {joiner}: fused member {k}")
            if joiner is None:
                continue
            last = finish(joiner, tag)
        if joiner is not None and last != last_rank_of(joiner):
            raise AssertionError(f"rank {r}: join() returned {last}, want "
                                 f"{last_rank_of(joiner)} (joiner {joiner})")


@check("average_divides_by_size")
def average_divides_by_size():
    joiner = n - 1
    if r == joiner:
        last = int(kd.join())
    else:
        for dtype in (np.float32, np.float64):
            got = kd.allreduce(vals(r, 0, dtype), op=kd.Average,
                               name=f"avg.{dtype.__name__}")
            expect(got, others_sum(joiner, 0, dtype) / n,
                   f"Average of {dtype.__name__} (divides by size())", 1e-6)
        got = kd.allreduce(vals(r, 0, np.float32), op=kd.Sum,
                           prescale_factor=2.0, postscale_factor=0.5,
                           name="avg.scaled")
        expect(got, others_sum(joiner, 0, np.float32), "pre/postscale", 1e-6)
        last = finish(joiner, "avg")
    expect(last, last_rank_of(joiner), "join() after Average")


@check("join_in_tf_function")
def join_in_tf_function():
    joiner = 0
    join_fn = tf.function(lambda: kd.join())
    if r == joiner:
        out = join_fn()
    else:
        expect(kd.allreduce(vals(r, 1, np.float32), op=kd.Sum,
                            name="fn.sum"),
               others_sum(joiner, 1, np.float32), "sum before a tf.function "
               "join")
        if r == last_rank_of(joiner):
            kd.allreduce(np.ones(2, np.float32), name="fn.alone")
        out = join_fn()
    if out.dtype != tf.int32 or out.shape != ():
        raise AssertionError(f"join() in a tf.function gave {out!r}, want a "
                             "scalar int32 tensor")
    expect(out.numpy(), last_rank_of(joiner), "join() in a tf.function")


@check("other_collectives_fail_clearly")
def other_collectives_fail_clearly():
    try:
        kd.join(device="gpu")
    except ValueError as e:
        if "join(device=...)" not in str(e):
            raise AssertionError(f"join(device='gpu'): unclear {e}") from None
    else:
        raise AssertionError("join(device='gpu') gave no error")
    joiner = 0
    if r == joiner:
        last = int(kd.join())
    else:
        for what, call in (
                ("allgather", lambda: kd.allgather(
                    np.ones([2, 2], np.float32), name="fail.gather")),
                ("broadcast", lambda: kd.broadcast(
                    np.ones(3, np.float32), root_rank=r, name="fail.bcast"))):
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the message is checked
                msg = str(e)
                if ("have called join()" not in msg or what not in msg
                        or "allreduces only" not in msg):
                    raise AssertionError(
                        f"rank {r}: {what} while rank {joiner} has joined: "
                        f"unclear error {msg[:300]!r}") from None
            else:
                raise AssertionError(f"rank {r}: {what} while rank {joiner} "
                                     "has joined gave no error")
        # Allreduces still run.
        expect(kd.allreduce(vals(r, 2, np.float32), op=kd.Sum,
                            name="fail.after"),
               others_sum(joiner, 2, np.float32), "allreduce after errors")
        last = finish(joiner, "fail")
    expect(last, last_rank_of(joiner), "join() after the errors")
    # After join() everything runs again, allgather included.
    expect(kd.allgather(np.full([1, 2], r, np.float32), name="fail.gather2"),
           np.repeat(np.arange(n, dtype=np.float32), 2).reshape(n, 2),
           "allgather after join()")


@check("unnamed_collectives_after_join")
def unnamed_collectives_after_join():
    # The ranks that did not join make unnamed calls the joined one does
    # not; after join() the unnamed calls of every rank match again.
    joiner = 0
    if r == joiner:
        kd.join()
    else:
        for k in range(2):
            expect(kd.allreduce(vals(r, k, np.float32), op=kd.Sum),
                   others_sum(joiner, k, np.float32), f"unnamed sum {k}")
        finish(joiner, "unnamed")
    for k in range(2):
        expect(kd.allreduce(vals(r, k, np.float32), op=kd.Sum),
               sum(vals(q, k, np.float32) for q in range(n)),
               f"unnamed sum {k} after join()")
    expect(kd.broadcast(np.full(2, r, np.float32), root_rank=n - 1),
           np.full(2, n - 1), "unnamed broadcast after join()")


def batches_of(rank):
    # Rank r has 3 + 2r batches of 4 rows: uneven data.
    rng = np.random.default_rng(100 + rank)
    return [(rng.normal(size=(4, 3)).astype(np.float32),
             rng.normal(size=(4, 1)).astype(np.float32))
            for _ in range(3 + 2 * rank)]


@check("uneven_training_loop")
def uneven_training_loop():
    w0 = np.array([[0.5], [-0.25], [1.0]], np.float32)
    b0 = np.zeros(1, np.float32)
    lr = 0.1
    w = tf.Variable(w0)
    b = tf.Variable(b0)
    mine = batches_of(r)
    for x, y in mine:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
        tape = kd.DistributedGradientTape(tape)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(lr * gw)
        b.assign_sub(lr * gb)
    last = int(kd.join())
    expect(last, n - 1, "join() after uneven data (the rank with most data)")
    # numpy replay: at each step the ranks that still have data contribute
    # their gradient, the joined ones zeros; Average divides by size().
    data = [batches_of(q) for q in range(n)]
    tw, tb = w0.astype(np.float64), b0.astype(np.float64)
    truth = {}
    for step in range(max(len(d) for d in data)):
        gw_sum, gb_sum = np.zeros_like(tw), np.zeros_like(tb)
        for d in data:
            if step < len(d):
                x, y = (a.astype(np.float64) for a in d[step])
                err = x @ tw + tb - y
                gw_sum += 2 * x.T @ err / len(x)
                gb_sum += 2 * err.sum(0) / len(x)
        tw, tb = tw - lr * gw_sum / n, tb - lr * gb_sum / n
        truth[step + 1] = (tw, tb)
    want_w, want_b = truth[len(mine)]
    expect(w.numpy(), want_w, "weights after this rank's steps", 1e-5)
    expect(b.numpy(), want_b, "bias after this rank's steps", 1e-5)
    # Horovod's recipe: the last rank to join has seen every step.
    kd.broadcast_variables([w, b], root_rank=last)
    expect(w.numpy(), truth[len(data[-1])][0], "weights broadcast", 1e-5)


checks.group("frameworks", default=False)


@check("jax_join")
def jax_join():
    import jax

    import kerasdist.jax as kj
    try:
        jax.jit(lambda: kj.join())()
    except RuntimeError as e:
        if "eagerly only" not in str(e):
            raise AssertionError(f"join() in jax.jit: unclear {e}") from None
    else:
        raise AssertionError("join() in jax.jit gave no error")
    joiner = n - 1
    if r == joiner:
        last = kj.join()
    else:
        got = kj.allreduce(vals(r, 3, np.float32), op=kj.Sum, name="jax.sum")
        expect(got, others_sum(joiner, 3, np.float32), "jax sum")
        if r == last_rank_of(joiner):
            kj.allreduce(np.ones(2, np.float32), name="jax.alone")
        last = kj.join()
    if not isinstance(last, int):
        raise AssertionError(f"kerasdist.jax.join() gave {last!r}, an int "
                             "wanted")
    expect(last, last_rank_of(joiner), "kerasdist.jax.join()")


@check("torch_join")
def torch_join():
    import torch

    import kerasdist.torch as kt
    joiner = 0
    if r == joiner:
        last = kt.join()
    else:
        got = kt.allreduce(torch.tensor(vals(r, 4, np.float64)), op=kt.Sum,
                           name="torch.sum")
        expect(got.numpy(), others_sum(joiner, 4, np.float64), "torch sum")
        kt.allreduce(torch.ones(2))  # unnamed: the joined rank makes none
        if r == last_rank_of(joiner):
            kt.allreduce(torch.ones(2), name="torch.alone")
        last = kt.join()
    got = kt.allreduce(torch.ones(2), op=kt.Sum)  # unnamed, on every rank
    expect(got.numpy(), np.full(2, float(n)), "torch unnamed after join()")
    if not isinstance(last, int):
        raise AssertionError(f"kerasdist.torch.join() gave {last!r}, an int "
                             "wanted")
    expect(last, last_rank_of(joiner), "kerasdist.torch.join()")


if __name__ == "__main__":
    checks.main(rank=r)
    kd.shutdown()
