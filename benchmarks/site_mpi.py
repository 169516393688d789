"""kerasdist on a site's MPI against the mpich wheel, across two test hosts
(tests/cluster; needs root), side by side in one run.

    python benchmarks/site_mpi.py --mpi mpich \
        --mpi intel=/opt/impi:/tmp/impi-build [--rounds 2] [--json FILE]

Each `--mpi NAME[=HOME:BUILD]` is one system: `mpich` alone is this tree's
build on the mpich wheel (its mpiexec); `NAME=HOME:BUILD` runs the
kerasdist package in BUILD/kerasdist (a build against the MPI in HOME, as
tests/cluster/test_intel_mpi.py and tests/support/site_mpi.py make one,
with the TensorFlow op library for W3) under that build's `kerasdist run`
with KERASDIST_MPI_HOME=HOME, so with that MPI's launcher (Intel's
mpiexec, Open MPI's mpirun). Every job is 2 hosts
x 1 rank (`-H kdt0:1,kdt1:1`, unshaped veths) and measures, in this order:

- W1: float32 Sum allreduce of 4 KiB and 16 MiB through the C API (no
  TensorFlow), each call timed on its own after a barrier; the per-call
  maximum over ranks, median over calls (and rounds);
- W3: model.fit of the MLP-20 (benchmarks/keras_scaling.py's, SGD
  momentum in DistributedOptimizer): images/s summed over the ranks,
  median over rounds.

Systems take turns, round by round (the first rotating), each job started
afresh. Figures on a 2-core machine shared with other work are noisy:
compare systems of one run only.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
SIZES = (4 << 10, 16 << 20)
CALLS = {4 << 10: 200, 16 << 20: 10}


# -- the ranks' side ----------------------------------------------------------


def rank_main(steps, warmup):
    if os.environ.get("SITE_MPI_BUILD"):
        sys.path.insert(0, os.environ["SITE_MPI_BUILD"])
    sys.path.insert(1, HERE)
    import time

    import keras_scaling
    import numpy as np

    import kerasdist as kd
    from kerasdist._core import capi as _capi

    keras_scaling._threads("tensorflow")  # before TensorFlow starts (W1's)
    kd.init()
    result = {"w1": {}}
    code = _capi.DTYPES[np.dtype(np.float32)]
    for nbytes in SIZES:
        x = np.full(nbytes // 4, kd.rank() + 1, np.float32)
        out = np.empty_like(x)

        def call():
            _capi.Handle(_capi.OP_ALLREDUCE, f"w1.{nbytes}", code, x.shape,
                         x.ctypes.data, out.ctypes.data,
                         reduce_op=kd.Sum).wait(timeout=300)
        for _ in range(3):
            call()
        want = kd.size() * (kd.size() + 1) / 2
        if not np.all(out == want):
            raise AssertionError(f"W1 {nbytes}: wrong sum")
        times = []
        for _ in range(CALLS[nbytes]):
            kd.barrier()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        every = np.asarray(kd.allgather(np.array([times]),
                                        name=f"w1.times.{nbytes}"))
        result["w1"][nbytes] = every.max(axis=0).tolist()
    if kd.rank() == 0:
        lib = next((line.split()[-1] for line in open("/proc/self/maps")
                    if "/libmpi.so" in line), None)
        result["libmpi"] = lib
        print("RESULT " + json.dumps(result), flush=True)
    kd.shutdown()
    # W3 in the same job, as keras_scaling.py's worker times it (it starts
    # kerasdist again and prints its own RESULT line).
    keras_scaling.worker("mlp20", steps, warmup)


# -- the machine's side -------------------------------------------------------


def _system(text):
    name, _, where = text.partition("=")
    if not where:
        if name != "mpich":
            raise argparse.ArgumentTypeError(
                f"--mpi {text}: give NAME=HOME:BUILD (only mpich needs none)")
        return name, None, None
    home, _, build = where.partition(":")
    if not build or not os.path.isdir(os.path.join(build, "kerasdist")):
        raise argparse.ArgumentTypeError(
            f"--mpi {text}: BUILD must hold a kerasdist package built "
            "against HOME's MPI")
    return name, home, build


def _job(cluster, system, steps, warmup):
    sys.path.insert(0, REPO_ROOT)
    from tests.support.helpers import launch
    from tests.support.helpers import worker_env
    name, home, build = system
    env = worker_env(TF_CPP_MIN_LOG_LEVEL=3)
    env.pop("KERASDIST_MPI_HOME", None)
    env.pop("SITE_MPI_BUILD", None)
    if home:
        env.update(KERASDIST_MPI_HOME=home, SITE_MPI_BUILD=build)
    out = launch(2, [sys.executable, os.path.abspath(__file__), "--rank",
                     "--steps", str(steps), "--warmup", str(warmup)],
                 timeout=600, env=env,
                 launcher_args=["--ssh-command", cluster.remote_shell,
                                "--network-interface", cluster.bridge,
                                "-H", "kdt0:1,kdt1:1"],
                 prefix=cluster.launcher_prefix(), root=build)
    found = [json.loads(line.split("RESULT ", 1)[1])
             for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or len(found) != 2:
        raise RuntimeError(f"{name}: exit {out.returncode}\n"
                           f"{out.stdout[-4000:]}")
    w1, w3 = found
    return {"w1": w1["w1"], "libmpi": w1["libmpi"],
            "img_s": sum(w3["rates"]), "same": w3["same"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mpi", type=_system, action="append", default=[])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        return rank_main(args.steps, args.warmup)
    systems = args.mpi or [("mpich", None, None)]
    sys.path.insert(0, REPO_ROOT)
    import statistics

    from tests.support.cluster import Cluster
    runs = {s[0]: [] for s in systems}
    with Cluster(2) as c:
        for r in range(args.rounds):
            k = r % len(systems)
            for system in systems[k:] + systems[:k]:
                runs[system[0]].append(_job(c, system, args.steps,
                                            args.warmup))
    print("# 2 hosts x 1 rank (veths, unshaped); W1: float32 Sum allreduce, "
          "median of per-call max over ranks; W3: MLP-20 model.fit, images/s "
          f"(sum over ranks), median of {args.rounds} round(s)")
    print("| MPI | libmpi | W1 4 KiB (us) | W1 16 MiB (ms) | "
          "W3 MLP-20 (img/s) |")
    print("|---|---|---|---|---|")
    table = {}
    for name, jobs in runs.items():
        w1 = {n: statistics.median(t for j in jobs for t in j["w1"][str(n)])
              for n in SIZES}
        img = statistics.median(j["img_s"] for j in jobs)
        table[name] = {"w1_s": w1, "img_s": img, "jobs": jobs}
        print(f"| {name} | {jobs[0]['libmpi']} | {w1[4 << 10] * 1e6:.0f} | "
              f"{w1[16 << 20] * 1e3:.1f} | {img:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
