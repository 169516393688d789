"""kerasdist.SyncBatchNormalization with real ranks, on every Keras backend
(tests/workers/sync_batch_norm_worker.py): trained with
DistributedOptimizer on each rank's rows (equal and unequal batches,
channels last and first), it equals Keras' BatchNormalization trained in
one process on the global batch; its gradients, masks, renorm and
arguments too. One launch per backend at 2 ranks, one at 1 rank (plain
BatchNormalization, a saved model). One test per worker check
(`pytest -k SyncBatchNormalization`, `-k "SyncBatchNormalization and jax"`).
"""

import pytest

from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

BACKENDS = ["tensorflow", "jax", "torch"]


def _job(backend, np_, groups):
    return WorkerChecks("sync_batch_norm_worker.py", np=np_, groups=groups,
                        args=("{tmp}",), timeout=450, requires=(backend,),
                        env={"KERAS_BACKEND": backend})


add_job_tests(globals(), {
    f"test_SyncBatchNormalization_np2_{b}": _job(b, 2, (b,))
    for b in BACKENDS})
add_job_tests(globals(), {
    "test_SyncBatchNormalization_np1_tensorflow": _job("tensorflow", 1,
                                                       ("np1",))})
