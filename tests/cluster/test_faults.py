"""Faults across test hosts: whatever dies or goes silent, no rank waits
forever. Each case starts 3 ranks (kdt0: rank 0; kdt1: ranks 1 and 2), and
rank 2 brings a fault about at a chosen moment (tests/workers/
fault_worker.py): SIGKILL of itself or of its whole host's ranks, SIGSTOP,
an uncaught exception, its host's link taken down, or every packet on it
dropped by nftables. Then `kerasdist run` must end nonzero within the bound,
say in a line of its own which host and ranks were lost, leave no rank
behind on any host, and not show MPI's "BAD TERMINATION" banner."""

import os
import re
import time

import pytest

from tests.cluster import Cluster, processes_in, require, run_on
from tests.helpers import worker_cmd, worker_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HEARTBEAT_TIMEOUT_S = 3
# From the fault to the launcher's exit: the heartbeat's timeout, the
# launcher's settling moment, and its escalation when mpiexec waits for a
# host it cannot reach (SIGKILL after 20 s).
BOUND_S = HEARTBEAT_TIMEOUT_S + 25
HOSTS = "kdt0:1,kdt1:2"

# What the launcher's own line must say, by fault.
EXPECTED = {
    "kill": r"rank 2 \(host kdt1\) exited with signal 9 \(SIGKILL\)",
    "kill_host": r"ranks 1, 2 \(host kdt1\) exited with signal 9 \(SIGKILL\)",
    "exception": r"rank 2 \(host kdt1\) exited with code 1",
    "freeze": r"lost rank 2 on host kdt1: no heartbeat for 3 s",
    "link_down": r"lost host kdt1 \(ranks 1, 2\): no heartbeat for 3 s",
    "drop": r"lost host kdt1 \(ranks 1, 2\): no heartbeat for 3 s",
}

CASES = [("allreduce", f) for f in EXPECTED] + [
    ("broadcast", "kill"), ("broadcast", "freeze"), ("broadcast", "drop"),
    ("mpi4py", "exception"), ("mpi4py", "freeze")]


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        yield c


def _launcher_lines(output):
    """The launcher's own lines (not a rank's)."""
    return [l for l in output.splitlines() if l.startswith("kerasdist: ")]


@pytest.mark.parametrize("where, fault", CASES)
def test_a_fault_ends_every_rank_within_the_bound(cluster, tmp_path, where,
                                                  fault):
    kdt1 = cluster.host("kdt1")
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S,
                     KERASDIST_HEARTBEAT_INTERVAL_SECONDS=0.5)
    try:
        out = run_on(cluster, 3, HOSTS, worker_cmd(
            "fault_worker.py", where, fault, "2", str(tmp_path)),
            timeout=BOUND_S + 90, env=env)
        ended = time.time()
    finally:
        cluster.restore(kdt1)
        cluster.undrop(kdt1)
    assert out.returncode != 0, out.stdout[-3000:]
    with open(os.path.join(tmp_path, "fault")) as f:
        faulted = float(f.read().split()[0])
    assert ended - faulted < BOUND_S, (ended - faulted, out.stdout[-3000:])
    said = _launcher_lines(out.stdout)
    assert any(re.search(EXPECTED[fault], l) for l in said), (
        said, out.stdout[-6000:])
    assert "BAD TERMINATION" not in out.stdout
    assert "finished" not in out.stdout
    for host in cluster.hosts:
        left = [c for c in processes_in(cluster, host, settle=10.0)
                if "fault_worker" in c]
        assert left == [], (host.name, left)
