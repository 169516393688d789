"""A keras-hub task trained by kerasdist (tests/workers/keras_hub_worker.py):
averaged as one process on the concatenated batch when compiled with
kd.DistributedOptimizer (fully, and LoRA sharded), and a warning before
the first step when it keeps its own optimizer; with its weights sharded
(`kd.shard_weights`, `shard="weights"`), fully and with LoRA, the same
weights and then the same `generate()` as one process.

Every check on TensorFlow at np=2. The sharded weights also at np=2 and
3 on every backend (at 3, shards that do not divide evenly): each
backend's gathers and reduce-scatters inside its own step, and keras-hub's
own generate loop (JAX's jitted while loop, PyTorch's eager one). One
launch a backend and size.
"""

import pytest

from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(600)]

NP2 = WorkerChecks("keras_hub_worker.py", np=2,
                   requires=("keras_hub", "tensorflow"),
                   env={"KERAS_BACKEND": "tensorflow"})
np2_job = NP2.fixture("np2_job")


@NP2.parametrize
def test_keras_hub_np2(check, np2_job):
    np2_job.assert_passed(check)


add_job_tests(globals(), {
    f"test_keras_hub_{backend}_np{np_}": WorkerChecks(
        "keras_hub_worker.py", np=np_, groups=("weights",),
        requires=("keras_hub", backend), env={"KERAS_BACKEND": backend})
    for backend, np_ in (("tensorflow", 3), ("jax", 2), ("jax", 3),
                         ("torch", 2), ("torch", 3))},
    marks=(pytest.mark.slow,))
