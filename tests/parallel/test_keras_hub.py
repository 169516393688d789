"""A keras-hub task trained by kerasdist (tests/workers/keras_hub_worker.py):
averaged as one process on the concatenated batch when compiled with
kd.DistributedOptimizer (fully, and LoRA sharded), and a warning before
the first step when it keeps its own optimizer."""

import pytest

from tests.support.worker_checks import WorkerChecks

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(600)]

NP2 = WorkerChecks("keras_hub_worker.py", np=2, requires=("keras_hub",))
np2_job = NP2.fixture("np2_job")


@NP2.parametrize
def test_keras_hub_np2(check, np2_job):
    np2_job.assert_passed(check)
