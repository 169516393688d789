"""The same job under Ray Train (kerasdist.ray) and under `kerasdist run`.

    python benchmarks/ray_vs_run.py [--rounds 3] [--profiles 1gbit]
        [--quick] [--json FILE]

On the test cluster (tests/support/cluster.py; needs root and ray[train]),
2 hosts x 1 rank, each host's link shaped to a profile (tc tbf, as
benchmarks/multihost.py shapes it), the same 2 processes are started in
alternating rounds:

(a) `kerasdist run -np 2 -H kdt0:1,kdt1:1` (mpiexec, the per-rank wrapper,
    the launcher's defaults);
(b) a Ray Train `DataParallelTrainer` of 2 workers with
    `backend_config=kerasdist.ray.KerasdistConfig()` on a Ray cluster of
    the same two hosts (tests/support/ray_cluster.py: one CPU each, so
    one worker a host), the driver in kdt0.

Each process runs benchmarks/conventions.py's measurement (W1: float32
Sum allreduce of 16 MiB and 4 KiB through the C API, each call timed after
an MPI barrier, the per-call maximum over ranks; W3: model.fit img/s of the
MLP-20, batch 64 per rank). Prints conventions.py's table, with (b) Ray.
`--quick`: tiny sizes, a check that the script works, not a measurement.
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile

import _common
import conventions
import multihost

HERE = os.path.dirname(os.path.abspath(__file__))
conventions.SYSTEMS = {"a": "kerasdist run", "b": "Ray Train"}
HOSTS = "kdt0:1,kdt1:1"


def _ray_loop(config):
    """A Ray worker: conventions.py's measurement; rank 0's RESULT line
    goes to a file (a Ray worker's stdout reaches the driver only as
    log lines)."""
    sys.path.insert(0, HERE)
    import conventions as conv

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        conv.rank_main(config["opts"])
    lines = [x for x in buf.getvalue().splitlines()
             if x.startswith("RESULT ")]
    if lines:
        with open(config["out"], "w") as f:
            f.write(lines[-1] + "\n")


def driver_main(opts, out):
    """Runs in kdt0 (the head's host): one Ray Train job of 2 workers."""
    import ray
    from ray.train import RunConfig
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from kerasdist.ray import KerasdistConfig

    ray.init(log_to_driver=False)
    DataParallelTrainer(
        _ray_loop, train_loop_config={"opts": opts, "out": out},
        backend_config=KerasdistConfig(),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=os.path.dirname(out))).fit()


class OnRay(multihost.Bench):
    """2 test hosts x 1 rank, and a Ray cluster of the same hosts."""

    hosts = "2 hosts x 1 rank"

    def __init__(self, args):
        super().__init__(args)
        from tests.support.ray_cluster import RayCluster
        self.ray = RayCluster(self.cluster, cpus=1)
        self.tmp = tempfile.mkdtemp(prefix="ray-vs-run-")

    def close(self):
        try:
            self.ray.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
            super().close()

    def run_a(self, opts, timeout):
        from tests.support.helpers import launch
        c = self.cluster
        out = launch(2, conventions._rank_argv(opts), timeout=timeout,
                     env=conventions._base_env(),
                     prefix=c.launcher_prefix(),
                     launcher_args=["--ssh-command", c.remote_shell,
                                    "--network-interface", c.bridge,
                                    "-H", HOSTS, "--bind-to", "none"])
        if out.returncode != 0:
            raise SystemExit(f"(a) failed (code {out.returncode}):\n"
                             + out.stdout[-4000:])
        return conventions._result(out.stdout, "(a)")

    def run_b(self, opts, timeout):
        from tests.support.helpers import start_processes
        out = os.path.join(self.tmp, f"result-{len(os.listdir(self.tmp))}")
        argv = [sys.executable, os.path.join(HERE, "ray_vs_run.py"),
                "_driver", json.dumps(opts), out]
        [(rc, text)] = start_processes(
            self.ray.head.nsenter() + argv, [self.ray.driver_env(
                PYTHONPATH=_common.REPO_ROOT + os.pathsep + HERE)],
            timeout=timeout)
        if rc != 0 or not os.path.exists(out):
            raise SystemExit(f"(b) failed (code {rc}):\n{text[-4000:]}")
        with open(out) as f:
            return conventions._result(f.read(), "(b)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_driver":
        return driver_main(json.loads(argv[1]), argv[2])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profiles", default="1gbit",
                   help="link profiles, comma-separated (10gbit, 1gbit)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, few calls and steps: a check, not a "
                   "measurement")
    p.add_argument("--steps", type=int,
                   help="W3 steps (default: conventions.py's)")
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds per job")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be 1 or more")
    from tests.support.cluster import PROFILES
    profiles = args.profiles.split(",")
    bad = [x for x in profiles if x not in PROFILES]
    if bad:
        p.error(f"--profiles: unknown {bad}; use {sorted(PROFILES)}")
    opts = conventions._plan(args.quick)
    if args.steps:
        opts["steps"] = args.steps
    args.bind_to = "none"
    bench = OnRay(args)
    results = {}
    try:
        for profile in profiles:
            bench.shape(profile)
            results[profile] = conventions.measure(bench, opts, args.rounds,
                                                   args.timeout)
            print(conventions.table(results[profile], profile, bench.hosts),
                  flush=True)
            print(flush=True)
        bench.shape(None)
    finally:
        bench.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    sys.exit(main())
