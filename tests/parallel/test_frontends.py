"""The JAX and PyTorch front ends on real ranks: every collective against
numpy (eagerly and inside jax.jit), and gradients against their analytic
values; and that neither front end imports TensorFlow."""

import os
import subprocess
import sys

import pytest

from tests.support.helpers import (REPO_ROOT, WORKERS, launch, launcher_env,
                                   rank_lines, worker_env)

pytestmark = [pytest.mark.parallel, pytest.mark.slow]


@pytest.mark.parametrize("np_", [1, 2, 3])
@pytest.mark.parametrize("front, mode", [("jax", "eager"), ("jax", "jit"),
                                         ("torch", "eager")])
def test_collectives_match_numpy(front, mode, np_):
    pytest.importorskip(front)
    out = launch(np_, [sys.executable,
                       os.path.join(WORKERS, "frontend_collectives_worker.py"),
                       front, mode], timeout=400, env=worker_env())
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        assert any(l.startswith("OK gradients") for l in lines), (
            f"rank {r}:\n{out.stdout[-4000:]}")
        assert any(l.startswith("OK all ") and l.endswith(f"({front} {mode})")
                   for l in lines), f"rank {r}:\n{out.stdout[-4000:]}"
        if front == "jax" and mode == "jit":
            assert "OK jit program x3" in lines, out.stdout[-4000:]
            if np_ > 1:
                assert "OK shape mismatch in jit reaches every rank" in lines, (
                    out.stdout[-4000:])


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
