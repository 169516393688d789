"""W2 (BENCHMARKS.md): many small allreduces per step, fused by kerasdist.

    python -m kerasdist.run -np 2 python benchmarks/fusion.py [--plot f.png]

Per step, COUNT float32 tensors of SIZE bytes are summed over the ranks:

- kerasdist, tf.function: one tf.function holding COUNT allreduces (the
  runtime negotiates them together and fuses them into one buffer), taking
  the COUNT tensors as arguments and returning COUNT results;
- kerasdist, in-graph: the same allreduces on tensors read from variables,
  results assigned to variables inside the function (how gradients travel in
  a train step): no per-tensor cost of crossing into and out of Python;
- kerasdist grouped, in-graph: as above, but the COUNT tensors go through
  one `kerasdist.grouped_allreduce` op (how DistributedOptimizer and
  DistributedGradientTape send gradients): TF schedules and completes one
  op instead of COUNT;
- TF alone, tf.function: the first row's function with a tf.identity in
  place of each allreduce (COUNT tensors in, COUNT out): TensorFlow's own
  cost of that call, mostly in Python (the floor of the first row);
- TF alone, in-graph: the in-graph function with a copy (tf.identity) in
  place of each allreduce: what TF itself costs per call of that function,
  which the two in-graph rows include;
- TF alone, grouped: the grouped row's function with one tf.identity_n in
  place of the grouped op: TensorFlow's own cost of that step;
- kerasdist core (ctypes): COUNT requests enqueued through the C API on
  numpy buffers, then waited for: the runtime without TensorFlow (but with
  ctypes' per-call cost, ~10 us a tensor);
- kerasdist runtime (C loop): the same COUNT enqueues and waits from C
  (benchmarks/native_step.c, compiled here with the system compiler): the
  runtime's own cost, the floor for any front end;
- raw MPI, separate: COUNT mpi4py Iallreduce + one Waitall;
- raw MPI, one buffer: a single allreduce of COUNT * SIZE bytes (the floor);
- raw MPI, copy+one+copy: copy the COUNT tensors into one buffer, one
  allreduce, copy back out (what fusion does, by hand).

Cases: 128 x 16 KiB and 512 x 1 KiB. Median step time over rounds in which
the systems alternate; ratios are against "raw MPI, one buffer".
"""

import argparse
import ctypes

import _common
import numpy as np

CASES = ((128, 16 * _common.KIB), (512, _common.KIB))


def make_systems(comm, kd, tf, count, nbytes, tag="fusion"):
    """Builds name -> (step callable, check callable returning #wrong)."""
    from mpi4py import MPI

    from kerasdist._core import capi as _capi

    rank, n = comm.Get_rank(), comm.Get_size()
    elems = nbytes // 4
    xs = [np.full(elems, rank + 1 + i, np.float32) for i in range(count)]
    want = [np.float32(sum(r + 1 + i for r in range(n)))
            for i in range(count)]
    outs = [np.empty_like(x) for x in xs]
    big_in = np.concatenate(xs)
    big_out = np.empty_like(big_in)
    fused_in = np.empty_like(big_in)
    fused_out = np.empty_like(big_in)
    txs = [tf.constant(x) for x in xs]
    last = {}

    @tf.function(autograph=False)
    def tf_step(tensors):
        return [kd.allreduce(t, op=kd.Sum, name=f"{tag}.{count}.{i}")
                for i, t in enumerate(tensors)]

    def kd_tf():
        last["tf"] = tf_step(txs)

    @tf.function(autograph=False)
    def tf_identity_step(tensors):
        return [tf.identity(t) for t in tensors]

    def tf_alone_call():
        last["identity"] = tf_identity_step(txs)

    def check_identity():
        return wrong_list([t.numpy() - x + w for t, x, w in
                           zip(last["identity"], xs, want)])

    # In-graph: the tensors are read from variables and the results assigned
    # to variables inside the function, as gradients are made and consumed
    # inside a train step. No tensor crosses the Python boundary, so the row
    # above minus this one is TF's cost of passing COUNT tensors in and out.
    src_vars = [tf.Variable(x) for x in xs]
    dst_vars = [tf.Variable(tf.zeros_like(x)) for x in xs]

    @tf.function(autograph=False)
    def tf_graph_step():
        for i, (s, d) in enumerate(zip(src_vars, dst_vars)):
            d.assign(kd.allreduce(s.read_value(), op=kd.Sum,
                                  name=f"{tag}.graph.{count}.{i}"))

    def check_graph():
        return wrong_list([v.numpy() for v in dst_vars])

    @tf.function(autograph=False)
    def tf_grouped_step():
        sums = kd.grouped_allreduce([s.read_value() for s in src_vars],
                                    op=kd.Sum, name=f"{tag}.grouped.{count}")
        for d, r in zip(dst_vars, sums):
            d.assign(r)

    @tf.function(autograph=False)
    def tf_alone_step():
        for s, d in zip(src_vars, dst_vars):
            d.assign(tf.identity(s.read_value()))

    @tf.function(autograph=False)
    def tf_alone_grouped_step():
        outs = tf.identity_n([s.read_value() for s in src_vars])
        for d, r in zip(dst_vars, outs):
            d.assign(r)

    def check_alone():
        return wrong_list([v.numpy() - s.numpy() + w
                           for v, s, w in zip(dst_vars, src_vars, want)])

    native = _common.native_step()
    c_names = (ctypes.c_char_p * count)(
        *[f"{tag}.native.{count}.{i}".encode() for i in range(count)])
    c_in = (ctypes.c_void_p * count)(*[x.ctypes.data for x in xs])
    c_out = (ctypes.c_void_p * count)(*[o.ctypes.data for o in outs])
    c_handles = (ctypes.c_int64 * count)()

    def kd_native():
        if native(count, c_names, c_in, c_out, elems, c_handles) != 0:
            raise RuntimeError(_capi.last_error())

    def kd_core():
        hs = [_capi.Handle(_capi.OP_ALLREDUCE, f"{tag}.core.{count}.{i}",
                           _capi.DTYPES[np.dtype(np.float32)], x.shape,
                           x.ctypes.data, o.ctypes.data, reduce_op=kd.Sum)
              for i, (x, o) in enumerate(zip(xs, outs))]
        for h in hs:
            h.wait(timeout=120)

    def raw_separate():
        reqs = [comm.Iallreduce(x, o, op=MPI.SUM) for x, o in zip(xs, outs)]
        MPI.Request.Waitall(reqs)

    def raw_one():
        comm.Allreduce(big_in, big_out, op=MPI.SUM)

    def raw_copy():
        np.concatenate(xs, out=fused_in)
        comm.Allreduce(fused_in, fused_out, op=MPI.SUM)
        for i, o in enumerate(outs):
            np.copyto(o, fused_out[i * elems:(i + 1) * elems])

    def wrong_list(arrays):
        return int(sum(np.count_nonzero(a != w) for a, w in zip(arrays, want)))

    def check_outs():
        return wrong_list(outs)

    def check_tf():
        return wrong_list([t.numpy() for t in last["tf"]])

    def check_big(buf):
        return lambda: wrong_list(np.split(buf, count))

    return {
        "kerasdist tf.function": (kd_tf, check_tf),
        "TF alone, tf.function": (tf_alone_call, check_identity),
        "kerasdist in-graph": (tf_graph_step, check_graph),
        "kerasdist grouped, in-graph": (tf_grouped_step, check_graph),
        "TF alone, in-graph": (tf_alone_step, check_alone),
        "TF alone, grouped": (tf_alone_grouped_step, check_alone),
        "kerasdist core (ctypes)": (kd_core, check_outs),
        **({"kerasdist runtime (C loop)": (kd_native, check_outs)}
           if native else {}),
        "raw MPI separate": (raw_separate, check_outs),
        "raw MPI copy+one+copy": (raw_copy, check_outs),
        "raw MPI one buffer": (raw_one, check_big(big_out)),
    }


def run_case(comm, kd, tf, count, nbytes, rounds, calls):
    """Times one case; returns name -> (median seconds, #wrong)."""
    systems = make_systems(comm, kd, tf, count, nbytes)
    results = {}
    for name, (step, check) in systems.items():
        step()
        comm.Barrier()
        results[name] = check()  # every system is checked before timing
    samples = _common.agree(comm, _common.alternate(
        {k: v[0] for k, v in systems.items()}, rounds, calls, comm))
    return {name: (_common.median(samples[name]), results[name])
            for name in systems}


def print_case(count, nbytes, n, res):
    base = res["raw MPI one buffer"][0]
    total = count * nbytes
    print(f"# {count} x {_common.fmt_size(nbytes)} float32 per step "
          f"({_common.fmt_size(total)}), np={n}; ratio = time / raw MPI one "
          "buffer", flush=True)
    print(_common.TABLE_HEAD)
    for name, (sec, wrong) in res.items():
        print(_common.table_row(total, total // 4, "float", name, sec,
                                _common.busbw_factor("allreduce", n), wrong,
                                sec / base), flush=True)


def main():
    _common.quiet_tf()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20,
                   help="timed steps per system per round")
    p.add_argument("--plot", help="write a bar chart of step times here")
    args = p.parse_args()
    from mpi4py import MPI  # initialises MPI (THREAD_MULTIPLE) first

    tf = _common.tf_single_thread()
    import kerasdist as kd
    # Every system names its tensors apart: 5 x (128 + 512) names in all,
    # more than the default response cache (1024) holds. A job with 512
    # tensors fits; so that every row sees that steady state, make room.
    kd.init(cache_capacity=4096)
    comm = MPI.COMM_WORLD
    all_res = {}
    for count, nbytes in CASES:
        res = run_case(comm, kd, tf, count, nbytes, args.rounds, args.calls)
        all_res[(count, nbytes)] = res
        if comm.Get_rank() == 0:
            print_case(count, nbytes, comm.Get_size(), res)
            print()
    if comm.Get_rank() == 0 and args.plot:
        plot_bars(args.plot, all_res)


def plot_bars(path, all_res):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(all_res)
    names = list(next(iter(all_res.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ys = [all_res[c][name][0] * 1e3 for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width,
               label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{c} x {_common.fmt_size(b)}" for c, b in cases])
    ax.set_ylabel("step time (ms, median)")
    ax.set_title("Many small allreduces per step (np=2)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
