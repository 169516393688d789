"""Process sets through the core at -np 3 (sets {0,2}, {1} and the whole
job): one test per check of tests/workers/process_sets_worker.py, one
launch per group (`test_process_sets_tf[optimizer]`)."""

import pytest

from tests.support.worker_checks import WorkerChecks, add_job_tests

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(600)]

add_job_tests(globals(), {
    "test_process_sets_tf": WorkerChecks(
        "process_sets_worker.py", np=3, groups=("tf",), timeout=400,
        requires=("tensorflow",)),
    "test_process_sets_frontends": WorkerChecks(
        "process_sets_worker.py", np=3, groups=("frontends",), timeout=300,
        requires=("jax", "torch")),
})
