"""kerasdist built against different MPIs, side by side, across two hosts
of the test cluster (tests/cluster; needs root), each under its own MPI's
launcher (`kerasdist run` picks it from the build record):

    python benchmarks/site_mpi.py [--mpi NAME=ROOT ...] [--rounds 3]

NAME=ROOT: a directory ROOT whose kerasdist package is built against the
MPI NAME (tests/support/site_mpi.py builds one); "mpich" (this tree's
build) is always first. Without --mpi, Open MPI is built from
tests/support/site_mpi.openmpi_home() into a temporary directory (the
core only; a minute or two). Per MPI, one job of 2 hosts x 1 rank:

- W1: allreduce (float32 Sum) of 4 KiB and 16 MiB through the core's C
  API (numpy buffers), median time per call over rounds x calls;
- W3: MLP-20 (20 Dense(256) layers, 42 tensors, 8.4 MB of gradients),
  `model.fit` with DistributedOptimizer on the JAX backend, batch 64 per
  rank: images/s over the steps after warm-up, median over rounds.

The machine is shared: compare the MPIs by the ratios of one run.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import _common

RANK_FLAG = "--rank"
SIZES = (4 * _common.KIB, 16 * _common.MIB)


def rank_main(rounds):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import numpy as np

    import kerasdist as kd
    import kerasdist.jax as kdj
    from kerasdist._core import host
    from kerasdist.run import site_mpi
    kd.init()
    out = {"mpi": site_mpi.describe(site_mpi.record()),
           "loaded": kd.build_info().get("mpi_library", "?")}
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        calls = 50 if nbytes <= _common.MIB else 5
        times = []
        for r in range(rounds):
            for c in range(calls):
                kdj.barrier()
                t0 = time.perf_counter()
                host.host_allreduce(x, kd.Sum, f"w1.{nbytes}.{r}.{c}")
                times.append(time.perf_counter() - t0)
        worst = np.asarray(kdj.allreduce(np.array([statistics.median(times)],
                                                  np.float64), op=kd.Max,
                                         name=f"w1.max.{nbytes}"))
        out[f"w1_{_common.fmt_size(nbytes)}_us"] = float(worst[0]) * 1e6
    model = keras.Sequential(
        [keras.Input((32, 32, 3)), keras.layers.Flatten()]
        + [keras.layers.Dense(256, activation="relu") for _ in range(20)]
        + [keras.layers.Dense(10)])
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch, steps, warmup = 64, 20, 5
    rng = np.random.default_rng(kd.rank())
    xs = rng.normal(size=(batch * (steps + warmup), 32, 32, 3)).astype(
        "float32")
    ys = rng.integers(0, 10, size=(len(xs),))
    rates = []
    for _ in range(rounds):
        ends = []
        cb = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs: ends.append(time.perf_counter()))
        model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False,
                  verbose=0, callbacks=[cb])
        rates.append(batch * kd.size() * steps / (ends[-1] - ends[warmup - 1]))
    out["w3_mlp20_img_s"] = statistics.median(rates)
    if kd.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mpi", action="append", default=[],
                   metavar="NAME=ROOT")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    p.add_argument(RANK_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        return rank_main(args.rounds)
    from tests.support import site_mpi as build_lib
    from tests.support.cluster import Cluster, require, run_on
    require()
    roots = {"mpich": None}
    tmp = tempfile.TemporaryDirectory(prefix="kerasdist-site-mpi-")
    for spec in args.mpi:
        name, _, root = spec.partition("=")
        roots[name] = os.path.abspath(root)
    if not args.mpi:
        home = build_lib.openmpi_home()
        if home is None:
            sys.exit(f"no Open MPI: {build_lib.OPENMPI_INSTALL}")
        roots["openmpi"] = build_lib.build(tmp.name, KERASDIST_MPI_HOME=home)
    results = {}
    with Cluster(2) as c:
        for name, root in roots.items():
            out = run_on(c, 2, f"{c.hosts[0].name}:1,{c.hosts[1].name}:1",
                         [sys.executable, os.path.abspath(__file__),
                          RANK_FLAG, "--rounds", str(args.rounds)],
                         timeout=900, root=root)
            lines = [l.split("RESULT ", 1)[1] for l in out.stdout.splitlines()
                     if "RESULT " in l]
            if out.returncode != 0 or not lines:
                sys.exit(f"{name}: the job failed:\n{out.stdout[-3000:]}")
            results[name] = json.loads(lines[0])
    keys = [k for k in results["mpich"] if k not in ("mpi", "loaded")]
    print("| MPI | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, r in results.items():
        print(f"| {r['mpi']} | " + " | ".join(f"{r[k]:.1f}" for k in keys)
              + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    tmp.cleanup()


if __name__ == "__main__":
    main()
