"""The JAX and PyTorch front ends on real ranks: every collective against
numpy (eagerly and inside jax.jit), and gradients against their analytic
values; and that neither front end imports TensorFlow.

One test per check of tests/workers/frontend_collectives_worker.py and job
(front end, mode, ranks), e.g. `test_jax_jit_np2[allgather]`; the checks of
one job run in one launch (tests/support/worker_checks.py).
"""

import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.helpers import launcher_env
from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

# 600 s a test: the first test of a job launches it (up to 400 s).
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

WORKER = "frontend_collectives_worker.py"


def _groups(front, mode, np_):
    jit = front == "jax" and mode == "jit"
    return (("collectives",) + (("jit",) if jit else ())
            + (("jit_ranks",) if jit and np_ > 1 else ()))


add_job_tests(globals(), {
    f"test_{front}_{mode}_np{np_}": WorkerChecks(
        WORKER, np=np_, args=(front, mode),
        groups=_groups(front, mode, np_), timeout=400, requires=(front,),
        fast=mode == "eager" and np_ == 2)
    for front, mode in (("jax", "eager"), ("jax", "jit"), ("torch", "eager"))
    for np_ in (1, 2, 3)})


@pytest.mark.parametrize("front", ["jax", "torch"])
def test_front_end_imports_no_tensorflow(front):
    pytest.importorskip(front)
    code = (f"import sys, kerasdist.{front} as kd; kd.init(); "
            "kd.allreduce([1.0, 2.0]); kd.shutdown(); "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120, env=launcher_env(),
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
