"""The same job started by `kerasdist run` and by a platform's variables.

    python benchmarks/conventions.py [--rounds 5] [--profiles 1gbit]
        [--quick] [--bind-to core|none] [--json FILE]
    python benchmarks/conventions.py --local [--rounds 1] [--quick]

On the test cluster (tests/support/cluster.py; needs root), 2 hosts x 2
ranks, each host's link shaped to a profile (tc tbf, as
benchmarks/multihost.py shapes it), the same 4 processes are started in
alternating rounds:

(a) `kerasdist run -np 4 -H kdt0:2,kdt1:2` (mpiexec, the per-rank wrapper
    with its CPU binding and huge pages, the launcher's defaults);
(b) per host, by a plain starter script inside the host (no mpiexec, no
    ssh), each process with exactly torchrun's variables (RANK WORLD_SIZE
    LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR=kdt0 MASTER_PORT): kd.init()
    forms the job through rank 0's rendezvous (docs/platforms.md, "Without
    `kerasdist run`").

Each process runs the same measurement (this file's `_rank` mode):

- W1: float32 Sum allreduce of 16 MiB and of 4 KiB through the C API (no
  TensorFlow, benchmarks/multihost.py's call); each call timed on its own
  after an MPI barrier, the per-call maximum over ranks;
- W3: model.fit images/s of the job (all ranks) for the MLP-20 of
  benchmarks/keras_scaling.py (batch 64 per rank, SGD momentum in
  DistributedOptimizer, one TF thread of each kind), timed between batch
  ends after a warm-up; the ranks' weights must agree afterwards.

Prints, per profile, a table of medians (allreduce: over rounds x calls;
img/s: over rounds) with the [min-max] range of the per-round medians, and
the ratio (b)/(a); "within 10%" is (b) at most 10% slower than (a). The
round order alternates ((a) first in even rounds).

`--local` tries the same pieces without a cluster: 2 ranks on this machine
each way ((a) `kerasdist run -np 2`, (b) 2 processes with torchrun's
variables on 127.0.0.1), no shaping. `--quick` makes every size tiny (4
KiB and 64 KiB, a few calls and steps): a check that the script works,
not a measurement.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common
import keras_scaling
import multihost

HERE = os.path.dirname(os.path.abspath(__file__))
KIB, MIB = _common.KIB, _common.MIB
SYSTEMS = {"a": "kerasdist run", "b": "torchrun's variables"}
HOSTS = "kdt0:2,kdt1:2"
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT")
# Variables of launchers and platforms that (b)'s processes must not
# inherit from this process (they would name another convention).
_DROP = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_",
         "KERAS_DISTRIBUTION_", "JAX_", "SLURM_", "SM_", "PET_",
         "TORCHELASTIC_", "TF_CONFIG", "CLUSTER_SPEC",
         "JOB_COMPLETION_INDEX", "KERASDIST_NUM_PROCESSES",
         "KERASDIST_COORDINATOR", "KERASDIST_RANK",
         "KERASDIST_RESTART_ATTEMPT")
TOLERANCE = 0.10


def _plan(quick):
    """{"sizes", "calls" (per size), "steps", "warmup"} of one job."""
    if quick:
        return {"sizes": [4 * KIB, 64 * KIB],
                "calls": {str(4 * KIB): 5, str(64 * KIB): 3},
                "steps": 4, "warmup": 2}
    return {"sizes": [16 * MIB, 4 * KIB],
            "calls": {str(16 * MIB): 10, str(4 * KIB): 100},
            "steps": 100, "warmup": 5}


# -- the ranks' side --------------------------------------------------------


def rank_main(opts):
    """One process of either system; rank 0 prints one RESULT json line:
    {"convention", "size", "hosts", "allreduce": {size: {"s": [per-call
    s], "wrong": n}}, "mlp20": {"ips": job img/s, "same": bool}}."""
    _common.quiet_tf()
    keras_scaling._threads("tensorflow")  # before TensorFlow runs anything
    import numpy as np

    import kerasdist as kd
    from kerasdist.rendezvous import conventions

    kd.init()  # before mpi4py.MPI: under (b) MPI starts here, as one job
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = kd.rank(), kd.size()
    if comm.Get_size() != n:
        raise SystemExit(f"MPI's world has {comm.Get_size()} ranks, "
                         f"kerasdist {n}")
    res = {"convention": conventions.detect(os.environ).convention,
           "size": n, "hosts": kd.cross_size(), "allreduce": {}}
    want = np.float32(n * (n + 1) // 2)
    for nbytes in opts["sizes"]:
        x = np.full(nbytes // 4, rank + 1, np.float32)
        out = np.empty_like(x)
        call = multihost._kd_allreduce(kd, x, out, f"conv.{nbytes}")
        out[:] = 0  # a call that writes nothing shows as wrong
        call()  # warm-up: connections, negotiation, buffers
        wrong = comm.allreduce(int(np.count_nonzero(out != want)))
        call()
        times = [_common.timed(call, comm)
                 for _ in range(opts["calls"][str(nbytes)])]
        res["allreduce"][str(nbytes)] = {
            "s": _common.agree(comm, {"t": times})["t"], "wrong": wrong}
    model, data = keras_scaling.setup_rank("mlp20")
    comm.Barrier()
    ips = keras_scaling._timed_fit(model, data, opts["steps"],
                                   opts["warmup"])
    rates = comm.allgather(ips)
    mine = np.concatenate([w.ravel() for w in model.get_weights()])
    sums = comm.allgather(float(np.abs(mine).sum()))
    res["mlp20"] = {"ips": float(sum(rates)), "same": len(set(sums)) == 1}
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


# -- starting the jobs --------------------------------------------------------

# Run on each host for (b): starts that host's processes, each with its own
# environment, as a platform's agent would; prints each one's exit code and
# output.
STARTER = r"""
import json, subprocess, sys, tempfile
envs, argv = json.loads(sys.argv[1])
files = [tempfile.TemporaryFile(mode="w+") for _ in envs]
procs = [subprocess.Popen(argv, env=e, stdout=f, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)
         for e, f in zip(envs, files)]
for i, (p, f) in enumerate(zip(procs, files)):
    p.wait()
    f.seek(0)
    print(f"=== process {i} rc={p.returncode}\n{f.read()}", flush=True)
"""


def _rank_argv(opts):
    return [sys.executable, os.path.join(HERE, "conventions.py"), "_rank",
            json.dumps(opts)]


def _base_env():
    """This process's environment for the ranks: the repo first on the
    path, TensorFlow quiet, no launcher's or platform's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROP) and k not in TORCHRUN}
    env["PYTHONPATH"] = (_common.REPO_ROOT + os.pathsep +
                         env.get("PYTHONPATH", "")).rstrip(os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS", "120")
    return env


def _torchrun_env(rank, size, local_size, addr, port):
    return dict(_base_env(), RANK=str(rank), WORLD_SIZE=str(size),
                LOCAL_RANK=str(rank % local_size),
                LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR=addr,
                MASTER_PORT=str(port))


def _result(text, what):
    lines = [l for l in text.splitlines() if "RESULT " in l]
    if not lines:
        raise SystemExit(f"{what}: no result:\n{text[-4000:]}")
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def _split(output):
    """[(rc, text)] of STARTER's output."""
    outs = []
    for block in output.split("=== process ")[1:]:
        head, _, body = block.partition("\n")
        outs.append((int(head.split("rc=")[1]), body))
    return outs


class Local:
    """2 ranks on this machine, each way."""

    hosts = "this machine"

    def __init__(self, args):
        self.args = args

    def shape(self, profile):
        pass

    def close(self):
        pass

    def run_a(self, opts, timeout):
        from tests.support.helpers import launch
        out = launch(2, _rank_argv(opts), timeout=timeout, env=_base_env(),
                     launcher_args=["--bind-to", self.args.bind_to])
        if out.returncode != 0:
            raise SystemExit(f"(a) failed (code {out.returncode}):\n"
                             + out.stdout[-4000:])
        return _result(out.stdout, "(a)")

    def run_b(self, opts, timeout):
        from tests.support.helpers import free_port
        from tests.support.helpers import start_processes
        port = free_port()
        results = start_processes(
            _rank_argv(opts), [_torchrun_env(r, 2, 2, "127.0.0.1", port)
                               for r in range(2)], timeout=timeout)
        for r, (rc, text) in enumerate(results):
            if rc != 0:
                raise SystemExit(f"(b) process {r} failed (code {rc}):\n"
                                 + text[-4000:])
        return _result(results[0][1], "(b)")


class OnCluster(multihost.Bench):
    """2 test hosts x 2 ranks (the cluster of benchmarks/multihost.py)."""

    hosts = "2 hosts x 2 ranks"

    def __init__(self, args):
        super().__init__(args)
        self.port = 29700

    def run_a(self, opts, timeout):
        from tests.support.helpers import launch
        c = self.cluster
        out = launch(4, _rank_argv(opts), timeout=timeout, env=_base_env(),
                     prefix=c.launcher_prefix(),
                     launcher_args=["--ssh-command", c.remote_shell,
                                    "--network-interface", c.bridge,
                                    "-H", HOSTS,
                                    "--bind-to", self.args.bind_to])
        if out.returncode != 0:
            raise SystemExit(f"(a) failed (code {out.returncode}):\n"
                             + out.stdout[-4000:])
        return _result(out.stdout, "(a)")

    def run_b(self, opts, timeout):
        from tests.support.helpers import kill_tree
        c = self.cluster
        self.port += 1  # a port of its own each round
        procs, outs = [], []
        files = []
        try:
            for node, host in enumerate(c.hosts):
                envs = [_torchrun_env(2 * node + local, 4, 2, "kdt0",
                                      self.port) for local in range(2)]
                f = tempfile.TemporaryFile(mode="w+")
                files.append(f)
                procs.append(c.popen(
                    host, [sys.executable, "-c", STARTER,
                           json.dumps([envs, _rank_argv(opts)])],
                    stdout=f, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"(b) ran past {timeout} s") from None
        finally:
            for p in procs:
                kill_tree(p)
            for f in files:
                f.seek(0)
                outs += _split(f.read())
                f.close()
        for r, (rc, text) in enumerate(outs):
            if rc != 0:
                raise SystemExit(f"(b) process {r} failed (code {rc}):\n"
                                 + text[-4000:])
        if len(outs) != 4:
            raise SystemExit(f"(b): {len(outs)} processes reported, not 4")
        return _result(outs[0][1], "(b)")


# -- the table ----------------------------------------------------------------


def _row(name, unit, a, b, higher_is_better):
    """One line: median [range] of each system, the ratio (b)/(a) and
    whether (b) is within TOLERANCE of (a)."""
    (ma, la, ha), (mb, lb, hb) = a, b
    ratio = mb / ma if ma else float("nan")
    slower = (1 / ratio - 1) if higher_is_better else (ratio - 1)
    ok = "yes" if slower <= TOLERANCE else "NO"
    return (f"  {name:<22} {unit:>6} {ma:>11.1f} {f'[{la:.1f}-{ha:.1f}]':>21}"
            f" {mb:>11.1f} {f'[{lb:.1f}-{hb:.1f}]':>21} {ratio:>9.3f} "
            f"{ok:>10}")


def table(rounds, profile, hosts):
    """The printed table of {"a": [RESULT per round], "b": [...]}."""
    a, b = rounds["a"], rounds["b"]
    lines = [
        f"# conventions: the same job on {hosts}, links {profile}; "
        f"(a) {SYSTEMS['a']}, (b) {SYSTEMS['b']} (started by convention "
        f"{b[0]['convention']!r}, (a) by {a[0]['convention']!r}); "
        f"{len(a)} round(s), alternating; medians, [min-max] of the "
        f"per-round medians; ratio = (b)/(a); within 10%: (b) at most "
        f"{TOLERANCE:.0%} slower",
        f"# {'workload':<22} {'unit':>6} {'(a)':>11} {'range':>21} "
        f"{'(b)':>11} {'range':>21} {'ratio':>9} {'within 10%':>10}"]
    for size in a[0]["allreduce"]:
        per = {k: [r["allreduce"][size]["s"] for r in v]
               for k, v in rounds.items()}
        us = {k: tuple(x * 1e6 for x in multihost._summary(v))
              for k, v in per.items()}
        wrong = sum(r["allreduce"][size]["wrong"] for v in rounds.values()
                    for r in v)
        name = f"W1 allreduce {_common.fmt_size(int(size))}"
        lines.append(_row(name, "us", us["a"], us["b"], False)
                     + ("" if not wrong else f"  ({wrong} WRONG values)"))
    ips = {}
    for k, v in rounds.items():
        vals = [r["mlp20"]["ips"] for r in v]
        ips[k] = (_common.median(vals), min(vals), max(vals))
    same = all(r["mlp20"]["same"] for v in rounds.values() for r in v)
    lines.append(_row("W3 MLP-20 model.fit", "img/s", ips["a"], ips["b"],
                      True) + ("" if same else "  (weights DIFFER)"))
    return "\n".join(lines)


def measure(bench, opts, rounds, timeout):
    """{"a": [...], "b": [...]}: one job of each system per round, the
    first alternating."""
    got = {"a": [], "b": []}
    for r in range(rounds):
        for system in (("a", "b") if r % 2 == 0 else ("b", "a")):
            run = bench.run_a if system == "a" else bench.run_b
            got[system].append(run(opts, timeout))
    return got


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_rank":
        return rank_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profiles", default="1gbit",
                   help="link profiles, comma-separated (10gbit, 1gbit)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, few calls and steps: a check, not a "
                   "measurement")
    p.add_argument("--local", action="store_true",
                   help="2 ranks on this machine each way, no cluster")
    p.add_argument("--bind-to", default="core", choices=["core", "none"],
                   help="(a)'s kerasdist run --bind-to (default core)")
    p.add_argument("--timeout", type=int, default=900,
                   help="seconds per job")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be 1 or more")
    profiles = ["none"] if args.local else args.profiles.split(",")
    if not args.local:
        from tests.support.cluster import PROFILES
        bad = [x for x in profiles if x not in PROFILES]
        if bad:
            p.error(f"--profiles: unknown {bad}; use {sorted(PROFILES)}")
    opts = _plan(args.quick)
    bench = Local(args) if args.local else OnCluster(args)
    results = {}
    try:
        for profile in profiles:
            if not args.local:
                bench.shape(profile)
            results[profile] = measure(bench, opts, args.rounds,
                                       args.timeout)
            print(table(results[profile], profile, bench.hosts), flush=True)
            print(flush=True)
        if not args.local:
            bench.shape(None)
    finally:
        bench.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    sys.exit(main())
