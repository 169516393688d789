"""Checks every collective of the core against numpy, for every dtype and for
sizes 0, 1, odd and larger than the fusion threshold. Runs at any -np.

argv[1] picks the allreduce path on a single node: "default" (MPI below the
shared-memory minimum, a single-node path above), "cma" (every non-empty
allreduce reads the other ranks in place; those with a prescale factor use
the slots), "shm" (every non-empty allreduce through shared-memory slots),
"mpi" (shared memory off), "mixed" (off on odd ranks only: the ranks must
agree on MPI) or "cma-mixed" (in-place reads off on odd ranks only: they must
agree on the slots) or "hosts" (the single-node paths allowed for every
size, as "cma", in a job that may span hosts: they must be used when all
ranks share one host and never otherwise). The worker checks that the path
was taken. "cma-choice" checks only how the in-place reads are chosen: a
fused batch of small tensors (below KERASDIST_CMA_MIN_TENSOR_BYTES on
average) goes through the slots, one of larger tensors is read in place.

Named checks (tests/support/checks.py): group "collectives", one or more
per collective (allreduce, allreduce_product, grouped_allreduce, allgather,
broadcast, alltoall, reducescatter, barrier, ...) and last allreduce_path
and reducescatter_allgather_path, the checks of the paths taken; group
"ranks" (-np 2 or more: in-place allreduces); group "pieces" (shm and cma at
-np 2 or more: tensors bigger than a shared slot, allreduced,
reduce-scattered and gathered); group "choice" (cma-choice only). Default:
collectives and ranks. A failed check raises, which fails the rank and the job.

    core_collectives_worker.py MODE [--only CHECK,...] [--group G]

Inputs are small integers (rank * stride + i patterns), so results are exact in
every dtype, float16 and bfloat16 included.
"""

import os
import random
import sys
import threading

import numpy as np

import kerasdist as kd
from tests.support import checks
from tests.support.checks import check
from tests.support.collectives import BF16
from tests.support.collectives import allgather
from tests.support.collectives import allreduce
from tests.support.collectives import alltoall
from tests.support.collectives import barrier
from tests.support.collectives import broadcast
from tests.support.collectives import reducescatter
from tests.support.collectives import start_allreduce

THRESHOLD = 4096  # bytes: small, so "larger than the fusion threshold" is cheap
MODE = (sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--")
        else "default")
_rank = int(os.environ.get("PMI_RANK", "0"))
if MODE in ("cma", "hosts"):
    kd.init(fusion_threshold=THRESHOLD, shm_allreduce_min_bytes=1,
            cma_min_tensor_bytes=0)
elif MODE == "cma-choice":
    kd.init(fusion_threshold=1 << 20, shm_allreduce_min_bytes=1)
elif MODE == "shm":
    kd.init(fusion_threshold=THRESHOLD, shm_allreduce_min_bytes=1,
            cma_allreduce=False)
elif MODE == "cma-mixed":
    kd.init(fusion_threshold=THRESHOLD, shm_allreduce_min_bytes=1,
            cma_allreduce=_rank % 2 == 0)
elif MODE == "mpi":
    kd.init(fusion_threshold=THRESHOLD, shm_allreduce=False)
elif MODE == "mixed":
    kd.init(fusion_threshold=THRESHOLD, shm_allreduce=_rank % 2 == 0,
            shm_allreduce_min_bytes=1)
else:
    kd.init(fusion_threshold=THRESHOLD)
r, n = kd.rank(), kd.size()

FLOATS = [np.float16, np.float32, np.float64] + ([BF16] if BF16 else [])
REDUCIBLE = FLOATS + [np.int8, np.int16, np.int32, np.int64, np.uint16]
ALL = REDUCIBLE + [np.uint8, np.bool_]
# the last is > threshold for every dtype
SIZES = [0, 1, 7, 3 * THRESHOLD // 2 + 1]
_done = set()  # the allreduce checks that ran in this job (allreduce_path)


def values(size, rank, dtype, stride=3):
    base = (np.arange(size) % 7 + rank * stride).astype(np.int64)
    return base.astype(dtype)


def expect(got, want, what):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(
            got.astype(np.float64), want.astype(np.float64)):
        raise AssertionError(
            f"{what}: got {got.dtype}{got.shape} {got.ravel()[:8]}, "
            f"want {want.dtype}{want.shape} {want.ravel()[:8]}")


# -- cma-choice only: how the in-place reads are chosen ------------------------
checks.group("choice", default=False)


# (tensors, float32 elements each, read in place?): 64 x 1 KiB averages
# below the 4 KiB default, 8 x 16 KiB above it; both fit one batch.
@check("cma_choice_slots", count=64, elems=256, in_place=False)
@check("cma_choice_in_place", count=8, elems=4096, in_place=True)
def cma_choice(count, elems, in_place):
    from kerasdist._core import capi as _capi

    before = (_capi.backend_runs("shm"), _capi.backend_runs("cma"))
    started = [start_allreduce(np.arange(elems, dtype=np.float32) + r + i,
                               f"choice.{count}.{i}", op=kd.Sum,
                               group=f"choice.{count}", group_size=count)
               for i in range(count)]
    for i, (h, _, out) in enumerate(started):
        h.wait(timeout=120)
        want = np.arange(elems, dtype=np.float32) * n + n * i + n * (n - 1) / 2
        if not np.array_equal(out, want):
            raise AssertionError(f"choice {count} x {elems}: wrong sum")
    # A batch runs on one backend: the single-node ones are shm and cma.
    slots = _capi.backend_runs("shm") - before[0]
    cma = _capi.backend_runs("cma") - before[1]
    shm = slots + cma
    if shm != 1 or cma != (1 if in_place else 0):
        raise AssertionError(
            f"choice {count} x {elems * 4} B: {shm} single-node batches, "
            f"{cma} in place (want 1, {int(in_place)})")


# -- allreduce: every op, dtype and size -----------------------------------
checks.group("collectives")


@check("allreduce")
def check_allreduce():
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for size in SIZES:
            per_rank = [values(size, k, dt) for k in range(n)]
            stack = np.stack([p.astype(np.float64) for p in per_rank])
            x = per_rank[r]
            expect(allreduce(x, f"sum.{dname}.{size}", op=kd.Sum),
                   stack.sum(0).astype(dt), f"sum {dname} {size}")
            expect(allreduce(x, f"min.{dname}.{size}", op=kd.Min),
                   stack.min(0).astype(dt), f"min {dname} {size}")
            expect(allreduce(x, f"max.{dname}.{size}", op=kd.Max),
                   stack.max(0).astype(dt), f"max {dname} {size}")
    _done.add("allreduce")


@check("allreduce_product")
def check_allreduce_product():
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for size in SIZES:
            small = [(np.arange(size) % 2 + 1 + (k % 2)).astype(dt)
                     for k in range(n)]
            expect(allreduce(small[r], f"prod.{dname}.{size}", op=kd.Product),
                   np.prod(np.stack([s.astype(np.float64) for s in small]),
                           0).astype(dt),
                   f"product {dname} {size}")


@check("allreduce_average")
def check_allreduce_average():
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for size in SIZES:
            per_rank = [values(size, k, dt) for k in range(n)]
            stack = np.stack([p.astype(np.float64) for p in per_rank])
            x = per_rank[r]
            avg = allreduce(x, f"avg.{dname}.{size}", op=kd.Average)
            if np.issubdtype(np.dtype(dt), np.integer):
                want = np.trunc(stack.sum(0) / n).astype(dt)  # C division
            else:
                want = (stack.sum(0) * (1.0 / n)).astype(dt)
                # float16/bfloat16 round 1/n: compare in float with a
                # tolerance
                if np.dtype(dt).itemsize == 2:
                    got = avg.astype(np.float64)
                    if not np.allclose(got, stack.sum(0) / n, rtol=1e-2,
                                       atol=1e-2):
                        raise AssertionError(f"average {dname} {size}")
                    continue
            if np.dtype(dt) == np.float32 or np.dtype(dt) == np.float64:
                if not np.allclose(avg, stack.sum(0) / n, rtol=1e-6):
                    raise AssertionError(
                        f"average {dname} {size}: {avg[:5]}")
            else:
                expect(avg, want, f"average {dname} {size}")


# scalar and scale factors (exact in float64)
@check("allreduce_scale_factors_and_scalar")
def check_allreduce_scale_factors_and_scalar():
    expect(allreduce(np.float64(r + 1), "scalar", op=kd.Sum),
           np.float64(n * (n + 1) / 2), "scalar sum")
    x = values(11, r, np.float64)
    stack = np.stack([values(11, k, np.float64) for k in range(n)])
    expect(allreduce(x, "scaled", op=kd.Sum, prescale=2.0, postscale=0.5),
           stack.sum(0), "pre/post scale")
    expect(allreduce(x, "scaled.avg", op=kd.Average, prescale=4.0,
                     postscale=0.25),
           stack.sum(0) / n, "average with factors")
    _done.add("allreduce_scale_factors_and_scalar")


# Integers scale as in Horovod: the product in float64, truncated toward
# zero; an Average with a postscale is the sum times post / size, truncated.
@check("allreduce_integer_scaling")
def check_allreduce_integer_scaling():
    signed = np.array([-7, 7, -21, 5, -5, 29, 0, 3] * 3)  # n * 29 fits int8
    for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16):
        dname = np.dtype(dt).name
        x = (np.abs(signed) if np.dtype(dt).kind == "u" else signed).astype(dt)
        xf = x.astype(np.float64)
        for f in (0.75, 0.375):
            expect(allreduce(x, f"iscale.pre.{dname}.{f}", op=kd.Sum,
                             prescale=f),
                   (np.trunc(xf * f) * n).astype(dt), f"pre {f} {dname}")
            expect(allreduce(x, f"iscale.post.{dname}.{f}", op=kd.Sum,
                             postscale=f),
                   np.trunc(xf * n * f).astype(dt), f"post {f} {dname}")
            expect(allreduce(x, f"iscale.avg.{dname}.{f}", op=kd.Average,
                             postscale=f),
                   np.trunc(xf * n * (f / n)).astype(dt),
                   f"average post {f} {dname}")


# -- shm and cma at -np 2 or more: bigger than one shared slot ----------------
checks.group("pieces", default=False)


@check("allreduce_in_pieces")
def check_allreduce_in_pieces():
    # Bigger than one 64 MiB shared slot: the slots reduce it in pieces (the
    # last one short), the in-place path whole. Sum and Average.
    big = np.arange((16 << 20) + 3, dtype=np.float32) % 1000 + r
    want = (np.arange(big.size, dtype=np.float32) % 1000) * n + n * (n - 1) / 2
    expect(allreduce(big, "sum.pieces", op=kd.Sum), want, "sum in pieces")
    avg = allreduce(big, "avg.pieces", op=kd.Average)
    if not np.allclose(avg, want / n, rtol=1e-6):
        raise AssertionError("average in pieces")
    del big, want, avg


@check("reducescatter_allgather_in_pieces")
def check_reducescatter_allgather_in_pieces():
    # A reducescatter input over one 64 MiB slot (reduced a slot's worth at a
    # time; the ranks' parts straddle the pieces), and an allgather whose
    # parts differ by rank and the largest is over a slot.
    from kerasdist._core import capi as _capi

    before = _capi.backend_runs("shm")
    rows = (16 << 20) + 2 * n + 1
    big = np.arange(rows, dtype=np.float32) % 1000 + r
    counts = [rows // n + (k < rows % n) for k in range(n)]
    start = sum(counts[:r])
    want = (np.arange(start, start + counts[r], dtype=np.float32) % 1000
            ) * n + n * (n - 1) / 2
    expect(reducescatter(big, "rs.pieces", op=kd.Sum), want,
           "reducescatter in pieces")
    del big, want
    parts = [(16 << 20) + 5 * k if k == n - 1 else 1000 + k
             for k in range(n)]
    mine = (np.arange(parts[r], dtype=np.float32) % 977 + r).reshape(-1, 1)
    got = allgather(mine, "ag.pieces")
    off = 0
    for k in range(n):
        part = np.arange(parts[k], dtype=np.float32) % 977 + k
        expect(got[off:off + parts[k], 0], part, f"allgather piece of {k}")
        off += parts[k]
    if off != got.shape[0]:
        raise AssertionError(f"allgather in pieces: {got.shape[0]} rows")
    used = _capi.backend_runs("shm") - before
    if MODE in ("shm", "cma") and used != 2:
        raise AssertionError(f"in pieces: {used} batches on the slots")


# -- -np 2 or more: in place ---------------------------------------------------
checks.group("ranks")


@check("allreduce_in_place")
def check_allreduce_in_place():
    # In place (output == input), fused and not: another rank may still be
    # reading this rank's input while this rank writes its result.
    import ctypes as _ct

    from kerasdist._core import capi as _c
    bufs = [values(size, r, np.float32)  # big ones alone, small ones fused
            for size in (5000, 5017, 300, 301, 302, 303, 7)]
    handles = []
    for i, b in enumerate(bufs):
        p = b.ctypes.data_as(_ct.c_void_p)
        handles.append(_c.Handle(_c.OP_ALLREDUCE, f"inplace.{i}",
                                 _c.DTYPES[np.dtype(np.float32)], b.shape, p, p,
                                 reduce_op=kd.Sum))
    for i, (h, b) in enumerate(zip(handles, bufs)):
        h.wait(timeout=120)
        want = np.stack([values(b.size, k, np.float32)
                         for k in range(n)]).sum(0)
        expect(b, want, f"in-place sum {i}")


# -- fused: many tensors in flight at once, enqueued in a random order -------
checks.group("collectives")


@check("allreduce_fused_in_random_order")
def check_allreduce_fused_in_random_order():
    rng = random.Random(1234 + r)  # a different order on every rank
    names = list(range(60))
    rng.shuffle(names)
    started = []
    for i in names:
        size = [0, 1, 5, 300, 1100][i % 5]
        dt = [np.float32, np.float64, np.int32][i % 3]
        started.append((i, size, dt, start_allreduce(
            values(size, r, dt, stride=i + 1), f"fused.{i}", op=kd.Sum)))
    for i, size, dt, (h, _, out) in started:
        h.wait(timeout=120)
        want = np.stack([values(size, k, dt, stride=i + 1).astype(np.float64)
                         for k in range(n)]).sum(0).astype(dt)
        expect(out, want, f"fused {i}")


@check("grouped_allreduce")
def check_grouped_allreduce():
    # a group is reduced together
    group = [start_allreduce(values(9 + i, r, np.float32), f"grp.{i}",
                             op=kd.Sum, group="grp", group_size=4)
             for i in range(4)]
    for i, (h, _, out) in enumerate(group):
        h.wait(timeout=120)
        expect(out, np.stack([values(9 + i, k, np.float32)
                              for k in range(n)]).sum(0),
               f"group {i}")


@check("allreduce_from_threads")
def check_allreduce_from_threads():
    # threads enqueueing concurrently
    results = {}

    def worker(t):
        results[t] = allreduce(values(33, r, np.float64, stride=t + 2),
                               f"thread.{t}", op=kd.Sum)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in range(8):
        expect(results[t], np.stack([values(33, k, np.float64, stride=t + 2)
                                     for k in range(n)]).sum(0),
               f"thread {t}")


# -- allgather: first dimension differs per rank -------------------------------
@check("allgather")
def check_allgather():
    for dt in ALL:
        dname = np.dtype(dt).name
        for rows in (0, 1, 3):
            mine = values((rows + r) * 2, r, dt).reshape(rows + r, 2)
            want = np.concatenate([values((rows + k) * 2, k, dt).reshape(
                rows + k, 2) for k in range(n)])
            expect(allgather(mine, f"gather.{dname}.{rows}"), want,
                   f"allgather {dname} {rows}")
    big = values(THRESHOLD + 3, r, np.float32).reshape(-1, 1)
    expect(allgather(big, "gather.big"),
           np.concatenate([values(THRESHOLD + 3, k, np.float32).reshape(-1, 1)
                           for k in range(n)]), "allgather big")


# -- broadcast: every root, every dtype ---------------------------------------
@check("broadcast")
def check_broadcast():
    for dt in ALL:
        dname = np.dtype(dt).name
        for root in range(n):
            for size in SIZES:
                got = broadcast(values(size, r, dt), root,
                                f"bcast.{dname}.{root}.{size}")
                expect(got, values(size, root, dt),
                       f"broadcast {dname} root {root}")
    expect(broadcast(np.int64(r), n - 1, "bcast.scalar"), np.int64(n - 1),
           "broadcast scalar")


# -- alltoall: even and explicit splits ---------------------------------------
@check("alltoall")
def check_alltoall():
    for dt in (np.float32, np.int64, np.float16, np.bool_):
        dname = np.dtype(dt).name
        mine = values(2 * n * 3, r, dt).reshape(2 * n, 3)
        got, splits = alltoall(mine, f"a2a.even.{dname}", size=n)
        want = np.concatenate([values(2 * n * 3, k, dt).reshape(2 * n, 3)[
            2 * r:2 * r + 2] for k in range(n)])
        expect(got, want, f"alltoall even {dname}")
        assert splits == [2] * n, splits

    def splits_of(k):  # rank k sends (k + d) % 3 rows to rank d
        return [(k + d) % 3 for d in range(n)]

    def rows_of(k):
        return values(sum(splits_of(k)) * 2, k, np.float64).reshape(-1, 2)

    got, recv = alltoall(rows_of(r), "a2a.splits", splits=splits_of(r),
                         size=n)
    parts = []
    for k in range(n):
        off = sum(splits_of(k)[:r])
        parts.append(rows_of(k)[off:off + splits_of(k)[r]])
    expect(got, np.concatenate(parts), "alltoall splits")
    assert recv == [splits_of(k)[r] for k in range(n)], recv


# -- reducescatter: rows not divisible by size ---------------------------------
@check("reducescatter")
def check_reducescatter():
    # Every reducible dtype (the slots take them all in "shm"), uneven counts
    # (2n + 1 rows) and ranks with no row (1 row).
    for dt in REDUCIBLE:
        dname = np.dtype(dt).name
        for rows in (n, 2 * n + 1, 1):
            per = [values(rows * 3, k, dt).reshape(rows, 3)
                   for k in range(n)]
            total = np.stack([p.astype(np.float64) for p in per]).sum(0)
            counts = [rows // n + (k < rows % n) for k in range(n)]
            start = sum(counts[:r])
            got = reducescatter(per[r], f"rs.{dname}.{rows}", op=kd.Sum)
            expect(got, total[start:start + counts[r]].astype(dt),
                   f"reducescatter {dname} {rows}")


@check("reducescatter_ops_and_scaling")
def check_reducescatter_ops_and_scaling():
    # Min, Max, Product, and Average with factors (exact in float64 and
    # int32: the factors are powers of two), larger than the fusion
    # threshold and uneven.
    rows = 2 * n + 1
    counts = [rows // n + (k < rows % n) for k in range(n)]
    start = sum(counts[:r])
    mine = slice(start, start + counts[r])
    for dt in (np.float64, np.int32, np.float16):
        dname = np.dtype(dt).name
        per = [values(rows * 301, k, dt).reshape(rows, 301)
               for k in range(n)]
        small = [(np.arange(rows * 301) % 2 + 1 + (k % 2)).astype(dt).reshape(
            rows, 301) for k in range(n)]
        stack = np.stack([p.astype(np.float64) for p in per])
        for op, want in ((kd.Min, stack.min(0)), (kd.Max, stack.max(0))):
            expect(reducescatter(per[r], f"rs.op{op}.{dname}", op=op),
                   want[mine].astype(dt), f"reducescatter op {op} {dname}")
        prod = np.prod(np.stack([s.astype(np.float64) for s in small]), 0)
        expect(reducescatter(small[r], f"rs.prod.{dname}", op=kd.Product),
               prod[mine].astype(dt), f"reducescatter product {dname}")
    per = [values((2 * n + 1) * 301, k, np.float64).reshape(-1, 301)
           for k in range(n)]
    total = np.stack(per).sum(0)
    expect(reducescatter(per[r], "rs.scaled", op=kd.Sum, prescale=2.0,
                         postscale=0.5), total[mine], "reducescatter scaled")
    avg = reducescatter(per[r], "rs.avg", op=kd.Average, prescale=4.0,
                        postscale=0.25)
    if not np.allclose(avg, total[mine] / n, rtol=1e-12):
        raise AssertionError(f"reducescatter average: {avg.ravel()[:5]}")
    ints = [p.astype(np.int32) for p in per]
    expect(reducescatter(ints[r], "rs.avg.int32", op=kd.Average),
           np.trunc(total[mine] / n).astype(np.int32),
           "reducescatter average int32")  # C division


@check("barrier")
def check_barrier():
    for i in range(3):
        barrier(f"barrier.{i}")


# -- last: the path this job's allreduces took -------------------------------
@check("allreduce_path")
def check_allreduce_path():
    """The single-node paths the job's allreduces used against MODE's. Needs
    the allreduces of allreduce and allreduce_scale_factors_and_scalar (the
    slots in "cma" take those with a prescale factor): it runs those two
    first when the job did not select them."""
    from kerasdist._core import capi as _capi

    if "allreduce" not in _done:
        check_allreduce()
    if "allreduce_scale_factors_and_scalar" not in _done:
        check_allreduce_scale_factors_and_scalar()
    slots_used = _capi.backend_runs("shm")
    cma_used = _capi.backend_runs("cma")
    shm_used = slots_used + cma_used
    # (single-node path used, in-place reads used, slots used); None: either.
    expected = {"default": (n > 1, None, None), "cma": (n > 1, n > 1, n > 1),
                "shm": (n > 1, False, n > 1), "mpi": (False, False, False),
                "mixed": (False, False, False),
                "cma-mixed": (n > 1, False, n > 1),
                "hosts": (n > 1 and kd.local_size() == n, None, None)}[MODE]
    for what, used, want in zip(("single-node", "in-place", "slot"),
                                (shm_used, cma_used, slots_used), expected):
        if want is not None and (used > 0) != want:
            raise AssertionError(
                f"mode {MODE} at np={n}: {used} {what} allreduces "
                f"({shm_used} single-node, {cma_used} in place)")
    print(f"OK path {MODE}: {shm_used} single-node allreduces, {cma_used} of "
          "them in place", flush=True)


@check("reducescatter_allgather_path")
def check_reducescatter_allgather_path():
    """Whether a reducescatter of n x 16 KiB and an allgather of n x n x 16
    KiB ran on the slots (backend "shm", which takes both, also beside the
    in-place reads): on one node at np > 1 in every mode but "mpi" and
    "mixed" ("default": above its 16 KiB minimum)."""
    from kerasdist._core import capi as _capi

    want = n > 1 and MODE not in ("mpi", "mixed")
    if MODE == "hosts":
        want = n > 1 and kd.local_size() == n
    x = values(n * 4096, r, np.float32).reshape(n * 4, 1024)
    for what, run in (
            ("reducescatter", lambda: reducescatter(x, "path.rs", op=kd.Sum)),
            ("allgather", lambda: allgather(x, "path.ag"))):
        before = _capi.backend_runs("shm")
        run()
        used = _capi.backend_runs("shm") - before
        if used != int(want):
            raise AssertionError(f"mode {MODE} at np={n}: {what} of "
                                 f"{x.nbytes} B ran {used} times on the "
                                 "slots")
    print(f"OK rs/ag path {MODE}: slots {want}", flush=True)


if __name__ == "__main__":
    checks.main(rank=r)
    kd.shutdown()
