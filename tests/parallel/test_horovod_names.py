"""Horovod's names that kerasdist adds for drop-in scripts (rank_op,
broadcast_object, grouped_allgather, load_model, the partial optimizer and
tape, ...) with real ranks, on every Keras backend: one test per check of
tests/workers/horovod_names_worker.py and backend
(`test_horovod_names_jax[broadcast_object]`), one launch per backend."""

import pytest

from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

# 600 s a test: the first test of a backend launches its job (up to 400 s).
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

add_job_tests(globals(), {
    f"test_horovod_names_{backend}": WorkerChecks(
        "horovod_names_worker.py", np=2, groups=(backend,), args=("{tmp}",),
        timeout=400, requires=(backend,), env={"KERAS_BACKEND": backend})
    for backend in ("tensorflow", "jax", "torch")})
