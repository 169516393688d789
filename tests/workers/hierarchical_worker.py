"""Worker for tests/cluster/test_hierarchical.py: one rank of a job across
test hosts, allreducing through the C API (no TensorFlow).

    hierarchical_worker.py check OUT   # allreduces; results to OUT/rank<r>.npz
    hierarchical_worker.py bytes MIB   # one allreduce of MIB MiB float32

`check`: prints `BACKENDS <list>`, then allreduces int32/int64 (Sum and
Average) and float32/float64 (Sum) as single tensors of several sizes and
as batches of tensors started together (which the runtime fuses), and
allgathers int32/float64 tensors whose first dimension differs by rank
(printing `GATHERS hier=N`, the batches the hier backend ran for them), checks
each result against numpy (integers exactly; floats within the summation
error bound, see _float_bound), saves every result to OUT/rank<r>.npz for
the test to compare with another run's, and prints `RUNS hier=N mpi=M` (the
batches each backend ran) and `OK`.

`bytes`: a barrier, one allreduce of MIB MiB float32 (checked), a barrier:
the test reads the hosts' link counters around the whole job.

The inputs depend only on (rank, case name), so two jobs with the same
layout reduce the same numbers whatever their settings.
"""

import os
import sys
import zlib

import numpy as np

import kerasdist as kd
from kerasdist._core import capi as _capi
from tests.support.collectives import allgather
from tests.support.collectives import allreduce
from tests.support.collectives import barrier
from tests.support.collectives import start_allreduce

INT_TYPES = (np.int32, np.int64)
FLOAT_TYPES = (np.float32, np.float64)
SIZES = (1, 1000, 300_000)             # the last is 1.2 / 2.4 MiB
BATCH = (3, 100, 1, 4096, 17, 70_000)  # one batch: small tensors among them


def inputs(case, rank, count, dtype):
    """The deterministic input of `rank` for `case`."""
    rng = np.random.default_rng([zlib.crc32(case.encode()), rank])
    if np.issubdtype(dtype, np.integer):
        # |sum| < 2^31 for up to 8 ranks: no overflow in any order.
        return rng.integers(-2**27, 2**27, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype) * 100


def _float_bound(stack, dtype):
    """Elementwise bound on |computed - exact| for a sum of n floats in any
    order: recursive summation errs by at most (n-1) u sum|x_i| (u = eps/2,
    Higham, Accuracy and Stability, 4.2); eps instead of u leaves room for
    the one extra rounding of the final conversion."""
    n = stack.shape[0]
    eps = np.finfo(dtype).eps
    return (n - 1) * eps * np.abs(stack).sum(0) + np.finfo(dtype).tiny


def check(case, got, n, count, dtype, op):
    stack = np.stack([inputs(case, k, count, dtype) for k in range(n)])
    if np.issubdtype(dtype, np.integer):
        total = stack.astype(np.int64).sum(0)
        if op == kd.Average:
            # C's integer division truncates toward zero.
            want = (np.sign(total) * (np.abs(total) // n)).astype(dtype)
        else:
            want = total.astype(dtype)
        ok = got.dtype == want.dtype and np.array_equal(got, want)
    else:
        exact = stack.astype(np.float64).sum(0)
        if op == kd.Average:
            exact = exact / n
        err = np.abs(got.astype(np.float64) - exact)
        ok = got.dtype == np.dtype(dtype) and bool(
            np.all(err <= _float_bound(stack.astype(np.float64), dtype)))
    if not ok:
        print(f"FAIL {case}: got {got.ravel()[:4]}", flush=True)
        sys.exit(1)


def run_checks(out_dir):
    r, n = kd.rank(), kd.size()
    results = {}
    for dtype in INT_TYPES + FLOAT_TYPES:
        ops = ((kd.Sum, "sum"), (kd.Average, "avg")) if np.issubdtype(
            dtype, np.integer) else ((kd.Sum, "sum"),)
        for op, opname in ops:
            dname = np.dtype(dtype).name
            for count in SIZES:
                case = f"single.{opname}.{dname}.{count}"
                got = allreduce(inputs(case, r, count, dtype), case, op=op)
                check(case, got, n, count, dtype, op)
                results[case] = got
            # Started together: one fused batch per dtype and op.
            cases = [f"batch.{opname}.{dname}.{i}" for i in range(len(BATCH))]
            pending = [start_allreduce(inputs(c, r, k, dtype), c, op=op)
                       for c, k in zip(cases, BATCH)]
            for c, k, (h, _, got) in zip(cases, BATCH, pending):
                h.wait(timeout=120)
                check(c, got, n, k, dtype, op)
                results[c] = got
    results.update(run_allgathers())
    np.savez(os.path.join(out_dir, f"rank{r}.npz"), **results)


GATHERS = ((1, 3), (1000, 50))  # rows per rank step, columns


def run_allgathers():
    """Allgathers with rank k sending (k + 1) x rows rows, against numpy."""
    r, n = kd.rank(), kd.size()
    before = _capi.backend_runs("hier")
    results = {}
    for dtype in (np.int32, np.float64):
        for rows, width in GATHERS:
            case = f"allgather.{np.dtype(dtype).name}.{rows}x{width}"
            part = [inputs(case, k, (k + 1) * rows * width, dtype).reshape(
                -1, width) for k in range(n)]
            got = allgather(part[r], case)
            want = np.concatenate(part)
            if got.dtype != want.dtype or not np.array_equal(got, want):
                print(f"FAIL {case}: got shape {got.shape}", flush=True)
                sys.exit(1)
            results[case] = got
    print(f"GATHERS hier={_capi.backend_runs('hier') - before}",
          flush=True)
    return results


def main():
    mode = sys.argv[1]
    kd.init()
    lib = _capi.lib()
    if mode == "check":
        print(f"BACKENDS {lib.kerasdist_backends().decode()}", flush=True)
        run_checks(sys.argv[2])
        print(f"RUNS hier={_capi.backend_runs('hier')} "
              f"mpi={_capi.backend_runs('mpi')}", flush=True)
    elif mode == "bytes":
        # init() itself may run a collective (is_homogeneous' allgather of
        # the local sizes): count this mode's runs only.
        start = _capi.backend_runs("hier")
        n = kd.size()
        count = int(float(sys.argv[2]) * (1 << 20)) // 4
        x = np.ones(count, np.float32) * (kd.rank() + 1)
        barrier("before")
        got = allreduce(x, "bytes", op=kd.Sum)
        barrier("after")
        if not np.all(got == n * (n + 1) / 2):
            print(f"FAIL bytes: {got[:4]}", flush=True)
            sys.exit(1)
        print(f"RUNS hier={_capi.backend_runs('hier') - start}", flush=True)
    else:
        raise SystemExit(f"mode must be check or bytes, got {mode!r}")
    print("OK", flush=True)
    kd.shutdown()


if __name__ == "__main__":
    main()
