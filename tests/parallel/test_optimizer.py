"""DistributedOptimizer / DistributedGradientTape on real ranks.

One test per check of tests/workers/keras_optimizer_worker.py, named after
it (`pytest -k fit_rmsprop`); the checks of one size run in one launch of
the ranks (tests/support/worker_checks.py), and each test asserts that its
check passed on every rank.
"""

import pytest

from tests.support.worker_checks import WorkerChecks

# 600 s a test: the first test of a size launches the job (up to 400 s).
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

WORKER = "keras_optimizer_worker.py"
NP2 = WorkerChecks(WORKER, np=2, groups=("equiv", "math", "keras"))
NP1 = WorkerChecks(WORKER, np=1, groups=("np1",))
NP3 = WorkerChecks(WORKER, np=3, groups=("odd",))
np2_job = NP2.fixture("np2_job")
np1_job = NP1.fixture("np1_job")
np3_job = NP3.fixture("np3_job")


@NP2.parametrize
def test_distributed_optimizer_np2(check, np2_job):
    np2_job.assert_passed(check)
    if check == "jit_compile":
        lines = np2_job.rank_output(0)
        mode = [line for line in lines if line.startswith("XLA mode: ")]
        xla = [line for line in lines if line.startswith("XLA message: ")]
        warned = [line for line in lines if line.startswith("XLA warning: ")]
        assert len(mode) == 1, mode
        if mode[0] == "XLA mode: kernels":  # XLA stays on: nothing said
            assert not xla and not warned, (xla, warned)
        else:
            assert len(xla) == 1 and "jit_compile=False" in xla[0], xla
            assert len(warned) == 1 and "turned off" in warned[0], warned


@NP1.parametrize
def test_distributed_optimizer_np1(check, np1_job):
    np1_job.assert_passed(check)


@NP3.parametrize
def test_distributed_optimizer_np3(check, np3_job):
    np3_job.assert_passed(check)
