"""Whose buffers make a large allreduce slow: numpy's or TensorFlow's.

    python -m kerasdist.run -np 2 python benchmarks/tf_buffers.py [--size 16M]
        [--rounds 6] [--calls 10]
    python -m kerasdist.run --no-huge-pages -np 2 \\
        python benchmarks/tf_buffers.py

One allreduce (float32 Sum) of SIZE bytes through the C API, no TensorFlow
op involved, on four pairings of input and output buffers: numpy's arrays
(which numpy puts on 2 MiB pages when large), a tf.constant's buffer and
the buffer the TF allreduce op returned (both from TensorFlow's CPU
allocator, i.e. malloc); and, for reference, the same allreduce through one
tf.function call. The systems alternate, CALLS calls each per round; the
figure is the median per-call time on rank 0. Then, per buffer, how many kB
of it the kernel backs by huge pages (AnonHugePages in /proc/self/smaps;
a mapping the buffer shares with others counts whole). Compare runs with
and without --no-huge-pages (see
benchmarks/results/2026-12-01-tensorflow-path-huge-pages.md).
"""

import argparse
import re
import time

import _common
import numpy as np


def huge_kb(addr, nbytes):
    """kB of [addr, addr + nbytes) the kernel backs by huge pages: the
    AnonHugePages of every mapping that overlaps it (a madvise splits a
    mapping where it starts and ends, as numpy's does around its header)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                inside = lo < addr + nbytes and addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def main():
    _common.quiet_tf()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="16M")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    from mpi4py import MPI

    tf = _common.tf_single_thread()
    import kerasdist as kd
    from kerasdist._core import capi as _capi
    kd.init()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    nbytes = _common.parse_size(args.size)
    x = np.full(nbytes // 4, rank + 1, np.float32)
    out = np.zeros_like(x)
    tx = tf.constant(x)
    tf_in = np.asarray(tx)  # shares the tf.constant's buffer

    @tf.function(autograph=False)
    def tf_call(t):
        return kd.allreduce(t, op=kd.Sum, name="tfbuf.tf")

    kept = tf_call(tx)  # one of the op's output buffers, kept alive
    tf_out = np.asarray(kept)
    want = np.float32(n * (n + 1) // 2)

    def core(src, dst, name):
        def call():
            _capi.Handle(_capi.OP_ALLREDUCE, name,
                         _capi.DTYPES[np.dtype(np.float32)], src.shape,
                         src.ctypes.data, dst.ctypes.data,
                         reduce_op=kd.Sum).wait(timeout=120)
        return call

    # tf_out is written through a read-only view: the op owns that buffer
    # and nothing else uses it while it is kept here.
    systems = {
        "numpy in, numpy out": core(x, out, "tfbuf.a"),
        "TF's input, numpy out": core(tf_in, out, "tfbuf.b"),
        "numpy in, TF's output": core(x, tf_out, "tfbuf.c"),
        "TF's input, TF's output": core(tf_in, tf_out, "tfbuf.d"),
        "tf.function call": lambda: tf_call(tx),
    }
    times = {k: [] for k in systems}
    for _ in range(args.rounds):
        for name, call in systems.items():
            for _ in range(args.calls):
                comm.Barrier()
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    wrong = int(np.count_nonzero(out != want)
                + np.count_nonzero(tf_out != want))
    wrong = comm.allreduce(wrong)
    if rank == 0:
        print(f"# allreduce float32 Sum of {_common.fmt_size(nbytes)}, np={n}, "
              f"{args.rounds} rounds x {args.calls} calls, "
              f"median us on rank 0; #wrong {wrong}")
        for name, ts in times.items():
            print(f"{name:<26} {np.median(ts) * 1e6:>10.1f}")
        print("# huge pages in each buffer's mapping (kB)")
        for name, a in (("numpy input", x), ("numpy output", out),
                        ("TF's input", tf_in), ("TF's output", tf_out)):
            print(f"{name:<26} {huge_kb(a.ctypes.data, a.nbytes)}")
    if wrong:
        raise SystemExit(f"{wrong} wrong results")


if __name__ == "__main__":
    main()
