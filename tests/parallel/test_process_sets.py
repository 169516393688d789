"""Process sets through the core at -np 3 (sets {0,2}, {1} and the whole
job): one test per check of tests/workers/process_sets_worker.py, one
launch per group (`test_process_sets_tf[optimizer]`); and a set's member
that leaves while another waits on the set (a launch per way of leaving)."""

import re
import time

import pytest

from tests.support.helpers import launch
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env
from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(600)]

add_job_tests(globals(), {
    "test_process_sets_tf": WorkerChecks(
        "process_sets_worker.py", np=3, groups=("tf",), timeout=400,
        requires=("tensorflow",)),
    "test_process_sets_frontends": WorkerChecks(
        "process_sets_worker.py", np=3, groups=("frontends",), timeout=300,
        requires=("jax", "torch")),
})


@pytest.mark.parametrize("how,needles", [
    # no goodbye and no MPI finalize: mpiexec stops the job at once
    ("exit", ()),
    # silent: the job's heartbeat (3 s here) ends every rank, the set's
    # waiting member included
    ("freeze", ("rank 0: lost rank 1", "rank 2: lost rank 1")),
    # a goodbye on the set and on the job: both waits fail at once
    ("shutdown", ("[0]<stdout>:OK set_member_leaves",
                  "rank 1 shut down", "[2]<stdout>:OK set_member_leaves")),
])
def test_set_member_that_leaves_ends_the_job(how, needles):
    """np 3, set {0,1}: rank 1 leaves while rank 0 waits on the set and
    rank 2 on the job (core_errors_worker.py set_member_leaves): the job
    ends within the heartbeat's bound, never hangs."""
    start = time.monotonic()
    out = launch(3, worker_cmd("core_errors_worker.py", "set_member_leaves"),
                 timeout=90, env=worker_env(
                     HOW=how, KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=3))
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout[-3000:]
    for needle in needles:
        assert needle in out.stdout, (needle, out.stdout[-3000:])
    assert "FAIL" not in out.stdout, out.stdout[-3000:]
    # rank 1 lives on for 8 s after its shutdown: the waits ended before
    waits = re.findall(r"OK set_member_leaves ([0-9.]+)s", out.stdout)
    assert all(float(w) < 6 for w in waits), (waits, out.stdout[-3000:])
    # start-up (a few s on a loaded machine) + 3 s heartbeat + the stop
    assert took < 45, (took, out.stdout[-3000:])
