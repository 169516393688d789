"""The TF front end: every op eagerly, inside tf.function and under
tf.GradientTape, checked against numpy; and the case that breaks plain MPI —
many independent collectives in one tf.function whose ranks enqueue them in
different orders (random per-rank delays).

    tf_ops_worker.py [--only CHECK,...]

Named checks (tests/support/checks.py): one per collective eagerly
(allreduce, grouped_allreduce, allgather, broadcast,
broadcast_once_keeps_no_copy, alltoall,
reducescatter, barrier, broadcast_variables, allreduce_indexed_slices),
then tf_function and gradients; then what Horovod's own TF tests expect
(horovod_dtypes_allreduce, horovod_dtypes_moved,
horovod_dtypes_reducescatter, average_keyword, alltoall_horovod_returns,
gradient_conventions, integer_scaling, indexed_slices_horovod,
error_types); inside tf.function(jit_compile=True), through the XLA
kernels (xla_collectives, xla_gradients, xla_errors); then out_of_order.
A failed check raises, which fails the rank and the job."""

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


def resident_mib():
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@check("broadcast_once_keeps_no_copy")
def broadcast_once_keeps_no_copy():
    # Eager broadcasts each under a name of its own (as the start of
    # training broadcasts every variable): TF keeps each one's kernel, and
    # a kernel that kept its output buffer kept a whole copy of every
    # variable it sent (8 x 16 MiB here). Freed, each result's memory
    # serves the next one.
    x = tf.constant(np.full([4 << 20], float(r), np.float32))
    before = resident_mib()
    for k in range(8):
        out = kd.broadcast(x, 0, name=f"e.once.{k}")
        expect(out[:3], [0.0] * 3, "broadcast once")
        del out
    grew = resident_mib() - before
    if grew > 64:
        raise AssertionError(
            f"8 broadcasts of 16 MiB left {grew:.0f} MiB resident")


@check("alltoall")
def alltoall():
    recv = kd.alltoall(np.full([n, 1], r, np.int64), name="e.a2a")
    expect(recv, np.arange(n).reshape(n, 1), "alltoall")
    recv, splits = kd.alltoall(np.full([n, 1], r, np.int64), splits=[1] * n,
                               name="e.a2a.splits")
    expect(recv, np.arange(n).reshape(n, 1), "alltoall with splits")
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
    # allgather: every rank's loss contains this rank's slice, 2 * (r+1)^2
    # x each; Horovod's gradient averages them (gradient_conventions).
    expect(tape.gradient(y_gather, x), 2 * (r + 1) ** 2 * vals(r),
           "grad allgather")
    expect(tape.gradient(y_bcast, x),
           (3.0 if r == 0 else 0.0) * np.ones(5), "grad broadcast")


# ---- what Horovod's own TF tests expect (test/parallel/test_tensorflow.py) --

# The dtypes Horovod's ops take (its op registrations), then the ones
# kerasdist takes besides.
HVD_REDUCED = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16,
               tf.float32, tf.float64]
HVD_MOVED = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64,
             tf.float16, tf.float32, tf.float64, tf.bool]
HVD_SCATTERED = [tf.int32, tf.int64, tf.float16, tf.float32, tf.float64]
MORE = [tf.int16, tf.uint16, tf.bfloat16]


def as_f64(t):
    return np.asarray(tf.cast(t, tf.float64))


def data(k, shape, dtype, offset=0):
    """Rank k's input: small integers, exact in every dtype (bool: odd)."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    base = base % 5 + k + offset
    if dtype.is_integer and not dtype.is_unsigned:
        base = base - 2  # some negative values for the signed types
    return tf.cast(tf.constant(base) % 2 == 1 if dtype == tf.bool
                   else tf.constant(base), dtype)


def tolerance(dtype):
    return 1e-2 if dtype in (tf.float16, tf.bfloat16) else 1e-6


@check("horovod_dtypes_allreduce")
def horovod_dtypes_allreduce():
    shape = [3, 4]
    for dt in HVD_REDUCED + MORE:
        per = np.stack([as_f64(data(k, shape, dt)) for k in range(n)])
        # Product: 1s and 2s, which no dtype overflows.
        ones = np.stack([np.full(shape, 1.0 + k % 2) for k in range(n)])
        x = data(r, shape, dt)
        for op, want in ((kd.Sum, per.sum(0)), (kd.Min, per.min(0)),
                         (kd.Max, per.max(0))):
            got = kd.allreduce(x, op=op, name=f"hd.{dt.name}.{op}")
            if got.dtype != dt:
                raise AssertionError(f"{dt.name}: result dtype {got.dtype}")
            expect(as_f64(got), want, f"allreduce {op} {dt.name}",
                   tolerance(dt))
        avg = per.sum(0) / n
        if dt.is_integer:
            avg = np.trunc(avg)  # C division, toward zero
        expect(as_f64(kd.allreduce(x, op=kd.Average,
                                   name=f"hd.{dt.name}.avg")),
               avg, f"allreduce Average {dt.name}", tolerance(dt))
        prod = kd.allreduce(tf.cast(ones[r], dt), op=kd.Product,
                            name=f"hd.{dt.name}.prod")
        expect(as_f64(prod), ones.prod(0), f"allreduce Product {dt.name}")
        grouped = kd.grouped_allreduce([x, x[:1]], op=kd.Sum,
                                       name=f"hd.{dt.name}.group")
        expect(as_f64(grouped[1]), per.sum(0)[:1],
               f"grouped_allreduce {dt.name}", tolerance(dt))


@check("horovod_dtypes_moved")
def horovod_dtypes_moved():
    for dt in HVD_MOVED + MORE:
        gathered = kd.allgather(data(r, [r + 1, 3], dt),
                                name=f"hm.{dt.name}.gather")
        expect(as_f64(gathered),
               np.concatenate([as_f64(data(k, [k + 1, 3], dt))
                               for k in range(n)]),
               f"allgather {dt.name}")
        for root in range(n):
            got = kd.broadcast(data(r, [4, 2], dt), root,
                               name=f"hm.{dt.name}.bcast.{root}")
            expect(as_f64(got), as_f64(data(root, [4, 2], dt)),
                   f"broadcast {dt.name} root {root}")
        # Rank r sends rank j the rows [r, j] (twice for dtype's sake).
        rows = tf.cast(tf.constant([[r * 10 + j, 1] for j in range(n)]), dt)
        got = kd.alltoall(rows, name=f"hm.{dt.name}.a2a")
        want = tf.cast(tf.constant([[j * 10 + r, 1] for j in range(n)]), dt)
        expect(as_f64(got), as_f64(want), f"alltoall {dt.name}")


@check("horovod_dtypes_reducescatter")
def horovod_dtypes_reducescatter():
    rows = 2 * n + 1  # uneven: the first rank(s) get one more row
    counts = [rows // n + (k < rows % n) for k in range(n)]
    start = sum(counts[:r])
    for dt in HVD_SCATTERED + [tf.uint8, tf.int8] + MORE:
        per = np.stack([as_f64(data(k, [rows, 2], dt)) for k in range(n)])
        x = data(r, [rows, 2], dt)
        got = kd.reducescatter(x, op=kd.Sum, name=f"hs.{dt.name}.sum")
        expect(as_f64(got), per.sum(0)[start:start + counts[r]],
               f"reducescatter Sum {dt.name}", tolerance(dt))
        avg = per.sum(0)[start:start + counts[r]] / n
        got = kd.reducescatter(x, op=kd.Average, name=f"hs.{dt.name}.avg")
        expect(as_f64(got), np.trunc(avg) if dt.is_integer else avg,
               f"reducescatter Average {dt.name}", tolerance(dt))


def expect_raises(kind, fn, *needles):
    try:
        fn()
    except kind as e:
        missing = [s for s in needles if s not in str(e)]
        if missing:
            raise AssertionError(f"{kind.__name__} lacks {missing}: {e}")
        return
    raise AssertionError(f"no {kind.__name__} (wanted {needles})")


@check("average_keyword")
def average_keyword():
    import warnings

    import keras

    x = tf.constant(vals(r))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expect(kd.allreduce(x, average=False, name="ak.false"), stack.sum(0),
               "average=False")
    if not any(issubclass(w.category, DeprecationWarning) for w in caught):
        raise AssertionError("average= gave no DeprecationWarning")
    expect(kd.allreduce(x, average=True, name="ak.true"), stack.mean(0),
           "average=True", 1e-12)
    got = kd.grouped_allreduce([x, x[:2]], average=False, name="ak.group")
    expect(got[1], stack.sum(0)[:2], "grouped average=False")
    for fn in (lambda: kd.allreduce(x, op=kd.Sum, average=False),
               lambda: kd.grouped_allreduce([x], op=kd.Sum, average=True)):
        expect_raises(ValueError, fn, "supersedes average")
    v = tf.Variable(vals(r))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * (r + 1))
    grad = kd.DistributedGradientTape(tape, average=False,
                                      name="ak.tape").gradient(loss, [v])[0]
    expect(grad, np.full(5, n * (n + 1) / 2), "tape average=False")
    expect_raises(ValueError, lambda: kd.DistributedGradientTape(
        tf.GradientTape(), op=kd.Sum, average=True), "supersedes average")
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), average=False,
                                  name="ak.opt")
    w = keras.Variable(np.zeros(5, np.float32), name="w", dtype="float32")
    opt.apply([tf.constant(np.full(5, r + 1.0, np.float32))], [w])
    expect(w.numpy(), np.full(5, -n * (n + 1) / 2),
           "optimizer average=False")
    expect_raises(ValueError, lambda: kd.DistributedOptimizer(
        keras.optimizers.SGD(1.0), op=kd.Average, average=True),
        "supersedes average")


@check("alltoall_horovod_returns")
def alltoall_horovod_returns():
    x = tf.constant([[r, j] for j in range(n)], tf.int32)
    got = kd.alltoall(x, name="ar.even")
    if not tf.is_tensor(got):
        raise AssertionError(f"alltoall without splits gave {type(got)}")

    @tf.function
    def fn(t):
        return kd.alltoall(t, name="ar.fn")

    expect(fn(x), [[j, r] for j in range(n)], "alltoall in tf.function")
    recv, splits = kd.alltoall(x, splits=tf.ones([n], tf.int32),
                               name="ar.splits")
    expect(recv, [[j, r] for j in range(n)], "alltoall with splits")
    expect(splits, np.ones(n), "received splits")


def inputs(shape_of):
    """Every rank's input (float64), rank k's of shape shape_of(k)."""
    return [np.arange(int(np.prod(shape_of(k))), dtype=np.float64)
            .reshape(shape_of(k)) * 0.5 + k + 1 for k in range(n)]


def single_process(xs, outputs):
    """The truth: the gradient, with respect to rank r's input, of the sum
    of every rank's loss sum((k + 1) * y_k ** 2), all in this process;
    `outputs(variables)` gives every rank's collective output y_k."""
    variables = [tf.Variable(x) for x in xs]
    with tf.GradientTape() as tape:
        ys = outputs(variables)
        loss = tf.add_n([tf.reduce_sum((k + 1) * y ** 2)
                         for k, y in enumerate(ys)])
    grad = tape.gradient(loss, variables[r])
    return np.zeros_like(xs[r]) if grad is None else np.asarray(grad)


def distributed(x, collective):
    """This rank's gradient of its own loss sum((r + 1) * y ** 2)."""
    v = tf.Variable(x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((r + 1) * collective(v) ** 2)
    return np.asarray(tape.gradient(loss, v)), np.asarray(collective(v))


@check("gradient_conventions")
def gradient_conventions():
    # allgather: Horovod averages the incoming gradients (its
    # _allgather_grad): this rank's rows of sum_k 2 (k+1) y / n.
    xs = inputs(lambda k: (k + 1, 2))
    got, _ = distributed(xs[r], lambda v: kd.allgather(v, name="gc.gather"))
    weight = sum(k + 1 for k in range(n))
    expect(got, 2 * weight * xs[r] / n, "allgather: Horovod's formula",
           1e-12)
    truth = single_process(xs, lambda vs: [tf.concat(vs, 0)] * n)
    expect(got, truth / n, "allgather: truth / size()", 1e-12)
    # broadcast: the root gets the average of every rank's gradient.
    root = n - 1
    xs = inputs(lambda k: (3,))
    got, _ = distributed(xs[r], lambda v: kd.broadcast(v, root,
                                                       name="gc.bcast"))
    want = 2 * weight * xs[root] / n if r == root else np.zeros(3)
    expect(got, want, "broadcast: Horovod's formula", 1e-12)
    truth = single_process(xs, lambda vs: [vs[root]] * n)
    expect(got, truth / n, "broadcast: truth / size()", 1e-12)
    # reducescatter: the allgather of the incoming gradients times the
    # scale factors, times size() for Sum (Horovod's _reducescatter_grad).
    rows = 2 * n + 1
    counts = [rows // n + (k < rows % n) for k in range(n)]
    xs = inputs(lambda k: (rows, 2))
    for op, pre, post in ((kd.Sum, 1.0, 1.0), (kd.Average, 1.0, 1.0),
                          (kd.Sum, 0.5, 3.0), (kd.Average, 2.0, 0.25)):
        name = f"gc.rs.{op}.{pre}.{post}"
        got, y = distributed(xs[r], lambda v: kd.reducescatter(
            v, op=op, prescale_factor=pre, postscale_factor=post, name=name))
        # Every rank's y and incoming gradient 2 (k+1) y_k, from numpy.
        total = sum(xs) * pre * post / (n if op == kd.Average else 1)
        pieces = np.split(total, np.cumsum(counts)[:-1])
        expect(y, pieces[r], f"reducescatter {op} value", 1e-12)
        incoming = np.concatenate([2 * (k + 1) * p
                                   for k, p in enumerate(pieces)])
        horovod = incoming * pre * post * (n if op == kd.Sum else 1)
        expect(got, horovod, f"reducescatter {op} {pre} {post}: Horovod's "
               "formula", 1e-12)

        def scattered(vs, op=op, pre=pre, post=post):
            t = tf.add_n([v * pre for v in vs]) * post
            if op == kd.Average:
                t = t / n
            return tf.split(t, counts, 0)

        truth = single_process(xs, scattered)
        expect(got, truth * n, f"reducescatter {op}: truth * size()", 1e-12)
    # allreduce: the same allreduce of the incoming gradients, which is the
    # truth (Sum and Average, with scale factors).
    xs = inputs(lambda k: (4,))
    for op, pre, post in ((kd.Sum, 1.0, 1.0), (kd.Average, 0.5, 4.0)):
        got, _ = distributed(xs[r], lambda v: kd.allreduce(
            v, op=op, prescale_factor=pre, postscale_factor=post,
            name=f"gc.ar.{op}"))

        def reduced(vs, op=op, pre=pre, post=post):
            t = tf.add_n([v * pre for v in vs]) * post
            return [t / n if op == kd.Average else t] * n

        expect(got, single_process(xs, reduced), f"allreduce {op}: truth",
               1e-12)


@check("integer_scaling")
def integer_scaling():
    # Horovod scales integers in float64 and truncates toward zero (its
    # ScaleBufferCPUImpl; test_horovod_allreduce_cpu_prescale's formula).
    signed = np.array([-7, 7, -21, 5, -5, 29, 0, 3])  # n * 29 fits int8
    for dt in (tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16):
        x = tf.cast(np.abs(signed) if dt.is_unsigned else signed, dt)
        xf = tf.cast(x, tf.float64)
        for f in (0.75, 0.375, 0.5):
            got = kd.allreduce(x, op=kd.Sum, prescale_factor=f,
                               name=f"is.pre.{dt.name}.{f}")
            # Horovod's test: tf.cast(factor * tensor, dtype) * size
            want = as_f64(tf.cast(f * xf, dt)) * n
            expect(as_f64(got), want, f"prescale {f} {dt.name}")
            got = kd.allreduce(x, op=kd.Sum, postscale_factor=f,
                               name=f"is.post.{dt.name}.{f}")
            want = tf.cast(f * (xf * n), dt)
            expect(as_f64(got), as_f64(want), f"postscale {f} {dt.name}")
            # Average with a postscale: the sum times post / size,
            # truncated (Horovod divides the postscale by size).
            got = kd.allreduce(x, op=kd.Average, postscale_factor=f,
                               name=f"is.avg.{dt.name}.{f}")
            want = np.trunc(as_f64(x) * n * (f / n))
            expect(as_f64(got), want, f"average, postscale {f} {dt.name}")
    # One case spelled out: 5 x 0.75 = 3.75 is 3, -5 x 0.75 is -3.
    got = kd.allreduce(tf.constant([5, -5], tf.int32), op=kd.Sum,
                       prescale_factor=0.75, name="is.spelled")
    expect(got, [3 * n, -3 * n], "5 and -5 times 0.75")


@check("indexed_slices_horovod")
def indexed_slices_horovod():
    def slices():
        return tf.IndexedSlices(tf.constant([[1.0 * r, 2.0]]),
                                tf.constant([r]),
                                dense_shape=tf.constant([n, 2]))
    for op in (kd.Min, kd.Max, kd.Product):
        expect_raises(NotImplementedError,
                      lambda: kd.allreduce(slices(), op=op), "Sum")
        expect_raises(NotImplementedError, lambda: kd.grouped_allreduce(
            [slices(), tf.ones([2])], op=op), "Sum")
    for kw in ({"prescale_factor": 0.5}, {"postscale_factor": 2.0}):
        expect_raises(NotImplementedError, lambda: kd.allreduce(
            slices(), op=kd.Sum, **kw), "prescale_factor")
        expect_raises(NotImplementedError, lambda: kd.grouped_allreduce(
            [slices()], op=kd.Sum, **kw), "prescale_factor")
    dense_rows = np.stack([[1.0 * k, 2.0] for k in range(n)])
    got = kd.grouped_allreduce([slices(), tf.constant(vals(r)), slices()],
                               op=kd.Sum, name="is.group")
    for i in (0, 2):
        if not isinstance(got[i], tf.IndexedSlices):
            raise AssertionError(f"member {i}: {type(got[i])}")
        expect(tf.convert_to_tensor(got[i]), dense_rows, f"member {i}")
    expect(got[1], stack.sum(0), "dense member")
    avg = kd.grouped_allreduce([slices()], average=True, name="is.avg")[0]
    # float32 rows divided by n (1/3 is not exact in float32 at np=3).
    expect(tf.convert_to_tensor(avg), dense_rows / n, "average", 1e-6)


@check("error_types")
def error_types():
    failed = tf.errors.FailedPreconditionError
    expect_raises(failed, lambda: kd.allreduce(
        tf.ones([2 + (r == n - 1)]), name="et.shape"), "Mismatched shape",
        "'et.shape'")
    expect_raises(failed, lambda: kd.allreduce(
        tf.ones([2], tf.float32 if r == 0 else tf.float64),
        name="et.dtype"), "Mismatched dtype")
    expect_raises(failed, lambda: kd.broadcast(tf.ones([2]), r,
                                               name="et.root"),
                  "Mismatched root rank")
    expect_raises(failed, lambda: kd.allgather(
        tf.ones([2, 1 + r]), name="et.gather"), "Mismatched shape")
    expect_raises(failed, lambda: kd.reducescatter(
        tf.ones([2 * n + r]), name="et.rs"), "Mismatched shape")
    # alltoall whose first dimension does not divide: refused on each rank,
    # InvalidArgumentError as in Horovod.
    expect_raises(tf.errors.InvalidArgumentError, lambda: kd.alltoall(
        tf.ones([n + 1]), name="et.a2a"), "divisible")
    # The runtime goes on after each.
    expect(kd.allreduce(tf.ones([2]), op=kd.Sum, name="et.after"), [n, n],
           "after the errors")


# ---- XLA: tf.function(jit_compile=True) (ops/tf/xla_kernels.cc) ----------


def xla_targets(fn, *args):
    """The kerasdist custom calls in the HLO XLA compiles `fn` to: proof
    that the collectives were lowered, not run some other way."""
    hlo = fn.experimental_get_compiler_ir(*args)(stage="hlo")
    return {t for t in ("allreduce", "grouped_allreduce", "allgather",
                        "broadcast", "alltoall", "reducescatter", "barrier")
            if f'custom_call_target="kerasdist_{t}"' in hlo}


# Every rank must compile the same program: XLA runs the collectives of a
# step one after another in the order it scheduled them, so a rank whose
# program differs (a Python constant of its rank folded into the step) may
# order them differently and wait (the runtime's deadlock check then ends
# the job). Hence the rank comes in as a tensor here, as data do in a step.
@check("xla_collectives")
def xla_collectives():
    @tf.function(jit_compile=True)
    def fn(x, i, rank):
        y = x * 1.0  # a computation of XLA's own around the calls
        rows = tf.fill([2 * n, 1], rank)
        kd.barrier(name="x.barrier")
        return (kd.allreduce(y, op=kd.Sum, name="x.sum"),
                kd.allreduce(y, name="x.avg", prescale_factor=2.0),
                kd.grouped_allreduce([y, y[:2] * 2.0, i], op=kd.Sum,
                                     name="x.group"),
                kd.allgather(tf.reshape(y, [1, 5]), name="x.gather"),
                kd.broadcast(y + 1.0, n - 1, name="x.bcast"),
                kd.alltoall(rows, name="x.a2a"),
                kd.reducescatter(tf.ones([2 * n + 1, 2], tf.float64)
                                 * (rank + 1.0), op=kd.Sum, name="x.rs"))

    args = (tf.constant(vals(r)), tf.constant([r], tf.int32),
            tf.constant(float(r), tf.float64))
    lowered = xla_targets(fn, *args)
    if lowered != {"allreduce", "grouped_allreduce", "allgather", "broadcast",
                   "alltoall", "reducescatter", "barrier"}:
        raise AssertionError(f"not lowered to custom calls: {lowered}")
    for rep in range(2):  # the second call runs the compiled program again
        s, avg, group, gathered, b, a2a, rs = fn(*args)
        expect(s, stack.sum(0), "xla sum")
        expect(avg, 2.0 * stack.mean(0), "xla prescaled average", 1e-12)
        expect(group[0], stack.sum(0), "xla group 0")
        expect(group[1], 2.0 * stack[:, :2].sum(0), "xla group 1")
        expect(group[2], [n * (n - 1) // 2], "xla group int")
        expect(gathered, stack, "xla allgather")
        expect(b, vals(n - 1) + 1.0, "xla broadcast")
        expect(a2a, np.repeat(np.arange(n, dtype=np.float64), 2)[:, None],
               "xla alltoall")
        # 2n+1 rows: rank 0 keeps 3, the others 2.
        expect(rs, np.full([2 + (r == 0), 2], n * (n + 1) / 2),
               "xla reducescatter")


@check("xla_gradients")
def xla_gradients():
    x = tf.Variable(vals(r))

    @tf.function(jit_compile=True)
    def grads(rank):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(kd.allreduce(x * x, op=kd.Sum, name="xg.sum"))
        plain = tape.gradient(y, x)
        with kd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = tf.reduce_sum(x * x) * (rank + 1.0)
        return plain, tape.gradient(loss, x)

    plain, averaged = grads(tf.constant(float(r), tf.float64))
    expect(plain, n * 2 * vals(r), "xla grad allreduce sum")
    # The average over ranks of 2 (k+1) x_k.
    expect(averaged, np.mean([2 * (k + 1) * vals(k) for k in range(n)], 0),
           "xla DistributedGradientTape", 1e-12)
    xla_tape_buckets_and_sparse()


def xla_tape_buckets_and_sparse():
    """DistributedGradientTape in tf.function(jit_compile=True) with its
    buckets (one grouped allreduce custom call each) and a tf.IndexedSlices
    gradient (an Embedding's: allgathered values and indices), against the
    average of every rank's gradients worked out here."""
    ws = [tf.Variable(np.full([64, 64], 1.0 + i)) for i in range(4)]
    table = tf.Variable(np.arange(12.0).reshape(6, 2))

    @tf.function(jit_compile=True)
    def step(rank, ids):
        with tf.GradientTape() as t:
            loss = (sum(tf.reduce_sum(w * w) for w in ws)
                    + tf.reduce_sum(tf.gather(table, ids))) * (rank + 1.0)
        # 32 KiB a weight, buckets of at most 40 KiB: one a weight.
        tape = kd.DistributedGradientTape(t, overlap=True, bucket_bytes=40000)
        return tape.gradient(loss, ws + [table])

    args = (tf.constant(float(r), tf.float64), tf.constant([r % 6, 5]))
    hlo = step.experimental_get_compiler_ir(*args)(stage="hlo")
    calls = hlo.count('custom_call_target="kerasdist_grouped_allreduce"')
    if calls != 4 or 'custom_call_target="kerasdist_allgather"' not in hlo:
        raise AssertionError(f"expected 4 buckets and an allgather, got "
                             f"{calls} grouped allreduces")
    got = step(*args)
    scale = np.mean([k + 1.0 for k in range(n)])
    for i in range(4):
        expect(got[i], np.full([64, 64], 2 * (1.0 + i) * scale),
               f"xla tape bucket {i}", 1e-12)
    dense = np.zeros([6, 2])
    for k in range(n):
        for row in (k % 6, 5):
            dense[row] += (k + 1.0) / n
    expect(tf.convert_to_tensor(got[4]), dense, "xla tape IndexedSlices",
           1e-12)


@check("xla_errors")
def xla_errors():
    """A rank that disagrees inside a compiled step: a TF error on every
    rank, never a hang; the runtime goes on."""
    @tf.function(jit_compile=True)
    def uneven(x):
        return kd.allreduce(x, op=kd.Sum, name="xe.shape")

    expect_raises(tf.errors.OpError, lambda: uneven(tf.ones([2 + (r == 0)])),
                  "Mismatched shape", "'xe.shape'")

    @tf.function(jit_compile=True)
    def gather(x):
        return kd.allgather(x, name="xe.gather")

    # A first dimension that differs (2 rows on rank 0, 1 elsewhere): the
    # shape XLA sized (n times its own) holds what was gathered on no rank.
    expect_raises(tf.errors.OpError,
                  lambda: gather(tf.ones([1 + (r == 0), 2])),
                  "'xe.gather'", "jit_compile=True")

    @tf.function(jit_compile=True)
    def uneven_split(x):
        return kd.alltoall(x, splits=[n] + [0] * (n - 1), name="xe.a2a")

    expect_raises((tf.errors.UnimplementedError,
                   tf.errors.InvalidArgumentError),
                  lambda: uneven_split(tf.ones([n, 1])), "even split")
    # No XLA kernel: refused while tracing, naming the call and the fix.
    for what, fn in (("join()", lambda x: kd.join() + x),
                     ("rank_op()", lambda x: kd.rank_op() + x)):
        expect_raises(tf.errors.UnimplementedError,
                      lambda: tf.function(fn, jit_compile=True)(
                          tf.constant(1)),
                      f"kerasdist: {what} cannot run inside "
                      "tf.function(jit_compile=True)", "outside the compiled")
    # Where the op library has no XLA kernels (a TF_XLA=0 build, or a GPU,
    # neither of which this job has: the library's answer is overridden),
    # a collective inside XLA is refused the same way, naming it.
    from kerasdist.tensorflow import _native
    kept, _native._xla = _native._xla, False
    try:
        expect_raises(tf.errors.UnimplementedError,
                      lambda: tf.function(
                          lambda x: kd.allreduce(x, name="xe.none"),
                          jit_compile=True)(tf.ones([2])),
                      "kerasdist: allreduce 'xe.none' cannot run inside",
                      "no XLA kernel in this build (built with TF_XLA=0)",
                      "Drop jit_compile=True")
    finally:
        _native._xla = kept
    expect(kd.allreduce(tf.ones([2]), op=kd.Sum, name="xe.after"), [n, n],
           "after the errors")


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
