"""The JAX and PyTorch front ends against numpy: every collective, dtype, op,
root and scale factor, then gradients against their analytic values. Runs at
any -np.

    frontend_collectives_worker.py jax eager|jit [--only CHECK,...] [--group G]
    frontend_collectives_worker.py torch [--only CHECK,...]

Named checks (tests/support/checks.py), one per collective (allreduce,
allreduce_product, grouped_allreduce, allgather, ...), then gradients, in
group "collectives"; group "jit" (jax jit only) adds the jitted program and
the trace-time names, group "jit_ranks" (jax jit at -np 2 or more) the
errors a mismatch between ranks must raise in jit. Default: collectives
only (`--group collectives,jit,jit_ranks` for all of a jax jit job).
A failed check raises, which fails the rank and the job.

"jit" runs every collective inside `jax.jit` with trace-time names (there
allgather gets the same rows on every rank and alltoall an even split, as
jit requires). Inputs are small integers (rank * stride + i), so results are
exact in every dtype, float16 and bfloat16 included.
"""

import sys

import numpy as np

from tests.support import checks
from tests.support.checks import check
from tests.support.collectives import BF16

_ARGS = [a for a in sys.argv[1:3] if not a.startswith("--")]
FRONT = _ARGS[0] if _ARGS else None
MODE = _ARGS[1] if len(_ARGS) > 1 else "eager"
THRESHOLD = 4096  # bytes: small, so the last size below is fused in pieces
SIZES = [0, 1, 7, 3 * THRESHOLD // 2 + 1]
FLOATS = [np.float16, BF16, np.float32, np.float64]
REDUCIBLE = FLOATS + [np.int8, np.int16, np.int32, np.int64, np.uint16]
ALL = REDUCIBLE + [np.uint8, np.bool_]


def fail(what, got=None, want=None):
    raise AssertionError(f"{FRONT} {MODE} {what}: got {got!r}, "
                         f"want {want!r}")


def expect(got, want, what, tol=0.0):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        fail(what, f"{got.dtype}{got.shape}", f"{want.dtype}{want.shape}")
    if not np.allclose(got.astype(np.float64), want.astype(np.float64),
                       rtol=tol, atol=tol):
        fail(what, got.ravel()[:8], want.ravel()[:8])


def values(size, rank, dtype, stride=3):
    base = (np.arange(size) % 7 + rank * stride).astype(np.int64)
    return base.astype(dtype)


# ---- adapters: numpy in, numpy out -------------------------------------------

if FRONT == "jax":
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)  # float64 and int64 too
    import kerasdist.jax as kd

    def to_fw(a):
        return jnp.asarray(a)

    def to_np(t):
        return np.asarray(t)

    def run(fn, *args):
        """Calls a collective eagerly, or inside a fresh jax.jit."""
        if MODE == "jit":
            return jax.jit(fn)(*args)
        return fn(*args)
elif FRONT == "torch":
    import torch

    import kerasdist.torch as kd

    torch.set_num_threads(1)

    def to_fw(a):
        a = np.asarray(a)
        if a.dtype == BF16:  # numpy has no bfloat16 torch could share
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(a))

    def to_np(t):
        if t.dtype == torch.bfloat16:
            return t.float().numpy().astype(BF16)
        return t.numpy()

    def run(fn, *args):
        return fn(*args)
else:
    raise SystemExit(f"unknown front end {FRONT!r}; expected jax or torch")

kd.init(fusion_threshold=THRESHOLD)
r, n = kd.rank(), kd.size()
JIT = MODE == "jit"


def named(base):
    """Eagerly an explicit name; inside jit None, to use the trace's names."""
    return None if JIT else base


checks.group("collectives")
OPS = {"sum": (kd.Sum, np.sum), "min": (kd.Min, np.min),
       "max": (kd.Max, np.max)}


# ---- allreduce: every op, dtype and size -------------------------------------
@check("allreduce")
def allreduce():
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for size in SIZES:
            per_rank = [values(size, k, dt) for k in range(n)]
            stack = np.stack([p.astype(np.float64) for p in per_rank])
            x = to_fw(per_rank[r])
            for key, (op, reduce) in OPS.items():
                got = run(lambda t, op=op, key=key: kd.allreduce(
                    t, op=op, name=named(f"{key}.{dname}.{size}")), x)
                expect(to_np(got), reduce(stack, 0).astype(dt),
                       f"allreduce {key} {dname} {size}")


@check("allreduce_product")
def allreduce_product():
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for size in SIZES:
            small = [(np.arange(size) % 2 + 1 + (k % 2)).astype(dt)
                     for k in range(n)]
            got = run(lambda t: kd.allreduce(
                t, op=kd.Product, name=named(f"prod.{dname}.{size}")),
                to_fw(small[r]))
            expect(to_np(got), np.prod(np.stack(small).astype(np.float64),
                                       0).astype(dt),
                   f"allreduce product {dname} {size}")


@check("allreduce_average")
def allreduce_average():
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for size in SIZES:
            per_rank = [values(size, k, dt) for k in range(n)]
            stack = np.stack([p.astype(np.float64) for p in per_rank])
            x = to_fw(per_rank[r])
            got = to_np(run(lambda t: kd.allreduce(
                t, name=named(f"avg.{dname}.{size}")), x))
            if np.issubdtype(np.dtype(dt), np.integer):
                expect(got, np.trunc(stack.sum(0) / n).astype(dt),
                       f"allreduce average {dname} {size}")
            else:
                # 1/n is rounded to the dtype; 16-bit floats keep ~3 digits.
                tol = 1e-2 if np.dtype(dt).itemsize == 2 else 1e-6
                expect(got, (stack.sum(0) / n).astype(dt),
                       f"allreduce average {dname} {size}", tol)


@check("allreduce_scale_factors_and_scalar")
def allreduce_scale_factors_and_scalar():
    x = values(11, r, np.float64)
    stack = np.stack([values(11, k, np.float64) for k in range(n)])
    expect(to_np(run(lambda t: kd.allreduce(
        t, op=kd.Sum, name=named("scaled"), prescale_factor=2.0,
        postscale_factor=0.5), to_fw(x))),
        stack.sum(0), "allreduce pre/post scale")
    expect(to_np(run(lambda t: kd.allreduce(t, name=named("scaled.avg"),
                                            prescale_factor=4.0,
                                            postscale_factor=0.25),
                     to_fw(x))),
           stack.sum(0) / n, "allreduce average with factors", 1e-12)
    expect(to_np(run(lambda t: kd.allreduce(t, op=kd.Sum,
                                            name=named("scalar")),
                     to_fw(np.float64(r + 1)))),
           np.float64(n * (n + 1) / 2), "allreduce scalar")


@check("grouped_allreduce")
def grouped_allreduce():
    # One call, members fused (mixed dtypes go in separate batches).
    group = [values(9 + i, r, dt) for i, dt in
             enumerate([np.float32, np.float32, np.int32, np.float64])]
    got = run(lambda *ts: kd.grouped_allreduce(list(ts), op=kd.Sum,
                                               name=named("grp")),
              *[to_fw(g) for g in group])
    for i, (g, dt) in enumerate(zip(got, [np.float32, np.float32, np.int32,
                                           np.float64])):
        expect(to_np(g), np.stack([values(9 + i, k, dt)
                                   for k in range(n)]).sum(0).astype(dt),
               f"grouped allreduce {i}")


# ---- allgather: rows differ per rank eagerly, equal inside jit ---------------
@check("allgather")
def allgather():
    for dt in ALL:
        dname = np.dtype(dt).name
        for rows in (0, 1, 3):
            mine_rows = rows if JIT else rows + r

            def rows_of(k):
                return rows if JIT else rows + k
            mine = values(mine_rows * 2, r, dt).reshape(mine_rows, 2)
            want = np.concatenate([values(rows_of(k) * 2, k, dt).reshape(
                rows_of(k), 2) for k in range(n)])
            got = run(lambda t: kd.allgather(
                t, name=named(f"g.{dname}.{rows}")), to_fw(mine))
            expect(to_np(got), want, f"allgather {dname} {rows}")


# ---- broadcast: every root, every dtype --------------------------------------
@check("broadcast")
def broadcast():
    for dt in ALL:
        dname = np.dtype(dt).name
        for root in range(n):
            for size in (0, 1, 7):
                got = run(lambda t, root=root: kd.broadcast(
                    t, root, name=named(f"b.{dname}.{root}.{size}")),
                    to_fw(values(size, r, dt)))
                expect(to_np(got), values(size, root, dt),
                       f"broadcast {dname} root {root} size {size}")


# ---- alltoall: even split, and explicit splits eagerly -----------------------
@check("alltoall")
def alltoall():
    for dt in (np.float32, np.int64, np.float16, np.bool_, BF16, np.int8,
               np.uint16):
        dname = np.dtype(dt).name
        mine = values(2 * n * 3, r, dt).reshape(2 * n, 3)
        # Without splits one result, as in Horovod.
        got = run(lambda t: kd.alltoall(t, name=named(f"a.{dname}")),
                  to_fw(mine))
        want = np.concatenate([values(2 * n * 3, k, dt).reshape(2 * n, 3)[
            2 * r:2 * r + 2] for k in range(n)])
        expect(to_np(got), want, f"alltoall even {dname}")
    if not JIT:
        def splits_of(k):  # rank k sends (k + d) % 3 rows to rank d
            return [(k + d) % 3 for d in range(n)]

        def a2a_rows(k):
            return values(sum(splits_of(k)) * 2, k,
                          np.float64).reshape(-1, 2)

        got, recv = kd.alltoall(to_fw(a2a_rows(r)), splits=splits_of(r),
                                name="a.splits")
        parts = [a2a_rows(k)[sum(splits_of(k)[:r]):][:splits_of(k)[r]]
                 for k in range(n)]
        expect(to_np(got), np.concatenate(parts), "alltoall splits")
        expect(np.asarray(to_np(recv), np.int64),
               np.array([splits_of(k)[r] for k in range(n)], np.int64),
               "alltoall received splits")


# ---- reducescatter: rows not divisible by size, factors ----------------------
@check("reducescatter")
def reducescatter():
    for dt in (np.float32, np.float64, np.int32, np.int64, np.float16, BF16):
        dname = np.dtype(dt).name
        for rows in (n, 2 * n + 1, 1):
            per = [values(rows * 3, k, dt).reshape(rows, 3)
                   for k in range(n)]
            total = np.stack([p.astype(np.float64) for p in per]).sum(0)
            counts = [rows // n + (k < rows % n) for k in range(n)]
            start = sum(counts[:r])
            got = run(lambda t: kd.reducescatter(
                t, op=kd.Sum, name=named(f"rs.{dname}.{rows}")),
                to_fw(per[r]))
            expect(to_np(got), total[start:start + counts[r]].astype(dt),
                   f"reducescatter {dname} {rows}")
    per = [values(4 * n, k, np.float64).reshape(2 * n, 2) for k in range(n)]
    total = np.stack(per).sum(0)
    got = run(lambda t: kd.reducescatter(t, name=named("rs.avg"),
                                         prescale_factor=3.0,
                                         postscale_factor=0.5),
              to_fw(per[r]))
    expect(to_np(got), total[2 * r:2 * r + 2] * 1.5 / n,
           "reducescatter average with factors", 1e-12)


@check("barrier")
def barrier():
    for i in range(3):
        kd.barrier(name=named(f"barrier.{i}"))


# ---- gradients against their analytic values ---------------------------------
def grads_jax(vals):
    """Each loss's gradient on rank r, from jax.grad (eager or jitted)."""
    def grad(loss, x):
        g = jax.grad(loss)
        return np.asarray(jax.jit(g)(x) if JIT else g(x))

    xv = jnp.asarray(vals)
    sq = jnp.asarray(values(2 * n, r, np.float64).reshape(n, 2))
    return {
        "sum": grad(lambda x: kd.allreduce(x * x, op=kd.Sum,
                                           name=named("g.sum")).sum(), xv),
        "avg": grad(lambda x: kd.allreduce(x * x, name=named("g.avg"),
                                           prescale_factor=2.0).sum(), xv),
        "group": grad(lambda x: sum(t.sum() * (i + 1) for i, t in enumerate(
            kd.grouped_allreduce([x, x * x], op=kd.Sum,
                                 name=named("g.grp")))), xv),
        "gather": grad(lambda x: (kd.allgather(x * (r + 1), name=named(
            "g.gather")) ** 2).sum(), xv),
        "bcast": grad(lambda x: (kd.broadcast(x, n - 1, name=named(
            "g.bcast")) * 3.0).sum(), xv),
        "rs": grad(lambda x: (kd.reducescatter(x, name=named("g.rs")) *
                              (r + 1)).sum(), sq),
        "a2a": grad(lambda x: (kd.alltoall(x, name=named("g.a2a")) *
                               (r + 1)).sum(), sq),
    }


def grads_torch(vals):
    def grad(loss, x):
        x = torch.tensor(x, requires_grad=True)
        loss(x).backward()
        return x.grad.numpy()

    sq = values(2 * n, r, np.float64).reshape(n, 2)
    return {
        "sum": grad(lambda x: kd.allreduce(x * x, op=kd.Sum,
                                           name="g.sum").sum(), vals),
        "avg": grad(lambda x: kd.allreduce(x * x, name="g.avg",
                                           prescale_factor=2.0).sum(), vals),
        "group": grad(lambda x: sum(t.sum() * (i + 1) for i, t in enumerate(
            kd.grouped_allreduce([x, x * x], op=kd.Sum, name="g.grp"))),
            vals),
        "gather": grad(lambda x: (kd.allgather(x * (r + 1),
                                               name="g.gather") ** 2).sum(),
                       vals),
        "bcast": grad(lambda x: (kd.broadcast(x, n - 1, name="g.bcast") *
                                 3.0).sum(), vals),
        "rs": grad(lambda x: (kd.reducescatter(x, name="g.rs") *
                              (r + 1)).sum(), sq),
        "a2a": grad(lambda x: (kd.alltoall(x, name="g.a2a") *
                               (r + 1)).sum(), sq),
    }


@check("gradients")
def gradients():
    vals = np.arange(5, dtype=np.float64) + 10 * r
    g = grads_jax(vals) if FRONT == "jax" else grads_torch(vals)
    # allreduce: every rank's loss holds x_r^2 once, and the gradient
    # allreduce sums (Sum) or averages (Average, with the same factors) the
    # ones.
    expect(g["sum"], n * 2 * vals, "grad allreduce sum")
    expect(g["avg"], 2 * 2 * vals, "grad allreduce average x2", 1e-12)
    expect(g["group"], n * (1 + 2 * 2 * vals), "grad grouped allreduce")
    # allgather: every rank's loss holds this rank's slice squared; the
    # gradient averages those of every rank (Horovod's convention), as does
    # broadcast's on the root.
    expect(g["gather"], 2 * (r + 1) ** 2 * vals, "grad allgather")
    expect(g["bcast"], np.full(5, 3.0 if r == n - 1 else 0.0),
           "grad broadcast")
    # reducescatter (Average): rank k's rows weigh (k + 1) / n in every
    # input; Horovod's gradient is size() times that.
    expect(g["rs"], np.repeat(np.arange(1, n + 1.0), 2).reshape(n, 2),
           "grad reducescatter", 1e-12)
    # alltoall: the rows this rank sent to rank k weigh (k + 1).
    expect(g["a2a"], np.repeat(np.arange(1, n + 1.0), 2).reshape(n, 2),
           "grad alltoall")


# ---- jax.jit only: one program, trace-time names, errors between ranks -------
checks.group("jit", default=False)


@check("jit_program")
def jit_program():
    """Many collectives in one jitted program, named at trace time: XLA may
    run them in any order and the core matches them by name."""
    @jax.jit
    def step(x):
        outs = [kd.allreduce(x[:i + 1] * (i + 1), op=kd.Sum)
                for i in range(24)]
        outs.append(kd.broadcast(x, 0))
        outs.append(kd.allgather(x[:2]))
        outs += kd.grouped_allreduce([x, x[:3]], op=kd.Max)
        return outs

    for rep in range(3):  # the second run on uses the compiled program
        x = np.arange(30, dtype=np.float64) + r + rep
        xs = [np.arange(30, dtype=np.float64) + k + rep for k in range(n)]
        outs = step(jnp.asarray(x))
        for i in range(24):
            expect(outs[i], sum(v[:i + 1] for v in xs) * (i + 1),
                   f"program allreduce {i}")
        expect(outs[24], xs[0], "program broadcast")
        expect(outs[25], np.concatenate([v[:2] for v in xs]),
               "program allgather")
        expect(outs[26], np.max(xs, 0), "program grouped max")
        expect(outs[27], np.max(xs, 0)[:3], "program grouped max 2")


@check("jit_allreduce_in_place")
def jit_allreduce_in_place():
    """Inside jax.jit an allreduce's result takes its input's buffer (no
    second copy of a step's gradients), and an input still used after it
    is copied first, never overwritten."""
    def f(x):
        y = kd.allreduce(x * 2.0, op=kd.Sum)  # x * 2 is dead after it
        z = kd.grouped_allreduce([y * 3.0], op=kd.Sum)[0]
        w = kd.allreduce(x, op=kd.Sum)  # x: a live argument
        return z, w, x + 1.0

    x = np.arange(1 << 17, dtype=np.float64) + r
    xs = [np.arange(1 << 17, dtype=np.float64) + k for k in range(n)]
    z, w, x1 = jax.jit(f)(jnp.asarray(x))
    expect(z, sum(sum(v * 2.0 for v in xs) * 3.0 for _ in range(n)),
           "in place: two allreduces")
    expect(w, sum(xs), "in place: allreduce of a live input")
    expect(x1, x + 1.0, "in place: the live input unchanged")
    temp = jax.jit(f).lower(jnp.asarray(x)).compile().memory_analysis()
    if temp.temp_size_in_bytes > 0.5 * x.nbytes:
        fail("in place: XLA keeps a temporary copy of the array",
             temp.temp_size_in_bytes, x.nbytes)


@check("jit_trace_time_names")
def jit_trace_time_names():
    # Trace-time names: numbered per trace and prefixed with the function,
    # so every trace (and every rank) lowers the same names.
    def two(x):
        return kd.allreduce(x), kd.broadcast(kd.allreduce(x * 2), 0)

    import re
    for _ in range(2):
        text = jax.jit(two).lower(jnp.ones(3)).as_text()
        names = re.findall(r'name = "([^"]+)"', text)
        if names != ["allreduce.two.0", "allreduce.two.1", "broadcast.two.0"]:
            fail("trace-time names", names)


# ---- jax.jit at -np 2 or more: a shape only a trace-time guess could get
# wrong must fail on every rank, not hang -------------------------------------
checks.group("jit_ranks", default=False)


@check("jit_uneven_allgather_fails_clearly")
def jit_uneven_allgather_fails_clearly():
    # Rank r sends r + 1 rows: a rank whose trace-time guess (size()
    # times its own rows) misses the rows that arrive fails with the
    # message. At -np 3 rank 1's guess is right (6 rows) and it gets
    # them: the others still take part in the collective (their results
    # land in scratch memory), so it never waits for them.
    rows, total = r + 1, n * (n + 1) // 2
    try:
        got = np.asarray(jax.jit(lambda t: kd.allgather(t))(
            jnp.full([rows, 2], float(r))))
    except Exception as e:  # XLA re-raises the handler's error
        if n * rows == total:
            fail("uneven allgather in jit, the right guess", str(e)[:300])
        if "same first dimension on every rank" not in str(e):
            fail("uneven allgather in jit", str(e)[:300])
    else:
        if n * rows != total:
            fail("uneven allgather in jit", "no error", "an error")
        want = np.concatenate([np.full([k + 1, 2], float(k))
                               for k in range(n)])
        expect(got, want, "uneven allgather in jit, the right guess")
    # Every rank is free for the next collective.
    expect(np.asarray(kd.allreduce(jnp.ones(2), op=kd.Sum,
                                   name="jit.uneven.after")),
           np.full(2, float(n)), "a collective after it")


@check("jit_shape_mismatch_reaches_every_rank")
def jit_shape_mismatch_reaches_every_rank():
    # Another rank's shape reaches the caller as the core's mismatch
    # message, alone and for a group's member; the runtime goes on.
    last = r == n - 1
    for what, fn in (
            ("allreduce", lambda t: kd.allreduce(t, name="jit.shape")),
            ("grouped", lambda t: kd.grouped_allreduce(
                [t, t], name="jit.group"))):
        try:
            out = jax.jit(fn)(jnp.ones(2 + last))
            np.asarray(out if what == "allreduce" else out[1])
        except Exception as e:
            if "Mismatched shape" not in str(e) or "[2]" not in str(e):
                fail(f"{what} shape mismatch in jit", str(e)[:300])
        else:
            fail(f"{what} shape mismatch in jit", "no error", "an error")
    expect(jax.jit(lambda t: kd.allreduce(t, op=kd.Sum))(jnp.ones(3)),
           np.full(3, float(n)), "allreduce after a mismatch in jit")


if __name__ == "__main__":
    checks.main(rank=r)
    kd.shutdown()
