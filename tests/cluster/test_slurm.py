"""`kerasdist run` inside a real Slurm allocation on the test cluster:
munged and slurmctld on the machine, a slurmd in each test host."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cluster.test_multihost import _fields
from tests.cluster.test_multihost import layout
from tests.support import slurm as slurm_lib
from tests.support import system
from tests.support.cluster import Cluster
from tests.support.cluster import require
from tests.support.helpers import launch
from tests.support.helpers import launcher_env
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def slurm_cluster():
    require()
    reason = slurm_lib.unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and Slurm cannot run here: {reason}",
                        pytrace=False)
        pytest.skip(f"Slurm: {reason}")
    with Cluster(2) as c, slurm_lib.Slurm(c) as s:
        yield s


@pytest.fixture
def slurm(slurm_cluster):
    """The module's Slurm; each test's jobs have ended (their step
    daemons with them) before the next test begins, and before the check
    that a test leaves no process running."""
    yield slurm_cluster
    slurm_cluster.wait_jobs_done()


def in_allocation(s, launcher_args, command, np_=None, alloc=("-N2", "-n4"),
                  timeout=120):
    """`salloc ALLOC kerasdist run [LAUNCHER_ARGS] [-np NP] COMMAND`."""
    return launch(np_, command, timeout=timeout, env=s.env(worker_env()),
                  launcher_args=launcher_args,
                  prefix=s.prefix() + ["salloc", *alloc])


def _assert_topology(out, hosts, np_):
    assert out.returncode == 0, out.stdout[-4000:]
    want = layout(hosts, np_)
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        topo = [_fields(l) for l in lines if l.startswith("TOPO ")]
        assert topo == [want[r]], (r, lines)
        assert "PATHS single_node=0 in_place=0" in lines, lines


def test_np_and_hosts_come_from_the_allocation(slurm):
    out = in_allocation(slurm, ["--network-interface", slurm.cluster.bridge],
                        worker_cmd("multihost_worker.py", "4"))
    _assert_topology(out, "kdt0:2,kdt1:2", 4)
    # An uneven allocation: SLURM_TASKS_PER_NODE=2,1.
    out = in_allocation(slurm, ["--network-interface", slurm.cluster.bridge],
                        worker_cmd("multihost_worker.py", "1"),
                        alloc=("-N2", "-n3"))
    _assert_topology(out, "kdt0:2,kdt1:1", 3)


def test_np_beyond_the_allocation_is_one_line(slurm):
    out = in_allocation(slurm, [], [sys.executable, "-c", "print('never')"],
                        np_=5)
    assert out.returncode == 2
    errors = [l for l in out.stdout.splitlines() if "kerasdist" in l]
    assert errors == ["kerasdist run: error: -np 5 is more than the 4 "
                      "task(s) of this Slurm allocation "
                      "(SLURM_TASKS_PER_NODE=2(x2)); ask Slurm for more "
                      "(salloc -n 5) or lower -np"], out.stdout


def test_hosts_that_cannot_reach_back_end_the_job_with_one_line(slurm):
    # Without --network-interface hydra advertises the machine's host
    # name, which the test hosts cannot resolve: its proxies fail, and
    # mpiexec under srun would wait for them forever.
    start = time.monotonic()
    out = in_allocation(slurm, [], [sys.executable, "-c", "print('never')"],
                        timeout=60)
    assert out.returncode == 1, out.stdout
    assert time.monotonic() - start < 30
    ours = [l for l in out.stdout.splitlines() if l.startswith("kerasdist:")]
    assert len(ours) == 1, out.stdout
    assert "could not connect back to this machine at" in ours[0]
    assert "--network-interface" in ours[0]


def test_ranks_started_by_srun_directly(slurm):
    # No launcher: srun starts the ranks and MPICH talks PMI-2 to slurmd.
    argv = slurm.prefix() + ["salloc", "-N2", "-n4", "srun", "--mpi=pmi2",
                             *worker_cmd("multihost_worker.py", "4")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=launcher_env(slurm.env(worker_env())),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"srun ran past 120 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    want = layout("kdt0:2,kdt1:2", 4)
    topo = sorted((_fields(l) for l in out.splitlines()
                   if l.startswith("TOPO ")), key=lambda t: t["rank"])
    for got in topo:
        got["env_host"] = got["host"]  # no launcher, no KERASDIST_HOSTNAME
    assert topo == [want[r] for r in range(4)], out
    assert out.count("PATHS single_node=0 in_place=0") == 4, out


# A rank that starts kerasdist and prints its rank, size and libmpi.
_SIZE_LINE = ("import kerasdist as kd; kd.init(); print('SIZE', kd.rank(), "
              "kd.size(), kd.build_info()['mpi_library'][:13], flush=True)")


def _srun(s, mpi, root=None, timeout=120):
    argv = s.prefix() + ["salloc", "-N2", "-n2", "srun", f"--mpi={mpi}",
                         sys.executable, "-c", _SIZE_LINE]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=launcher_env(s.env(worker_env()), root),
                            cwd=root, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"srun ran past {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def test_srun_pmix_starts_the_open_mpi_build_not_the_mpich_one(
        slurm, openmpi_root):
    # Slurm's PMIx plugin serves Open MPI's MPI_Init directly.
    system.require("libpmix-dev")
    code, out = _srun(slurm, "pmix", openmpi_root)
    assert code == 0, out[-4000:]
    assert sorted(l for l in out.splitlines() if l.startswith("SIZE")) == [
        "SIZE 0 2 Open MPI v5.0", "SIZE 1 2 Open MPI v5.0"], out
    # The mpich wheel has no PMIx: one line per rank naming what to run,
    # not MPICH's abort (nor a job of one on each).
    code, out = _srun(slurm, "pmix")
    assert code != 0, out
    # (The two ranks' stderr may interleave within lines: counted.)
    for part in ("kerasdist.init() failed: kerasdist was built against "
                 "MPICH", "PMIx launcher (PMIX_RANK=", "srun --mpi=pmi2"):
        assert out.count(part) == 2, (part, out)
    assert "SIZE " not in out and "unsupported PMI" not in out, out
