"""op=Adasum on real ranks against the numpy reference of Horovod's tree
(tests/support/adasum_ref.py): one test per check of
tests/workers/adasum_worker.py and size (`test_adasum_np4[grouped_per_tensor]`),
one launch per size; at -np 3 the one check is the error."""

import pytest

from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

# 600 s a test: the first test of a size launches its job (up to 400 s).
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

add_job_tests(globals(), {
    f"test_adasum_np{np_}": WorkerChecks(
        "adasum_worker.py", np=np_, groups=(group,), timeout=400,
        requires=("tensorflow", "jax", "torch"),
        env={"KERAS_BACKEND": "tensorflow"})
    for np_, group in ((2, "pow2"), (4, "pow2"), (3, "np3"))})
