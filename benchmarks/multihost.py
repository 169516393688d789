"""Multi-host benchmarks on the test cluster (tests/cluster; needs root).

    python benchmarks/multihost.py MODE [--rounds 5] [--sizes 1M,16M,64M] \
        [--plot DIR] [--json FILE]

MODE is one of:

- `bytes`: allreduce (float32 Sum) on 2 hosts x 2 ranks, unshaped links:
  the bytes each host's veth sent per allreduce for kerasdist flat
  (`hierarchical_allreduce=0`), kerasdist hierarchical and raw mpi4py
  `Allreduce` over the same 4 ranks, against the lower bound 2(H-1)/H x
  size per host.
- `links`: the same sizes on the `10gbit` and `1gbit` link profiles: time
  and bus bandwidth of kerasdist (default settings), kerasdist flat,
  kerasdist hierarchical and raw MPI; ratio = time / raw MPI's time.
- `small`: 2 hosts x 1 rank on `1gbit`: a 4 KiB allreduce through one
  tf.function call, against raw MPI across the same link, the C API call
  without TensorFlow, and TF's own call of a function holding tf.identity.
- `fusion`: a 30-layer MLP (60 weight tensors, the biases small) trained
  with model.fit and DistributedOptimizer on 2 hosts x 1 rank on `1gbit`,
  fusion on (default threshold) against off (threshold 0): images/s.
- `model`: benchmarks/scaling_model.py's ring model with the links'
  figures (line rate; and alpha, beta fitted to raw MPI's times) against
  the measured 2-host times (runs `links` if this run has no figures yet).
- `all`: every mode in turn.

Systems alternate within one job, round by round (the first rotating);
kerasdist's settings differ per system, so each round of a kerasdist system
starts kerasdist with them (`kd.init(**settings)`) and shuts it down after.
Each call is timed on its own after a barrier; figures are medians over
rounds x calls of the per-call maximum over ranks, with the [min-max]
range of the per-round medians. Bytes are read from the machine-side
counters of each host's veth (`/sys/class/net/<link>/statistics`), which
rank 0 can read because a test host shares the machine's /sys; a round's
figure is (bytes after - bytes before) / calls, barriers included (a few
hundred bytes).
"""

import argparse
import json
import os
import sys

import _common

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = _common.MIB
RAW = "raw MPI"
KD_SYSTEMS = {  # name -> kd.init settings
    "kerasdist (auto)": {},
    "kerasdist flat": {"hierarchical_allreduce": False},
    "kerasdist hier": {"hierarchical_allreduce": True},
}
PAPER_FUSION = 0.65  # Horovod paper: "up to 65%" from Tensor Fusion on TCP
MLP_LAYERS, MLP_BATCH = 30, 64


def _calls_for(nbytes):
    return 20 if nbytes <= MIB else (5 if nbytes <= 16 * MIB else 2)


def _summary(per_round):
    """(median of all samples, min and max of the per-round medians)."""
    flat = [x for r in per_round for x in r]
    meds = [_common.median(r) for r in per_round]
    return _common.median(flat), min(meds), max(meds)


# -- the ranks' side --------------------------------------------------------


def _kd_allreduce(kd, x, out, name):
    """A callable: one float32 Sum allreduce of x into out through the C
    API (enqueue and wait, no TensorFlow)."""
    import numpy as np

    from kerasdist._core import capi as _capi
    code = _capi.DTYPES[np.dtype(np.float32)]

    def call():
        _capi.Handle(_capi.OP_ALLREDUCE, name, code, x.shape, x.ctypes.data,
                     out.ctypes.data, reduce_op=kd.Sum).wait(timeout=300)
    return call


def _read_links(links):
    total = []
    for link in links:
        with open(f"/sys/class/net/{link}/statistics/rx_bytes") as f:
            total.append(int(f.read()))
    return total


def rank_allreduce(opts):
    """Alternating allreduce systems; rank 0 prints one RESULT json line:
    {system: {size: {"s": [[per-call s]...], "bytes": [[per host]...],
    "wrong": n}}}."""
    import numpy as np
    from mpi4py import MPI

    import kerasdist as kd

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    links = [l for l in opts["links"].split(",") if l]
    systems = [RAW] + [s for s in opts["systems"] if s != RAW]
    res = {s: {} for s in systems}
    for nbytes in opts["sizes"]:
        x = np.full(nbytes // 4, rank + 1, np.float32)
        out = np.empty_like(x)
        want = np.float32(n * (n + 1) // 2)
        calls = opts["calls"] or _calls_for(nbytes)
        for s in systems:
            res[s][nbytes] = {"s": [], "bytes": [], "wrong": 0}
        for r in range(opts["rounds"]):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for s in order:
                if s == RAW:
                    def call():
                        comm.Allreduce(x, out, op=MPI.SUM)
                else:
                    kd.init(**KD_SYSTEMS[s])
                    call = _kd_allreduce(kd, x, out, f"mh.{nbytes}")
                out[:] = 0  # so a system that writes nothing shows as wrong
                call()  # warm-up: connections, shared memory, negotiation
                res[s][nbytes]["wrong"] += int(np.count_nonzero(out != want))
                comm.Barrier()
                before = _read_links(links) if rank == 0 and links else []
                times = [_common.timed(call, comm) for _ in range(calls)]
                comm.Barrier()
                if before:
                    after = _read_links(links)
                    res[s][nbytes]["bytes"].append(
                        [(a - b) / calls for a, b in zip(after, before)])
                times = _common.agree(comm, {"t": times})["t"]
                res[s][nbytes]["s"].append(times)
                if s != RAW:
                    kd.shutdown()
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def rank_small(opts):
    """4 KiB allreduce: raw MPI, C API, tf.function, TF alone."""
    import numpy as np
    from mpi4py import MPI

    tf = _common.tf_single_thread()
    import kerasdist as kd
    kd.init()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    nbytes = opts["sizes"][0]
    x = np.full(nbytes // 4, rank + 1, np.float32)
    out = np.empty_like(x)
    tx = tf.constant(x)

    @tf.function(autograph=False)
    def tf_call(t):
        return kd.allreduce(t, op=kd.Sum, name="mh.small.tf")

    @tf.function(autograph=False)
    def tf_alone(t):
        return tf.identity(t)

    last = {}
    systems = {
        RAW: lambda: comm.Allreduce(x, out, op=MPI.SUM),
        "kerasdist core (ctypes)": _kd_allreduce(kd, x, out, "mh.small"),
        "kerasdist tf.function": lambda: last.__setitem__("t", tf_call(tx)),
        "TF alone, tf.function": lambda: tf_alone(tx),
    }
    calls = opts["calls"] or 100
    res = {s: {nbytes: {"s": [], "bytes": [], "wrong": 0}} for s in systems}
    want = n * (n + 1) // 2
    for s, call in systems.items():
        out[:] = 0
        call()
        call()
        got = last["t"].numpy() if s == "kerasdist tf.function" else out
        if not s.startswith("TF alone"):
            res[s][nbytes]["wrong"] = int(np.count_nonzero(got != want))
    names = list(systems)
    for r in range(opts["rounds"]):
        # One round each; the first system rotates from round to round.
        order = names[r % len(names):] + names[:r % len(names)]
        got = _common.agree(comm, _common.alternate(
            {k: systems[k] for k in order}, 1, calls, comm, warmup=0))
        for s in systems:
            res[s][nbytes]["s"].append(got[s])
    kd.shutdown()
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def _mlp(keras, width):
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="relu")
               for _ in range(MLP_LAYERS - 1)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def rank_fusion(opts):
    """model.fit of the MLP, fusion on and off alternating; images/s of the
    whole job (all ranks) per round."""
    import time

    import numpy as np
    from mpi4py import MPI

    tf = _common.tf_single_thread()
    import keras

    import kerasdist as kd
    from kerasdist._core import capi as _capi

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    systems = {"fusion on": {}, "fusion off": {"fusion_threshold": 0}}
    kd.init()
    rng = np.random.default_rng(rank)
    width = opts["width"]
    x = rng.standard_normal((1024, width)).astype(np.float32)
    y = rng.integers(0, 10, size=(1024,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        MLP_BATCH).prefetch(2)
    model = _mlp(keras, width)
    model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(
        0.01)), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), jit_compile=False)
    kd.broadcast_variables(model.variables, root_rank=0)
    steps, warmup = opts["calls"] or 30, 3
    # Untimed: tracing, the input pipeline's start, first-time allocations.
    model.fit(data, steps_per_epoch=warmup + 2, epochs=1, verbose=0)
    kd.shutdown()
    res = {s: {"ips": [], "tensors": len(model.trainable_weights)}
           for s in systems}
    res["grad_bytes"] = int(sum(np.prod(v.shape) * 4
                                for v in model.trainable_weights))
    for r in range(opts["rounds"]):
        names = list(systems)
        order = names[r % 2:] + names[:r % 2]
        for s in order:
            kd.init(**systems[s])
            lib = _capi.lib()
            ends = []

            def batch_end(batch, logs, ends=ends):
                ends.append(time.perf_counter())

            timer = keras.callbacks.LambdaCallback(on_train_batch_end=batch_end)
            comm.Barrier()
            model.fit(data, steps_per_epoch=warmup + steps, epochs=1,
                      verbose=0, callbacks=[timer])
            ips = steps * MLP_BATCH * n / (ends[-1] - ends[warmup - 1])
            res[s]["ips"].append(min(comm.allgather(ips)))
            # Batches the data path ran per step: what fusion changes.
            batches = sum(lib.kerasdist_backend_runs(name.encode())
                          for name in lib.kerasdist_backends().decode()
                          .split(",") if name)
            res[s]["batches_per_step"] = batches / (warmup + steps)
            kd.shutdown()
    w = [v.numpy() for v in model.trainable_weights]
    same = comm.allgather(float(sum(np.abs(a).sum() for a in w)))
    res["same_weights"] = len(set(same)) == 1
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


RANK_MODES = {"allreduce": rank_allreduce, "small": rank_small,
              "fusion": rank_fusion}


def rank_main(argv):
    from mpi4py import MPI  # noqa: F401  (MPI first, THREAD_MULTIPLE)
    _common.quiet_tf()
    opts = json.loads(argv[1])
    opts["sizes"] = [int(s) for s in opts.get("sizes", [])]
    RANK_MODES[argv[0]](opts)


# -- the machine's side -----------------------------------------------------


class Bench:
    """One test cluster of 2 hosts and the jobs run on it."""

    def __init__(self, args):
        from tests.support.cluster import Cluster
        from tests.support.cluster import unavailable_reason
        reason = unavailable_reason()
        if reason:
            raise SystemExit(f"multihost.py needs a test cluster: {reason}")
        self.args = args
        self.cluster = Cluster(2)
        self.results = {}

    def close(self):
        self.cluster.close()

    def shape(self, profile):
        for h in self.cluster.hosts:
            if profile:
                self.cluster.shape(h, profile)
            else:
                self.cluster.unshape(h)

    def job(self, np_, hosts, mode, opts, timeout=900):
        from tests.support.helpers import launch
        from tests.support.helpers import rank_lines
        c = self.cluster
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        argv = [sys.executable, os.path.join(HERE, "multihost.py"), "_rank",
                mode, json.dumps(opts)]
        out = launch(np_, argv, timeout=timeout, env=env,
                     prefix=c.launcher_prefix(),
                     launcher_args=["--ssh-command", c.remote_shell,
                                    "--network-interface", c.bridge,
                                    "-H", hosts])
        lines = [l for l in rank_lines(out.stdout, 0)
                 if l.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"{mode} job failed (code {out.returncode}):\n"
                             + out.stdout[-4000:])
        return json.loads(lines[-1][len("RESULT "):])

    def allreduce_job(self, systems, sizes, rounds, calls=0, links=False):
        c = self.cluster
        opts = {"systems": systems, "sizes": sizes, "rounds": rounds,
                "calls": calls,
                "links": ",".join(h.link for h in c.hosts) if links else ""}
        res = self.job(4, "kdt0:2,kdt1:2", "allreduce", opts)
        return {s: {int(k): v for k, v in d.items()} for s, d in res.items()}


def mode_bytes(b):
    args = b.args
    b.shape(None)
    res = b.allreduce_job(["kerasdist flat", "kerasdist hier"], args.sizes,
                          args.rounds, calls=1, links=True)
    b.results["bytes"] = res
    hosts = len(b.cluster.hosts)
    print(f"# bytes: allreduce float32 Sum, 2 hosts x 2 ranks, unshaped; "
          f"bytes each host's link sent per allreduce (median over "
          f"{args.rounds} rounds, [min-max]); bound = 2(H-1)/H x size")
    print(f"#{'size':>9} {'system':>18} {'host':>5} {'sent(B)':>12} "
          f"{'range':>25} {'bound(B)':>11} {'ratio':>6} {'#wrong':>6}")
    series = {}
    for nbytes in args.sizes:
        bound = 2 * (hosts - 1) / hosts * nbytes
        for s in [RAW, "kerasdist flat", "kerasdist hier"]:
            d = res[s][nbytes]
            for h in range(hosts):
                vals = [x[h] for x in d["bytes"]]
                med = _common.median(vals)
                print(f" {_common.fmt_size(nbytes):>9} {s:>18} {h:>5} "
                      f"{med:>12.0f} {f'[{min(vals):.0f}-{max(vals):.0f}]':>25}"
                      f" {bound:>11.0f} {med / bound:>6.3f} {d['wrong']:>6}")
                if h == 0:
                    series.setdefault(s, ([], []))[0].append(nbytes)
                    series[s][1].append(0.0)
                series[s][1][-1] = max(series[s][1][-1], med / bound)
    series["target (1.15x the bound)"] = (args.sizes, [1.15] * len(args.sizes))
    series["the bound"] = (args.sizes, [1.0] * len(args.sizes))
    _plot(args, "multihost_bytes.png", "allreduce, 2 hosts x 2 ranks: bytes "
          "the busier host sent / (2(H-1)/H x size)", "ratio to the bound",
          series, args.sizes, logy=False)


def mode_links(b):
    args = b.args
    systems = list(KD_SYSTEMS)
    b.results["links"] = {}
    factor = _common.busbw_factor("allreduce", 4)
    for profile in args.profiles:
        b.shape(profile)
        res = b.allreduce_job(systems, args.sizes, args.rounds)
        b.results["links"][profile] = res
        print(f"# links: allreduce float32 Sum, 2 hosts x 2 ranks, "
              f"{profile} links; {args.rounds} rounds; ratio = time / "
              f"{RAW}'s; busbw with 2(n-1)/n, n=4")
        print(_common.TABLE_HEAD + f" {'range(us)':>17}")
        series = {}
        for nbytes in args.sizes:
            base = _summary(res[RAW][nbytes]["s"])[0]
            for s in [RAW] + systems:
                d = res[s][nbytes]
                med, lo, hi = _summary(d["s"])
                print(_common.table_row(nbytes, nbytes // 4, "float", s, med,
                                        factor, d["wrong"], med / base)
                      + f" {f'[{lo * 1e6:.0f}-{hi * 1e6:.0f}]':>17}")
                series.setdefault(s, ([], []))
                series[s][0].append(nbytes)
                series[s][1].append(nbytes / med / 1e9 * factor)
        _plot(args, f"multihost_links_{profile}.png",
              f"allreduce, 2 hosts x 2 ranks, {profile}",
              "bus bandwidth (GB/s)", series, args.sizes)
    b.shape(None)


def mode_small(b):
    args = b.args
    b.shape("1gbit")
    nbytes = 4 * _common.KIB
    res = b.job(2, "kdt0:1,kdt1:1", "small",
                {"sizes": [nbytes], "rounds": args.rounds, "calls": 0})
    b.shape(None)
    b.results["small"] = res
    print(f"# small: 4 KiB allreduce float32 Sum, 2 hosts x 1 rank, 1gbit; "
          f"{args.rounds} rounds; ratio = time / {RAW}'s")
    print(_common.TABLE_HEAD + f" {'range(us)':>17}")
    base = _summary(res[RAW][str(nbytes)]["s"])[0]
    for s, d in res.items():
        med, lo, hi = _summary(d[str(nbytes)]["s"])
        print(_common.table_row(nbytes, nbytes // 4, "float", s, med, 1.0,
                                d[str(nbytes)]["wrong"], med / base)
              + f" {f'[{lo * 1e6:.0f}-{hi * 1e6:.0f}]':>17}")
    tf_alone = _summary(res["TF alone, tf.function"][str(nbytes)]["s"])[0]
    kd_tf = _summary(res["kerasdist tf.function"][str(nbytes)]["s"])[0]
    print(f"# target (issue): kerasdist tf.function <= TF alone + 5 x raw MPI "
          f"= {(tf_alone + 5 * base) * 1e6:.0f} us; measured "
          f"{kd_tf * 1e6:.0f} us")


def mode_fusion(b):
    args = b.args
    b.shape("1gbit")
    b.results["fusion"] = {}
    print(f"# fusion: model.fit of an MLP of {MLP_LAYERS} Dense layers, "
          f"batch {MLP_BATCH} per rank, SGD in DistributedOptimizer, 2 hosts "
          f"x 1 rank, 1gbit; images/s of the job, median [min-max] over "
          f"{args.rounds} rounds of {args.steps} steps; fusion off = "
          f"fusion_threshold 0. Horovod paper: up to +{PAPER_FUSION:.0%} "
          f"from fusion on TCP")
    print(f"#{'width':>6} {'tensors':>8} {'grad(B)':>9} {'system':>11} "
          f"{'images/s':>9} {'range':>15} {'batches/step':>13} {'speedup':>8}")
    for width in args.widths:
        res = b.job(2, "kdt0:1,kdt1:1", "fusion",
                    {"rounds": args.rounds, "calls": args.steps,
                     "width": width})
        b.results["fusion"][width] = res
        if not res["same_weights"]:
            raise SystemExit(f"fusion width {width}: the ranks' weights "
                             "differ after training")
        med = {s: _common.median(res[s]["ips"])
               for s in ("fusion on", "fusion off")}
        for s in ("fusion on", "fusion off"):
            v = res[s]["ips"]
            speedup = (f"{med['fusion on'] / med['fusion off'] - 1:>+8.0%}"
                       if s == "fusion on" else f"{'':>8}")
            print(f" {width:>6} {res[s]['tensors']:>8} {res['grad_bytes']:>9} "
                  f"{s:>11} {med[s]:>9.0f} "
                  f"{f'[{min(v):.0f}-{max(v):.0f}]':>15} "
                  f"{res[s]['batches_per_step']:>13.1f} {speedup}")
    b.shape(None)
    series = {s: (args.widths, [_common.median(b.results["fusion"][w][s]
                                               ["ips"]) for w in args.widths])
              for s in ("fusion on", "fusion off")}
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        _common.maybe_plot(
            os.path.join(args.plot, "multihost_fusion.png"),
            f"model.fit, MLP of {MLP_LAYERS} layers, 2 hosts x 1 rank, 1gbit",
            "units per layer", "images/s (job)", series,
            xticks=[(w, str(w)) for w in args.widths])


def mode_model(b):
    import scaling_model as sm
    args = b.args
    if "links" not in b.results:
        mode_links(b)
    hosts = len(b.cluster.hosts)
    print(f"# model: scaling_model.ring_allreduce_s across the {hosts} "
          f"hosts' links (n = hosts: 2 ranks a host share one link) against "
          f"the measured times; 'line' = the profile's rate, no latency; "
          f"'fit' = alpha, beta least-squares fitted to {RAW}'s times")
    fits = {}
    for profile, res in b.results["links"].items():
        raw = [_summary(res[RAW][s]["s"])[0] for s in args.sizes]
        if len(args.sizes) >= 2:
            alpha, beta = sm.fit_alpha_beta(args.sizes, raw, hosts)
            fits[profile] = sm.Network(profile + " fit", alpha, beta)
            print(f"# {profile}: fitted alpha {alpha * 1e6:.1f} us, "
                  f"{1 / beta / 1e9 if beta else float('inf'):.3f} GB/s "
                  f"(line rate {_line(sm, profile).beta ** -1 / 1e9:.3f} GB/s)")
    print(f"#{'profile':>8} {'size':>8} {'line(us)':>10} {'fit(us)':>10} "
          f"{'raw MPI':>10} {'kd auto':>10} {'kd hier':>10} {'kd flat':>10}"
          f" {'auto/line':>10}")
    for profile, res in b.results["links"].items():
        line, fit = _line(sm, profile), fits.get(profile)
        for s in args.sizes:
            t_line = sm.ring_allreduce_s(s, hosts, line)
            t_fit = sm.ring_allreduce_s(s, hosts, fit) if fit else float("nan")
            got = {k: _summary(res[k][s]["s"])[0] for k in [RAW, *KD_SYSTEMS]}
            print(f" {profile:>8} {_common.fmt_size(s):>8} "
                  f"{t_line * 1e6:>10.0f} {t_fit * 1e6:>10.0f} "
                  f"{got[RAW] * 1e6:>10.0f} "
                  f"{got['kerasdist (auto)'] * 1e6:>10.0f} "
                  f"{got['kerasdist hier'] * 1e6:>10.0f} "
                  f"{got['kerasdist flat'] * 1e6:>10.0f} "
                  f"{got['kerasdist (auto)'] / t_line:>10.2f}")


def _line(sm, profile):
    """The profile's tc rate as a scaling_model Network, no latency."""
    from tests.support.cluster import PROFILES
    rate = float(PROFILES[profile][0].replace("gbit", ""))
    return sm.Network.from_rate(profile, rate, 1.0, 0.0)


def _plot(args, name, title, ylabel, series, sizes, logy=True):
    if not args.plot:
        return
    os.makedirs(args.plot, exist_ok=True)
    _common.maybe_plot(os.path.join(args.plot, name), title, "message size",
                       ylabel, series, logy=logy,
                       xticks=[(s, _common.fmt_size(s)) for s in sizes])


MODES = {"bytes": mode_bytes, "links": mode_links, "small": mode_small,
         "fusion": mode_fusion, "model": mode_model}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_rank":
        return rank_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=[*MODES, "all"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="1M,16M,64M",
                   help="allreduce sizes for bytes/links/model (K/M suffix)")
    p.add_argument("--profiles", default="10gbit,1gbit",
                   help="link profiles for links/model")
    p.add_argument("--steps", type=int, default=30,
                   help="timed model.fit steps per round in fusion")
    p.add_argument("--widths", default="32,128",
                   help="units of each Dense layer in fusion (one job each)")
    p.add_argument("--plot", help="write PNG plots into this directory")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args(argv)
    args.sizes = [_common.parse_size(s) for s in args.sizes.split(",")]
    args.profiles = args.profiles.split(",")
    args.widths = [int(w) for w in args.widths.split(",")]
    _common.quiet_tf()
    b = Bench(args)
    try:
        for mode in (MODES if args.mode == "all" else [args.mode]):
            MODES[mode](b)
            print(flush=True)
    finally:
        b.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(b.results, f)


if __name__ == "__main__":
    sys.exit(main())
