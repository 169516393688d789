"""DistributedOptimizer / DistributedGradientTape on real ranks.

Each test launches tests/workers/keras_optimizer_worker.py once under the
launcher; the worker runs many checks and prints `OK <check>` per check on
every rank. Here we assert the exit code and every expected line per rank.
"""

import os
import sys

import pytest

from tests.support.helpers import REPO_ROOT, launch, rank_lines

# 600 s a test: each job's launch may take 400 s.
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

WORKER = os.path.join(REPO_ROOT, "tests", "workers",
                      "keras_optimizer_worker.py")

EQUIV = [
    "fit_sgd", "fit_adam", "fit_sgd_momentum", "fit_rmsprop", "fit_adamw",
    "fit_loss_scale", "fit_predivide", "fit_global_clipnorm",
    "fit_embedding_sgd_sparse_as_dense=False",
    "fit_embedding_sgd_sparse_as_dense=True", "fit_embedding_adam_sparse",
    "fit_uncompressed_ref", "fit_fp16", "tape_eager", "tape_function",
    "tape_function_groups3",
]
MATH = [f"{c}_{m}" for m in ("eager", "function") for c in (
    "op_sum", "backward_passes_avg=False", "backward_passes_avg=True",
    "clip_on_averaged_gradient", "num_groups", "loss_scale_outside")]
KERAS = ["isinstance", "get_config_round_trip", "double_wrap_error",
         "save_load_model", "wrap_built_optimizer", "jit_compile",
         "fit_mixed_float16", "bad_args"]


def _env():
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def _run_and_check(np, groups, expected):
    out = launch(np, [sys.executable, WORKER, *groups], timeout=400,
                 env=_env())
    assert out.returncode == 0, out.stdout[-6000:]
    for rank in range(np):
        lines = rank_lines(out.stdout, rank)
        got = {line[3:] for line in lines if line.startswith("OK ")}
        missing = [c for c in expected if c not in got]
        assert not missing, (f"rank {rank} missing {missing}\n"
                             + out.stdout[-4000:])
        assert lines[-1] == "DONE", lines[-5:]
    return out


def test_optimizer_np2_all():
    out = _run_and_check(2, [], EQUIV + MATH + KERAS)
    lines = rank_lines(out.stdout, 0)
    xla = [line for line in lines if line.startswith("XLA message: ")]
    assert len(xla) == 1 and "jit_compile=False" in xla[0]
    warned = [line for line in lines if line.startswith("XLA warning: ")]
    assert len(warned) == 1 and "turned off" in warned[0], warned


def test_optimizer_np1_no_collectives():
    _run_and_check(1, ["np1"], ["np1_fit_equals_keras",
                                "np1_no_collectives"])


def test_optimizer_np3_equivalence():
    _run_and_check(3, ["equiv", "math"], EQUIV + MATH)
