"""W1 (BENCHMARKS.md): allreduce time and bus bandwidth against raw MPI.

    python -m kerasdist.run -np 2 python benchmarks/allreduce.py \
        [--sizes 4K,64K,1M,16M,64M] [--rounds 5] [--plot w1.png] [--no-fusion]

For each size (float32, Sum), in the same run and alternating round by
round:

- raw MPI: mpi4py `comm.Allreduce` on numpy buffers (the transport's speed);
- kerasdist core (ctypes): one request through the C API on numpy buffers,
  enqueue + wait, no TensorFlow (the runtime's own cost);
- kerasdist tf.function: `kerasdist.allreduce` inside a tf.function, one
  call per timed unit (includes TF's function-call cost, ~tens of us);
- kd tf.function+asarray: the same call, then the result as a numpy array
  (`np.asarray`, which shares the tensor's buffer): the whole trip from
  numpy back to numpy, like the core's row;
- kd tf.function+.numpy(): the same, read with `.numpy()`, which copies the
  result into a new array (TensorFlow's choice; at 16 MiB the copy and its
  page faults cost about as much as the allreduce);
- kerasdist eager: `kerasdist.allreduce` called eagerly (for reference);
- kerasdist in-graph, chained: one tf.function holding CHAIN allreduces,
  each reducing the previous one's result (Sum, then Average of values
  already equal), timed per allreduce: the op's latency inside a graph, as
  in a train step, without TF's per-call cost;
- TF alone, tf.function: the same function with tf.identity in place of
  the allreduce: TF's own cost of one call, which the tf.function row
  includes (it bounds that row's ratio from below at small sizes).

Each call is timed on its own after a barrier; the figure is the median over
all calls of the per-call maximum across ranks. algbw = bytes / time, busbw
= algbw * 2(n-1)/n. Every system's result is checked (`#wrong`). `ratio` is
time / raw MPI's time. Then the W2 fusion case (128 x 16 KiB per step, see
fusion.py) unless --no-fusion.
"""

import argparse

import _common
import numpy as np

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
RAW = "raw MPI"
CHAIN = 10  # allreduces per call in the in-graph row


def _calls_for(nbytes):
    # About the same wall time per size: many calls where they are short.
    if nbytes <= 64 * _common.KIB:
        return 100
    if nbytes <= _common.MIB:
        return 40
    if nbytes <= 16 * _common.MIB:
        return 10
    return 4


def make_systems(comm, kd, tf, nbytes):
    """name -> (one-call callable, check callable returning #wrong)."""
    from mpi4py import MPI

    from kerasdist._core import capi as _capi

    rank, n = comm.Get_rank(), comm.Get_size()
    x = np.full(nbytes // 4, rank + 1, np.float32)
    out = np.empty_like(x)
    want = np.float32(n * (n + 1) // 2)
    tx = tf.constant(x)
    name = f"w1.{nbytes}"
    last = {}

    @tf.function(autograph=False)
    def tf_call(t):
        return kd.allreduce(t, op=kd.Sum, name=name + ".tf")

    @tf.function(autograph=False)
    def tf_chain(t):
        t = kd.allreduce(t, op=kd.Sum, name=f"{name}.chain.0")
        for i in range(1, CHAIN):
            t = kd.allreduce(t, op=kd.Average, name=f"{name}.chain.{i}")
        return t

    @tf.function(autograph=False)
    def tf_alone(t):
        return tf.identity(t)

    def raw():
        comm.Allreduce(x, out, op=MPI.SUM)

    def core():
        _capi.Handle(_capi.OP_ALLREDUCE, name + ".core",
                     _capi.DTYPES[np.dtype(np.float32)], x.shape,
                     x.ctypes.data, out.ctypes.data,
                     reduce_op=kd.Sum).wait(timeout=120)

    def in_function():
        last["t"] = tf_call(tx)

    def in_function_read():
        # The result as a numpy array without a copy (np.asarray shares the
        # tensor's buffer): what the core's row hands over in `out`.
        last["t"] = tf_call(tx)
        last["a"] = np.asarray(last["t"])

    def in_function_numpy():
        # .numpy() copies the tensor into a new array (TensorFlow's choice).
        last["t"] = tf_call(tx)
        last["a"] = last["t"].numpy()

    def eager():
        last["t"] = kd.allreduce(tx, op=kd.Sum, name=name + ".eager")

    def chained():
        last["t"] = tf_chain(tx)

    def alone():
        last["alone"] = tf_alone(tx)

    def check_out():
        return int(np.count_nonzero(out != want))

    def check_tf():
        return int(np.count_nonzero(last["t"].numpy() != want))

    def check_alone():
        return int(np.count_nonzero(last["alone"].numpy() != x))

    # name -> (callable, check, allreduces per call)
    return {RAW: (raw, check_out, 1),
            "kerasdist core (ctypes)": (core, check_out, 1),
            "kerasdist tf.function": (in_function, check_tf, 1),
            "kd tf.function+asarray": (in_function_read, check_tf, 1),
            "kd tf.function+.numpy()": (in_function_numpy, check_tf, 1),
            "kerasdist eager": (eager, check_tf, 1),
            f"kerasdist in-graph x{CHAIN}": (chained, check_tf, CHAIN),
            "TF alone, tf.function": (alone, check_alone, 1)}


def run_size(comm, kd, tf, nbytes, rounds):
    systems = make_systems(comm, kd, tf, nbytes)
    wrong = {}
    for name, (call, check, _) in systems.items():
        call()
        wrong[name] = check()
    samples = _common.agree(comm, _common.alternate(
        {k: v[0] for k, v in systems.items()}, rounds, _calls_for(nbytes),
        comm))
    return {name: (_common.median(samples[name]) / per_call, wrong[name])
            for name, (_, _, per_call) in systems.items()}


def main():
    _common.quiet_tf()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="comma-separated sizes in bytes (K/M suffixes)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plot", help="write busbw and ratio plots here (PNG)")
    p.add_argument("--no-fusion", action="store_true",
                   help="skip the 128 x 16 KiB fusion case")
    args = p.parse_args()
    from mpi4py import MPI  # initialises MPI (THREAD_MULTIPLE) first

    tf = _common.tf_single_thread()
    import kerasdist as kd
    kd.init()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    sizes = [_common.parse_size(s) for s in args.sizes.split(",")]
    factor = _common.busbw_factor("allreduce", n)
    if rank == 0:
        print(f"# W1 allreduce float32 Sum, np={n}, median of per-call "
              f"times over {args.rounds} alternating rounds; ratio = time / "
              f"{RAW}", flush=True)
        print(_common.TABLE_HEAD, flush=True)
    results = {}
    for nbytes in sizes:
        res = run_size(comm, kd, tf, nbytes, args.rounds)
        results[nbytes] = res
        if rank == 0:
            base = res[RAW][0]
            for name, (sec, wrong) in res.items():
                print(_common.table_row(nbytes, nbytes // 4, "float", name,
                                        sec, factor, wrong, sec / base),
                      flush=True)
    if rank == 0 and args.plot:
        # "TF alone" moves no data: a bandwidth would mean nothing.
        series = {name: ([s for s in sizes],
                         [nbytes / results[nbytes][name][0] / 1e9 * factor
                          for nbytes in sizes])
                  for name in results[sizes[0]] if not name.startswith("TF")}
        _common.maybe_plot(
            args.plot, f"allreduce float32, np={n}", "message size",
            "bus bandwidth (GB/s)", series, logy=True,
            xticks=[(s, _common.fmt_size(s)) for s in sizes])
    if not args.no_fusion:
        import fusion
        res = fusion.run_case(comm, kd, tf, 128, 16 * _common.KIB,
                              args.rounds, 20)
        if rank == 0:
            print()
            fusion.print_case(128, 16 * _common.KIB, n, res)


if __name__ == "__main__":
    main()
