"""ModelAverageCallback (local SGD with periodic averaging) on real ranks.

One test per check of tests/workers/local_sgd_worker.py, named after it;
the checks of one size run in one launch of the ranks
(tests/support/worker_checks.py).
"""

import re

import pytest

from tests.support.worker_checks import WorkerChecks

# 600 s a test: the first test of a size launches the job (up to 400 s).
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

WORKER = "local_sgd_worker.py"
NP2 = WorkerChecks(WORKER, np=2, groups=("all",))
NP3 = WorkerChecks(WORKER, np=3, groups=("schedule_and_uneven",))
np2_job = NP2.fixture("np2_job")
np3_job = NP3.fixture("np3_job")


@NP2.parametrize
def test_model_average_callback_np2(check, np2_job):
    np2_job.assert_passed(check)
    if check == "k8_converges_like_sync":
        # The convergence numbers are printed for the record; the bound
        # itself is asserted in the worker.
        losses = [line for line in np2_job.rank_output(0)
                  if line.startswith("LOSS ")]
        assert len(losses) == 1 and re.search(r"k8=\d", losses[0]), losses


@NP3.parametrize
def test_model_average_callback_np3(check, np3_job):
    np3_job.assert_passed(check)
