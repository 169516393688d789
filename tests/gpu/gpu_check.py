"""Drives libkerasdist_core's GPU path from cupy arrays (no TensorFlow).

Run by tests/gpu/run_on_gpu.sh on every rank under the launcher:

    python -m kerasdist.run -np 1 python tests/gpu/gpu_check.py \
        --lib /tmp/x/libkerasdist_core_nccl.so --bench
    KERASDIST_GPU_OPERATIONS=MPI python -m kerasdist.run -np 2 \
        python tests/gpu/gpu_check.py --lib /tmp/x/libkerasdist_core_nccl.so

Every collective runs on device memory (device=0) and is checked against
numpy; inputs are `rank * 1000 + i` so float sums are exact. `--bench`
prints an nccl-tests style table of float32 allreduce from 1 MiB to 256 MiB,
kerasdist next to cupy's own NCCL bindings doing the same allreduce.
Exit status 0 means every check passed on this rank.
"""

import argparse
import os
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from kerasdist._core import capi as _capi  # noqa: E402

TIMEOUT_S = 60


def _setup(lib_path):
    _capi.library_path = lambda: lib_path
    lib = _capi.lib()
    if not lib.kerasdist_nccl_built():
        sys.exit(f"{lib_path} was built without the GPU backend")
    if lib.kerasdist_init(0, 0, b"") != 0:
        sys.exit(f"kerasdist_init failed: {_capi.last_error()}")
    return lib


def _ptr(a):
    return a.data.ptr if a.size else None


def _run(op, name, x, out, **kw):
    import cupy as cp
    # The core's stream does not wait for cupy's: finish producing first.
    cp.cuda.get_current_stream().synchronize()
    h = _capi.Handle(op, name, _capi.DTYPES[np.dtype(x.dtype)], x.shape,
                     _ptr(x), _ptr(out), device=0, **kw)
    return h


def _mine(rank, n, dtype):
    return (rank * 1000 + np.arange(n) % 1000).astype(dtype)


class Checker:
    def __init__(self, rank, size):
        self.rank, self.size, self.count, self.failed = rank, size, 0, []

    def expect(self, what, got, want, rtol=0):
        import cupy as cp
        got = cp.asnumpy(got)
        try:
            if rtol:
                np.testing.assert_allclose(got, want, rtol=rtol)
            else:
                np.testing.assert_array_equal(got, want)
            self.count += 1
        except AssertionError as e:
            self.failed.append(f"{what}: {str(e)[:400]}")


def check_collectives(c):
    import cupy as cp
    r, n = c.rank, c.size
    for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64):
        tag = np.dtype(dtype).name
        x = cp.asarray(_mine(r, 1000, dtype))
        total = sum(_mine(k, 1000, dtype).astype(np.float64) for k in range(n))
        out = cp.empty_like(x)
        _run(_capi.OP_ALLREDUCE, f"sum.{tag}", x, out,
             reduce_op=1).wait(TIMEOUT_S)
        c.expect(f"allreduce sum {tag}", out, total.astype(dtype))
        # Average with both scale factors, on the GPU kernel (floats only:
        # integer Average is a truncating division, checked below).
        if np.dtype(dtype).kind == "f":
            _run(_capi.OP_ALLREDUCE, f"avg.{tag}", x, out, reduce_op=0,
                 prescale=0.5, postscale=4.0).wait(TIMEOUT_S)
            rtol = 1e-3 if dtype == np.float16 else 1e-6
            c.expect(f"allreduce average*scales {tag}", out,
                     (total * 2.0 / n).astype(dtype), rtol=rtol)
    xi = cp.asarray(_mine(r, 100, np.int32))
    oi = cp.empty_like(xi)
    _run(_capi.OP_ALLREDUCE, "avg.int32", xi, oi, reduce_op=0).wait(TIMEOUT_S)
    want = sum(_mine(k, 100, np.int64) for k in range(n)) // n
    c.expect("allreduce average int32", oi, want.astype(np.int32))

    # Tensor Fusion on the device: several tensors enqueued together share
    # one fusion buffer and one collective (the coordinator decides).
    xs = [cp.asarray(_mine(r, 257 + 31 * k, np.float32)) for k in range(8)]
    outs = [cp.empty_like(v) for v in xs]
    cp.cuda.get_current_stream().synchronize()
    hs = [_capi.Handle(_capi.OP_ALLREDUCE, f"fused.{k}",
                       _capi.DTYPES[np.dtype(np.float32)],
                       v.shape, _ptr(v), _ptr(o), reduce_op=1, device=0)
          for k, (v, o) in enumerate(zip(xs, outs))]
    for h in hs:
        h.wait(TIMEOUT_S)
    for k, o in enumerate(outs):
        c.expect(f"fused allreduce #{k}", o,
                 sum(_mine(q, 257 + 31 * k, np.float32) for q in range(n)))

    # In place (output == input), as a TF kernel may forward its input.
    y = cp.asarray(_mine(r, 4096, np.float32))
    _run(_capi.OP_ALLREDUCE, "inplace", y, y, reduce_op=1).wait(TIMEOUT_S)
    c.expect("allreduce in place", y,
             sum(_mine(q, 4096, np.float32) for q in range(n)))

    # Allgather with uneven first dimensions: rank q contributes q+1 rows.
    cols = 5
    g_in = cp.asarray(_mine(r, (r + 1) * cols, np.float32).reshape(r + 1, cols))
    g_out = cp.empty((sum(q + 1 for q in range(n)), cols), np.float32)
    _run(_capi.OP_ALLGATHER, "gather", g_in, g_out).wait(TIMEOUT_S)
    c.expect("allgather uneven", g_out, np.concatenate(
        [_mine(q, (q + 1) * cols, np.float32).reshape(q + 1, cols)
         for q in range(n)]))

    for root in range(n):
        b_in = cp.asarray(_mine(r, 3000, np.float32))
        b_out = cp.empty_like(b_in)
        _run(_capi.OP_BROADCAST, f"bcast.{root}", b_in, b_out,
             root_rank=root).wait(TIMEOUT_S)
        c.expect(f"broadcast root {root}", b_out, _mine(root, 3000, np.float32))

    a_in = cp.asarray(np.repeat(np.arange(n) + 100 * r, 3).astype(np.float32))
    a_out = cp.empty_like(a_in)
    _run(_capi.OP_ALLTOALL, "alltoall", a_in, a_out).wait(TIMEOUT_S)
    c.expect("alltoall", a_out,
             np.repeat(np.array([100 * q + r for q in range(n)]),
                       3).astype(np.float32))

    rows = 2 * n + 1  # uneven: rank 0 gets one row more
    s_in = cp.asarray(_mine(r, rows * 4, np.float32).reshape(rows, 4))
    mine_rows = rows // n + (1 if r < rows % n else 0)
    s_out = cp.empty((mine_rows, 4), np.float32)
    _run(_capi.OP_REDUCESCATTER, "rs", s_in, s_out, reduce_op=1).wait(TIMEOUT_S)
    total = sum(_mine(q, rows * 4, np.float32).reshape(rows, 4)
                for q in range(n))
    start = sum(rows // n + (1 if q < rows % n else 0) for q in range(r))
    c.expect("reducescatter uneven", s_out, total[start:start + mine_rows])


def _busbw(algbw, n):
    return algbw * 2 * (n - 1) / n  # nccl-tests' allreduce bus bandwidth


def bench(rank, size, iters):
    import cupy as cp
    nccl = None
    try:
        from cupy.cuda import nccl as cupy_nccl
        uid = cupy_nccl.get_unique_id() if size == 1 else None
        if size == 1:  # two ranks on one GPU: NCCL refuses, skip cupy's column
            nccl = cupy_nccl.NcclCommunicator(1, uid, 0)
    except Exception as e:  # noqa: BLE001 - report and carry on
        print(f"# cupy.cuda.nccl unavailable: {e}")
    if rank == 0:
        print("#\n# float32 allreduce (sum), device memory, "
              f"{size} rank(s), "
              f"{os.environ.get('KERASDIST_GPU_OPERATIONS', 'NCCL')}")
        print(f"# {'size(B)':>10} {'count':>10} {'type':>6} | kerasdist "
              f"{'time(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
              f"| cupy.nccl {'time(us)':>9} {'algbw':>7}")
    stream = cp.cuda.Stream(non_blocking=True)
    for mib in (1, 4, 16, 64, 256):
        nbytes = mib << 20
        count = nbytes // 4
        x = cp.full(count, rank + 1, np.float32)
        out = cp.empty_like(x)
        its = iters if mib < 64 else max(3, iters // 4)
        times = []
        for i in range(its + 2):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            h = _capi.Handle(_capi.OP_ALLREDUCE, f"bench.{mib}", 2, x.shape,
                             _ptr(x), _ptr(out), reduce_op=1, device=0)
            h.wait(TIMEOUT_S)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times[2:]))
        want = size * (size + 1) / 2
        wrong = int(cp.count_nonzero(out != want).get())
        ct = float("nan")
        if nccl is not None:
            ctimes = []
            for i in range(its + 2):
                stream.synchronize()
                t0 = time.perf_counter()
                nccl.allReduce(x.data.ptr, out.data.ptr, count,
                               cupy_nccl.NCCL_FLOAT32, cupy_nccl.NCCL_SUM,
                               stream.ptr)
                stream.synchronize()
                ctimes.append(time.perf_counter() - t0)
            ct = float(np.median(ctimes[2:]))
        if rank == 0:
            alg = nbytes / t / 1e9
            calg = nbytes / ct / 1e9 if ct == ct else float("nan")
            print(f"  {nbytes:>10} {count:>10} {'float':>6} | kerasdist "
                  f"{t * 1e6:>9.1f} {alg:>7.2f} {_busbw(alg, size):>7.2f} "
                  f"{wrong:>6} | cupy.nccl {ct * 1e6:>9.1f} {calg:>7.2f}",
                  flush=True)
        if wrong:
            return False
        del x, out
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True,
                   help="libkerasdist_core built with NCCL (make gpu-check)")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    import cupy as cp
    cp.cuda.Device(0).use()
    lib = _setup(args.lib)
    rank, size = lib.kerasdist_rank(), lib.kerasdist_size()
    mode = os.environ.get("KERASDIST_GPU_OPERATIONS", "NCCL")
    c = Checker(rank, size)
    t0 = time.perf_counter()
    try:
        check_collectives(c)
    except _capi.KerasdistError as e:
        c.failed.append(f"collective failed: {e}")
    ok = not c.failed
    for f in c.failed:
        print(f"rank {rank}: FAIL {f}", flush=True)
    if ok and args.bench:
        ok = bench(rank, size, args.iters)
    lib.kerasdist_shutdown()
    print(f"rank {rank}/{size} ({mode}): {c.count} device checks "
          f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
