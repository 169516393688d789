"""Every start-up window has a deadline (issue 49, item 2): a rank frozen
right after MPI_Init, or whose kd.init() fails after MPI_Init, ends the
whole job within KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS, each rank with a
line that names who; before, the other rank spun in MPI_Comm_dup, or the
failed rank waited in MPI_Finalize, for ever. Real `kerasdist run` jobs,
no TensorFlow."""

import re
import time

import pytest

from tests.support.helpers import launch
from tests.support.helpers import python_cmd
from tests.support.helpers import rank_env

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

START_S = 5
# From the launch to the job's end: MPI's start and the deadline, with
# slack for a loaded machine.
BOUND_S = START_S + 40

# Rank 1 starts MPI itself (as mpi4py would), then stops itself (SIGSTOP)
# before kd.init(): its MPI_Init's exchange is done, it never reaches
# kd.init()'s first collective.
_FREEZE_AFTER_MPI_INIT = """
import ctypes, os, signal
from kerasdist._core import capi
provided = ctypes.c_int(0)
assert capi.lib().MPI_Init_thread(None, None, 3, ctypes.byref(provided)) == 0
if os.environ["PMI_RANK"] == "1":
    print("rank 1 stops after MPI_Init", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
import kerasdist as kd
kd.init()
print("rank", kd.rank(), "started", flush=True)
"""


@pytest.mark.timeout(BOUND_S + 60)
def test_a_rank_frozen_after_mpi_init_ends_the_job():
    start = time.monotonic()
    out = launch(2, python_cmd(_FREEZE_AFTER_MPI_INIT), timeout=BOUND_S,
                 env=rank_env(KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=START_S))
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout[-3000:]
    assert "rank 1 stops after MPI_Init" in out.stdout, out.stdout[-3000:]
    assert "started" not in out.stdout, out.stdout[-3000:]
    assert re.search(r"kerasdist: rank 0 on host \S+: lost rank 1 on host "
                     r"\S+: it did not reach kd.init\(\)'s first collective "
                     r"within 5 s", out.stdout), out.stdout[-3000:]
    assert took < BOUND_S, (took, out.stdout[-3000:])


@pytest.mark.timeout(BOUND_S + 60)
def test_a_failing_init_after_mpi_init_ends_the_job(tmp_path):
    # Rank 0 alone opens the timeline, after MPI_Init: its directory is
    # missing.
    missing = tmp_path / "missing" / "timeline.json"
    code = "import kerasdist as kd; kd.init(); print('started', flush=True)"
    start = time.monotonic()
    out = launch(2, python_cmd(code), timeout=BOUND_S,
                 env=rank_env(KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=START_S),
                 launcher_args=["--timeline-filename", str(missing)])
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout[-3000:]
    assert "started" not in out.stdout, out.stdout[-3000:]
    assert str(missing) in out.stdout, out.stdout[-3000:]
    assert re.search(r"\[1\]<stderr>:RuntimeError: kerasdist.init\(\) failed: "
                     r"rank 0's start failed", out.stdout), out.stdout[-3000:]
    assert took < BOUND_S, (took, out.stdout[-3000:])
