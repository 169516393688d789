"""kerasdist built against Open MPI (tests/support/site_mpi.py) started the
wrong way, on this machine: each start fails in one line per process that
names the MPI built against and what to run instead, never MPI_Init's
abort, a hang, or a job of one on every process. (Its runs across hosts,
under its mpirun and srun --mpi=pmix, are in test_multihost.py and
test_slurm.py.)"""

import os
import socket
import subprocess
import sys

import pytest

from tests.support import site_mpi
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import kill_tree
from tests.support.helpers import launch
from tests.support.helpers import launcher_env

pytestmark = pytest.mark.cluster

START = ("import kerasdist as kd; kd.init(); print('SIZE', kd.rank(), "
         "kd.size(), flush=True)")
ERROR = "kerasdist.init() failed: kerasdist was built against "


def _run(argv, root=None, timeout=60, **extra):
    env = launcher_env(dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra),
                       root)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=root or REPO_ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} ran past {timeout} s (a hang):\n{out[-3000:]}")
    return proc.returncode, out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wrong_launcher_for_the_mpi_built_against_is_one_line(openmpi_root):
    python = [sys.executable, "-c", START]
    mpirun = os.path.join(site_mpi.openmpi_home(), "bin", "mpirun")
    mpiexec = os.path.join(sys.prefix, "bin", "mpiexec")
    cases = {
        # The mpich build under Open MPI's mpirun (PMIx).
        "mpich under mpirun": (
            [mpirun, "-np", "2", "--oversubscribe", *python], None,
            ("MPICH", "PMIx launcher (OMPI_COMM_WORLD_SIZE=2",
             "MPICH's mpiexec")),
        # The Open MPI build under hydra (PMI).
        "openmpi under hydra": (
            [mpiexec, "-n", "2", *python], openmpi_root,
            ("Open MPI 5.", "PMI-1/PMI-2 launcher (PMI_FD=",
             "Open MPI's mpirun (" + mpirun)),
    }
    for what, (argv, root, parts) in cases.items():
        code, out = _run(argv, root)
        assert code != 0, (what, out)
        # Every rank that got to print (the launcher may end the other
        # at the first one's exit) says the same line.
        lines = [l for l in out.splitlines() if ERROR in l]
        assert lines and len(set(l.split("=", 1)[0] for l in lines)) == 1, (
            what, out)
        for part in (ERROR + parts[0], *parts[1:]):
            assert part in lines[0], (what, part, out)
        assert "SIZE " not in out and "unsupported PMI" not in out, (
            what, out)
    # torchrun's variables meet at a coordinator whose PMI-1 server Open
    # MPI's MPI_Init cannot use: one line at once, not a wait for rank 1.
    code, out = _run(python, openmpi_root, timeout=30, RANK="0",
                     WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(_free_port()))
    assert code != 0 and out.count(
        ERROR + "Open MPI 5.") == 1, out
    assert "cannot start from the torchrun launch convention" in out, out
    # kerasdist run's node mode serves that protocol too.
    out = launch(None, python, timeout=60, root=openmpi_root,
                 launcher_args=["--nnodes", "1", "--nproc-per-node", "2"])
    assert out.returncode == 2, out.stdout
    assert out.stdout.startswith(
        "kerasdist run: error: kerasdist was built against Open MPI"), (
        out.stdout)


def test_doctor_names_the_mpi_built_against_and_the_one_loaded(openmpi_root):
    # Its self-test runs 2 ranks under kerasdist run, here Open MPI's mpirun.
    code, out = _run([sys.executable, "-m", "kerasdist.tools.cli", "doctor"],
                     openmpi_root, timeout=180)
    lines = out.splitlines()
    home = site_mpi.openmpi_home()
    assert any(l.startswith("OK    MPI built against: Open MPI 5.")
               and "(libmpi.so.40)" in l for l in lines), out
    assert any(l.startswith("OK    MPI loaded: Open MPI v5.") for l in lines
               ), out
    assert f"OK    launcher: {os.path.join(home, 'bin', 'mpirun')}" in lines, (
        out)
    assert any(l.startswith("OK    2-rank self-test") for l in lines), out
    # Under the wrong launcher, the doctor's own line says so.
    mpiexec = os.path.join(sys.prefix, "bin", "mpiexec")
    code, out = _run([mpiexec, "-n", "1", sys.executable, "-m",
                      "kerasdist.tools.cli", "doctor", "--no-selftest"],
                     openmpi_root, timeout=120)
    assert any(l.startswith("FAIL  kerasdist was built against Open MPI")
               and "PMI-1/PMI-2 launcher" in l for l in out.splitlines()), out
