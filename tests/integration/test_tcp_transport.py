"""The TCP transport (KERASDIST_TRANSPORT=tcp): ranks that met at the
rendezvous form the core's TCP meshes instead of starting MPI, and every
collective runs over them (the single-host backends off, so that the data
crosses TCP), checked against numpy. A stopped rank ends the others through
the heartbeat, which runs over the same transport; input the transport
cannot serve is one line. Across hosts: tests/cluster/test_conventions.py;
recovery in place over TCP: test_tcp_recovery.py.

Real launchers and ranks, each launch's whole tree killed on a timeout.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import assert_all_gone  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402
from tests.support.helpers import worker_cmd  # noqa: E402
from tests.support.helpers import worker_env  # noqa: E402

pytestmark = pytest.mark.parallel

WORKER = worker_cmd("tcp_transport_worker.py")
# The data over TCP: the single-host backends would take it otherwise.
OFF = {"KERASDIST_SHM_ALLREDUCE": 0, "KERASDIST_CMA_ALLREDUCE": 0}


def _env(**extra):
    env = worker_env(KERASDIST_TRANSPORT="tcp", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc, extra", [(2, OFF), (3, {})])
def test_every_collective_over_tcp_matches_numpy(nproc, extra):
    out = launch(None, WORKER, timeout=120, env=_env(**extra),
                 launcher_args=("--nproc-per-node", str(nproc)))
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(nproc):
        lines = rank_lines(out.stdout, r)
        assert f"tcp-ok {r} {nproc}" in lines, out.stdout[-4000:]
        assert "transport tcp" in lines, lines
        refused = [x for x in lines if x.startswith("sets-refused ")]
        assert refused and "need the MPI transport" in refused[0], lines
        backends = [x for x in lines if x.startswith("BACKENDS ")]
        names = backends[0].split()[1].split(",")
        assert "tcp" in names and "mpi" not in names, backends
    # No MPI in the job: nothing of it in the output.
    assert "MPI" not in out.stdout.replace("the MPI transport", ""), \
        out.stdout[-4000:]


@pytest.mark.timeout(150)
def test_a_lost_rank_ends_the_others_within_the_heartbeat(tmp_path):
    env = _env(TCP_WORKER_PID_DIR=tmp_path, TCP_WORKER_SPIN=1,
               KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=3, **OFF)
    argv = [sys.executable, "-m", "kerasdist.run", "--nproc-per-node", "2",
            *WORKER]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pid.*"))) < 2 or not all(
                (tmp_path / f"pid.{r}").read_text() for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        time.sleep(3)  # both train
        # Stopped, not killed: the launcher would see a killed rank exit
        # and stop the others itself, before the heartbeat's verdict.
        os.kill(int((tmp_path / "pid.1").read_text()), signal.SIGSTOP)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-4000:]
    assert "lost rank 1" in out, out[-4000:]
    assert took < 20, (took, out[-4000:])
    assert_all_gone(tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, line", [
    ({"KERASDIST_TRANSPORT": "udp"},
     "KERASDIST_TRANSPORT='udp': the transports are mpi and tcp"),
    ({"KERASDIST_TRANSPORT": "tcp"},
     "KERASDIST_TRANSPORT=tcp needs ranks that meet at a coordinator"),
])
def test_what_tcp_cannot_serve_is_one_line(env, line):
    full = _env()
    full.update({k: str(v) for k, v in env.items()})
    out = subprocess.run(
        [sys.executable, "-c", "import kerasdist as kd; kd.init()"],
        env=full, cwd=REPO_ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: kerasdist.init() failed: "), \
        out.stderr[-2000:]
    assert line in last, last
