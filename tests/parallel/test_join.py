"""join() on real ranks: a rank that ran out of data serves the others'
allreduces with zeros until every rank has joined, against numpy.

One test per check of tests/workers/join_worker.py and job, e.g.
`test_join_np2[uneven_training_loop]`; the checks of one job run in one
launch (tests/support/worker_checks.py). The frameworks group (JAX and
PyTorch, one check each) runs at np=2 only.
"""

import pytest

from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

# 600 s a test: the first test of a job launches it (up to 400 s).
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

WORKER = "join_worker.py"

add_job_tests(globals(), {
    "test_join_np2": WorkerChecks(
        WORKER, np=2, groups=("tf", "frameworks"), timeout=400,
        requires=("tensorflow", "jax", "torch")),
    "test_join_np3": WorkerChecks(
        WORKER, np=3, groups=("tf",), timeout=400, requires=("tensorflow",)),
})
