"""A Ray cluster on the test cluster's hosts (tests/support/cluster.py).

    from tests.support.ray_cluster import RayCluster

    with Cluster(2) as c, RayCluster(c, cpus=1) as rc:
        rc.driver_env()          # the environment of a driver run in
                                 # rc.head (RAY_ADDRESS set)

`ray start --head` in the first host, bound to its address, `ray start
--address` in each of the others; `cpus` CPUs each (Ray's resource count:
so many one-CPU workers a node), no GPUs, no dashboard, a small object
store, usage stats off. close() runs `ray stop --force` in every host,
also when the start failed midway. Standard library only (Ray is started
as a command).
"""

import os
import subprocess
import sys
import tempfile

from tests.support.helpers import kill_tree
from tests.support.helpers import worker_env

PORT = 6379
# Variables of other launchers that the test session itself may run under.
DROP = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_",
        "KERAS_DISTRIBUTION_", "JAX_", "SLURM_", "SM_", "PET_", "TF_CONFIG",
        "CLUSTER_SPEC", "JOB_COMPLETION_INDEX", "KERASDIST_",
        "TORCHELASTIC_", "RAY_")


def ray_env(**extra):
    """worker_env() (the repo first on the path, TF quiet) without other
    launchers' variables, Ray's usage stats off, Train v2, `extra` set."""
    env = {k: v for k, v in worker_env().items() if not k.startswith(DROP)}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               RAY_TRAIN_V2_ENABLED="1", RAY_TRAIN_METRICS_ENABLED="0",
               RAY_TRAIN_ENABLE_PRINT_PATCH="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def ray_command(host, args, timeout=120):
    """Runs `ray ARGS` in `host`: (exit code, output). The daemons `ray
    start` leaves running stay; on a timeout everything it started is
    killed."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    with tempfile.TemporaryFile(mode="w+") as f:
        # A file, not a pipe: the daemons keep what they inherit open.
        proc = subprocess.Popen(host.nsenter() + [ray_bin, *args],
                                env=ray_env(), stdout=f,
                                stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except BaseException:
            kill_tree(proc)
            proc.wait()
            raise
        f.seek(0)
        return proc.returncode, f.read()


class RayCluster:
    """Ray on every host of `cluster`, the first one the head."""

    def __init__(self, cluster, cpus=1, object_store_mib=80):
        self.cluster = cluster
        self.head = cluster.hosts[0]
        self.address = f"{self.head.address}:{PORT}"
        common = ["--num-cpus", str(cpus), "--num-gpus", "0",
                  "--object-store-memory", str(object_store_mib * 2**20),
                  "--disable-usage-stats"]
        # Ray gives every node the head's temp dir: each host gets a
        # directory of its own mounted there (a node's logs, sockets and
        # spill files are its own, and each node's log monitor reads only
        # its own workers' logs, as on separate machines).
        temp = os.path.join(cluster.dir, "ray")
        os.makedirs(temp, exist_ok=True)
        for host in cluster.hosts[1:]:
            own = os.path.join(cluster.dir, f"ray-{host.name}")
            os.makedirs(own, exist_ok=True)
            cluster.run(host, ["mount", "--bind", own, temp])
        try:
            self._start(self.head, [
                "--head", "--node-ip-address", self.head.address,
                "--port", str(PORT), "--include-dashboard", "false",
                "--temp-dir", temp, *common])
            for host in cluster.hosts[1:]:
                self._start(host, ["--address", self.address,
                                   "--node-ip-address", host.address,
                                   *common])
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _start(host, args):
        # Once more after a failure: a node must register within 30 s
        # (Ray's own bound, ray/_private/node.py), which a machine loaded
        # with other work can miss.
        for _ in range(2):
            rc, out = ray_command(host, ["start", *args])
            if rc == 0:
                return
            ray_command(host, ["stop", "--force"], timeout=60)
        raise RuntimeError(f"ray start failed twice in {host.name}:\n"
                           + out[-3000:])

    def driver_env(self, **extra):
        """The environment of a driver started in self.head."""
        return ray_env(RAY_ADDRESS=self.address, **extra)

    def close(self):
        for host in self.cluster.hosts:
            ray_command(host, ["stop", "--force"], timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
