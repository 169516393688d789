"""Shared pieces of the benchmark scripts: timing, the nccl-tests table, plots.

Benchmarks run under the launcher (`python -m kerasdist.run -np 2 python
benchmarks/X.py`); rank 0 prints. Figures are medians of calls timed one by
one, with the systems alternating round by round, because the machine is
shared and its speed drifts: compare systems by the ratios in one run.
"""

import functools
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

KIB, MIB = 1024, 1024 * 1024


def busbw_factor(op, n):
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor.

    Allreduce moves 2(n-1)/n of the buffer over the slowest link of a ring;
    allgather and reducescatter (n-1)/n; broadcast 1.
    """
    if n <= 1:
        return 1.0 if op != "allreduce" else 0.0
    return {"allreduce": 2.0 * (n - 1) / n, "allgather": (n - 1) / n,
            "reducescatter": (n - 1) / n, "broadcast": 1.0}[op]


def fmt_size(nbytes):
    for unit, div in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def parse_size(text):
    """'4K', '64KiB', '1M', '16MiB' or a plain byte count -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": KIB, "M": MIB, "G": 1024 * MIB}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def median(values):
    return statistics.median(values) if values else float("nan")


def timed(fn, comm=None):
    """Runs fn() once and returns its wall time in seconds.

    With `comm`, a barrier first lines the ranks up so that each timed call
    starts together (the barrier itself is not timed).
    """
    if comm is not None:
        comm.Barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def alternate(systems, rounds, calls, comm=None, warmup=2):
    """Times each system `calls` times per round, systems taking turns.

    Args:
        systems: ordered dict name -> zero-argument callable (one call = the
            unit timed, e.g. one allreduce or one step).
        rounds: how many rounds; each round runs every system in turn, the
            starting system rotating so no system always goes first.
        calls: timed calls per system per round.
        comm: an mpi4py communicator to line the ranks up before each call.
        warmup: untimed calls per system before the first round.

    Returns:
        name -> list of seconds (rounds * calls samples).
    """
    names = list(systems)
    for name in names:
        for _ in range(warmup):
            systems[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for _ in range(calls):
                samples[name].append(timed(systems[name], comm))
    return samples


def agree(comm, samples):
    """The per-call maximum over ranks (a collective ends when the slowest
    rank's call ends), so every rank reports the same numbers."""
    if comm is None or comm.Get_size() == 1:
        return samples
    import numpy as np
    out = {}
    for name, values in samples.items():
        a = np.asarray(values, dtype=np.float64)
        b = np.empty_like(a)
        from mpi4py import MPI
        comm.Allreduce(a, b, op=MPI.MAX)
        out[name] = b.tolist()
    return out


TABLE_HEAD = (f"#{'size(B)':>11} {'count':>10} {'type':>7} {'system':>22} "
              f"{'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
              f"{'#wrong':>7} {'ratio':>7}")


def table_row(nbytes, count, dtype, system, seconds, factor, wrong,
              ratio=None):
    """One nccl-tests style line: algbw = bytes / time, busbw = algbw * f."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
    r = f"{ratio:>7.2f}" if ratio is not None else f"{'':>7}"
    return (f" {nbytes:>11} {count:>10} {dtype:>7} {system:>22} "
            f"{seconds * 1e6:>10.1f} {algbw:>12.3f} {algbw * factor:>12.3f} "
            f"{wrong:>7} {r}")


def maybe_plot(path, title, xlabel, ylabel, series, logx=True, logy=True,
               xticks=None):
    """Writes a line plot of series {label: (xs, ys)} to `path` if given.

    Raises:
        SystemExit: matplotlib is missing (a clear message instead of a
            traceback).
    """
    if not path:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if xticks:
        ax.set_xticks([x for x, _ in xticks])
        ax.set_xticklabels([l for _, l in xticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"# wrote {path}", flush=True)


def quiet_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def tf_single_thread():
    """One intra- and one inter-op thread: np=2 on 2 cores leaves no spare."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


@functools.lru_cache(maxsize=None)
def native_step():
    """Compiles benchmarks/native_step.c (see there) against the built core
    library and returns its `kd_native_step` through ctypes, or None with a
    printed reason when no C compiler is found."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    from kerasdist._core import capi as _capi

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("# no C compiler (set CC): the runtime-only row is skipped",
              flush=True)
        return None
    core = _capi.library_path()
    out = os.path.join(tempfile.mkdtemp(prefix="kd_native_"), "step.so")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out,
                    os.path.join(REPO_ROOT, "benchmarks", "native_step.c"),
                    "-I", os.path.join(REPO_ROOT, "ops", "core"), core],
                   check=True)
    fn = ctypes.CDLL(out).kd_native_step
    p = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, p, p, p, ctypes.c_int64, p]
    fn.restype = ctypes.c_int
    return fn
