"""kerasdist.callbacks with real ranks: one training job runs every check
(tests/workers/keras_callbacks_worker.py), a second, fresh job resumes from
the first job's checkpoint; plus the MNIST-style example at small size."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402

# 600 s a test: the module's training job (up to 300 s) runs in the first
# test's setup, and the resume test launches another.
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

NP = 2
_WORKER = os.path.join(REPO_ROOT, "tests", "workers",
                       "keras_callbacks_worker.py")
_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")

TRAIN_CHECKS = [
    "broadcast_root0_built", "broadcast_root0_deferred",
    f"broadcast_root{NP - 1}_built", f"broadcast_root{NP - 1}_deferred",
    "broadcast_optimizer_state", "verify_passes", "verify_raises",
    "metric_average_every_batch_False", "metric_average_every_batch_True",
    "warmup_lr_and_momentum_correction_True",
    "warmup_lr_and_momentum_correction_False",
    "learning_rate_schedule_staircase_True",
    "learning_rate_schedule_staircase_False",
    "learning_rate_schedule_constant_multiplier", "checkpoint_rank0_only",
]
SCHEDULE_CHECKS = [c for c in TRAIN_CHECKS
                   if c.startswith("learning_rate_schedule_")]
RESUME_CHECKS = ["checkpoint_loaded_state",
                 "checkpoint_resume_matches_uninterrupted"]


def _assert_checks(out, checks):
    assert out.returncode == 0, out.stdout[-6000:]
    for r in range(NP):
        lines = rank_lines(out.stdout, r)
        done = [line[3:] for line in lines if line.startswith("OK ")]
        assert done == checks, (r, done, out.stdout[-6000:])
        assert lines[-1] == "DONE"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("callbacks")
    out = launch(NP, [sys.executable, _WORKER, "train", str(directory)],
                 timeout=300, env=_ENV)
    return directory, out


def test_training_checks(trained):
    _, out = trained
    _assert_checks(out, TRAIN_CHECKS)


def test_learning_rate_schedule_callback(trained):
    # LearningRateScheduleCallback in the training job: staircase and
    # fractional epochs in [start, end), a constant multiplier, against
    # closed-form rates on every rank.
    _, out = trained
    for r in range(NP):
        done = [line[3:] for line in rank_lines(out.stdout, r)
                if line.startswith("OK ")]
        missing = [c for c in SCHEDULE_CHECKS if c not in done]
        assert not missing, (r, missing, out.stdout[-6000:])


def test_checkpoint_files_and_no_temporaries(trained):
    directory, out = trained
    assert out.returncode == 0, out.stdout[-6000:]
    names = sorted(os.listdir(directory / "rank0"))
    assert names == ["epoch1.weights.h5", "epoch2.weights.h5",
                     "epoch3.weights.h5"]
    assert not (directory / "rank1").exists()
    leftovers = [p for p in directory.rglob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_resume_in_fresh_job(trained):
    directory, out = trained
    assert out.returncode == 0, "the training job failed"
    out = launch(NP, [sys.executable, _WORKER, "resume", str(directory)],
                 timeout=300, env=_ENV)
    _assert_checks(out, RESUME_CHECKS)


def test_mnist_example_small(tmp_path):
    out = launch(NP, [sys.executable,
                      os.path.join(REPO_ROOT, "examples", "keras_mnist.py"),
                      "--epochs", "2", "--checkpoint-dir", str(tmp_path)],
                 timeout=300, env=_ENV)
    assert out.returncode == 0, out.stdout[-6000:]
    accs = []
    for r in range(NP):
        text = "\n".join(rank_lines(out.stdout, r))
        m = re.search(r"test accuracy: ([0-9.]+)", text)
        assert m, text[-3000:]
        accs.append(float(m.group(1)))
    # Ten classes: chance is 0.1. Both ranks evaluate the same weights.
    assert accs[0] == accs[1]
    assert accs[0] > 0.5, accs
    assert sorted(os.listdir(tmp_path)) == ["epoch1.weights.h5",
                                            "epoch2.weights.h5"]
    # Run again with one epoch more: it says where it resumes and trains
    # only that epoch.
    out = launch(NP, [sys.executable,
                      os.path.join(REPO_ROOT, "examples", "keras_mnist.py"),
                      "--epochs", "3", "--checkpoint-dir", str(tmp_path)],
                 timeout=300, env=_ENV)
    assert out.returncode == 0, out.stdout[-6000:]
    said = [ln for ln in rank_lines(out.stdout, 0) if "resuming" in ln]
    assert said == [f"resuming from {tmp_path / 'epoch2.weights.h5'}: "
                    "epoch 3 of 3"], out.stdout[-3000:]
    assert "epoch3.weights.h5" in os.listdir(tmp_path)


def test_model_checkpoint_on_rank0_alone_ends_when_the_others_do():
    """Horovod scripts add their checkpoint callback on rank 0 only: its
    end-of-fit wait must not fail once the other ranks have finished.
    (Keras' numpy backend: no framework to start.)"""
    code = ("import kerasdist as kd\n"
            "from kerasdist.callbacks import ModelCheckpoint\n"
            "kd.init()\n"
            "if kd.rank() == 0:\n"
            "    ModelCheckpoint('m.keras').on_train_end()\n"
            "print('done', kd.rank(), flush=True)\n")
    out = launch(2, [sys.executable, "-c", code], timeout=120,
                 env=dict(os.environ, KERAS_BACKEND="numpy"))
    assert out.returncode == 0, out.stdout[-3000:]
    for r in (0, 1):
        assert rank_lines(out.stdout, r) == [f"done {r}"], out.stdout
