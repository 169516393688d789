"""The TCP transport (ops/core/transport/tcp_communicator.h) against MPI.

    python benchmarks/tcp_transport.py [--np 2] [--sizes 4K,64K,1M,16M,64M]
        [--rounds 3] [--hosts [PROFILE]]

Builds benchmarks/tcp_transport.cc against the built core library with the
job's MPI compiler wrapper, and runs it under `kerasdist run`: in one job,
alternating round by round, MPI_Allreduce and the TCP communicator's ring
allreduce on the same float32 buffers, the mesh over loopback. Twice: with
MPI as it runs on one host (its shared memory) and with
MPIR_CVAR_NOLOCAL=1, which sends MPICH's intra-host traffic through its
network module, the same loopback the TCP transport uses (the comparison
that stands for a job across hosts). Each figure is the median over calls
of the slowest rank's time; `#wrong` counts elements that were not the sum.

With --hosts: on the test cluster (tests/support/cluster.py; needs root),
one rank on each of 2 hosts, across their veth links (PROFILE shapes them:
`10gbit`, `1gbit`; none by default), MPI as it runs across hosts.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _common

HERE = os.path.dirname(os.path.abspath(__file__))


def build():
    from kerasdist._core import capi

    with open(os.path.join(_common.REPO_ROOT, "kerasdist",
                           "_build_info.json")) as f:
        launcher_dir = json.load(f)["mpi"]["launcher_dir"]
    core = capi.library_path()
    out = os.path.join(tempfile.mkdtemp(prefix="kd_tcp_"), "tcp_transport")
    subprocess.run([os.path.join(launcher_dir, "mpicxx"), "-O2", "-std=c++17",
                    "-o", out, os.path.join(HERE, "tcp_transport.cc"),
                    "-I", os.path.join(_common.REPO_ROOT, "ops", "core"),
                    core, "-Wl,-rpath," + os.path.dirname(core)], check=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hosts", nargs="?", const="", default=None)
    args = p.parse_args()
    binary = build()
    sizes = ",".join(str(_common.parse_size(s)) for s in args.sizes.split(","))
    if args.hosts is not None:
        return across_hosts(binary, sizes, args)
    for label, extra in (("MPI with its shared memory", {}),
                         ("MPI through its network module (NOLOCAL)",
                          {"MPIR_CVAR_NOLOCAL": "1"})):
        print(f"\n## np={args.np}, against {label}\n", flush=True)
        env = dict(os.environ, **extra)
        subprocess.run([sys.executable, "-m", "kerasdist.run", "-np",
                        str(args.np), binary, "127.0.0.1", sizes,
                        str(args.rounds)], env=env, check=True, timeout=1800)


def across_hosts(binary, sizes, args):
    from tests.support.cluster import Cluster
    from tests.support.cluster import unavailable_reason
    from tests.support.helpers import launch

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"--hosts needs a test cluster: {reason}")
    cluster = Cluster(2)
    try:
        for h in cluster.hosts:
            if args.hosts:
                cluster.shape(h, args.hosts)
        print(f"\n## 2 hosts x 1 rank, links {args.hosts or 'unshaped'}, "
              "against MPI across them\n", flush=True)
        out = launch(2, [binary, "auto", sizes, str(args.rounds)],
                     timeout=1800, prefix=cluster.launcher_prefix(),
                     launcher_args=["--ssh-command", cluster.remote_shell,
                                    "--network-interface", cluster.bridge,
                                    "-H", "kdt0:1,kdt1:1"])
        print("\n".join(l.split(":", 1)[-1] for l in out.stdout.splitlines()
                        if "|" in l))
        if out.returncode != 0:
            raise SystemExit(out.stdout[-4000:])
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
