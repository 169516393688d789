"""kerasdist.Trainer with real ranks (tests/workers/trainer_worker.py).

Job A trains 4 epochs straight and runs the checks of a trained job; its
final state (weights and optimizer variables) is the reference the
interrupted jobs must reproduce exactly: a job SIGKILLed after the epoch-2
checkpoint and relaunched, a job restarted by `--max-restarts 1` after a
kill in epoch 3, and a job resuming from a directory whose newest
checkpoint was truncated. Fine-tuning loads A's checkpoint at np 1 and 3.
"""

import os
import re
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402

# 600 s a test: the module's reference job (up to 300 s) runs in the first
# test's setup, and some tests launch two or three jobs.
pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

NP = 2
_WORKER = os.path.join(REPO_ROOT, "tests", "workers", "trainer_worker.py")
_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
_TIMEOUT = 300


def _run(np_, *args, launcher_args=()):
    return launch(np_, [sys.executable, _WORKER, *map(str, args)],
                  timeout=_TIMEOUT, env=_ENV, launcher_args=launcher_args)


def _assert_checks(out, checks, np_=NP):
    assert out.returncode == 0, out.stdout[-6000:]
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        done = [line[3:] for line in lines if line.startswith("OK ")]
        assert done == checks, (r, done, out.stdout[-6000:])
        assert lines[-1] == "DONE", out.stdout[-3000:]


def _assert_same_state(path, reference):
    got, want = np.load(path), np.load(reference)
    assert got.shape == want.shape
    # Same data order, dropout masks and optimizer state: the runs do the
    # same float32 operations in the same order, so this is exact in
    # practice; 1e-6 leaves room for a reordered reduction.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    out = _run(NP, "train", root / "a", root / "a.npy")
    return root, out


def test_train_checks(straight):
    _, out = straight
    _assert_checks(out, [
        "metrics_improve", "history_identical_on_ranks",
        "weights_identical_on_ranks", "steps_and_learning_rate",
        "evaluate_is_whole_set_average",
        "checkpoints_atomic_rotated_and_complete",
        "data_is_sharded_uneven_parts"])
    # Progress bar and logs on rank 0 only.
    assert any("Epoch 4/4" in line for line in rank_lines(out.stdout, 0))
    assert not any("Epoch" in line for line in rank_lines(out.stdout, 1))


def test_sigkill_after_checkpoint_then_relaunch(straight):
    root, out = straight
    assert out.returncode == 0, "the reference job failed"
    ckpt = root / "b"
    killed = _run(NP, "resume", ckpt, root / "b.npy",
                  "--kill-after-epoch", 2)
    assert killed.returncode != 0
    assert "kills itself" in killed.stdout
    assert not (root / "b.npy").exists()
    assert sorted(os.listdir(ckpt)) == [
        "epoch-000001.json", "epoch-000001.weights.h5",
        "epoch-000002.json", "epoch-000002.weights.h5"]
    out = _run(NP, "resume", ckpt, root / "b.npy")
    _assert_checks(out, ["resumed_job_finished"])
    for r in range(NP):
        assert "worker: initial_epoch 2" in rank_lines(out.stdout, r)
    assert any("resuming from" in line and "epoch-000002.weights.h5" in line
               and "at epoch 3 of 4" in line
               for line in rank_lines(out.stdout, 0))
    _assert_same_state(root / "b.npy", root / "a.npy")


def test_max_restarts_resumes_after_kill_in_epoch_3(straight):
    root, out = straight
    assert out.returncode == 0, "the reference job failed"
    out = _run(NP, "resume", root / "c", root / "c.npy",
               "--kill-in-epoch", 3, launcher_args=("--max-restarts", "1"))
    assert "kills itself" in out.stdout
    assert "attempt 2 of 2" in out.stdout
    _assert_checks(out, ["resumed_job_finished"])
    rank0 = rank_lines(out.stdout, 0)
    assert any("restart attempt 2" in line for line in rank0), rank0
    assert any("at epoch 3 of 4" in line for line in rank0), rank0
    _assert_same_state(root / "c.npy", root / "a.npy")


def test_truncated_newest_checkpoint_falls_back(straight):
    root, out = straight
    assert out.returncode == 0, "the reference job failed"
    shutil.copytree(root / "a", root / "d")
    shutil.copytree(root / "a", root / "e")
    newest = root / "d" / "epoch-000004.weights.h5"
    os.truncate(newest, os.path.getsize(newest) // 2)
    for name in os.listdir(root / "e"):
        if name.endswith(".h5"):
            os.truncate(root / "e" / name, 100)
    out = _run(NP, "corrupt", root / "d", root / "d.npy",
               "--all-bad", root / "e")
    _assert_checks(out, ["fell_back_to_previous_checkpoint",
                         "all_damaged_raises"])
    errors = "\n".join(rank_lines(out.stdout, 0, "stderr"))
    assert re.search(r"skipping damaged checkpoint: .*"
                     + re.escape(str(newest)), errors), errors[-3000:]
    assert any("epoch-000003.weights.h5 at epoch 4 of 4" in line
               for line in rank_lines(out.stdout, 0))
    # Resuming from epoch 3 and training epoch 4 again ends where A ended.
    _assert_same_state(root / "d.npy", root / "a.npy")


@pytest.mark.parametrize("np_", [1, 3])
def test_fine_tune_at_another_size(straight, np_):
    root, out = straight
    assert out.returncode == 0, "the reference job failed"
    out = _run(np_, "finetune", root / "a", root / f"f{np_}.npy",
               "--new-dir", root / f"f{np_}")
    _assert_checks(out, ["loaded_checkpoint_state", "freeze_by_name",
                         "fine_tune_improves_on_new_data",
                         "fine_tune_checkpoints"], np_=np_)
    loaded = [line for line in rank_lines(out.stdout, 0)
              if "loaded checkpoint" in line]
    assert len(loaded) == 1 and re.search(
        r"^kerasdist\.Trainer: loaded checkpoint \S+epoch-000004\.weights\.h5 "
        r"\(after epoch 4, optimizer step \d+\)$", loaded[0]), loaded


def test_example_small(tmp_path):
    out = launch(NP, [sys.executable,
                      os.path.join(REPO_ROOT, "examples", "trainer_mnist.py"),
                      "--epochs", "2", "--checkpoint-dir", str(tmp_path)],
                 timeout=_TIMEOUT, env=_ENV)
    assert out.returncode == 0, out.stdout[-6000:]
    accs = []
    for r in range(NP):
        text = "\n".join(rank_lines(out.stdout, r))
        m = re.search(r"test accuracy: ([0-9.]+)", text)
        assert m, text[-3000:]
        accs.append(float(m.group(1)))
    assert accs[0] == accs[1]
    assert accs[0] > 0.5, accs  # ten classes: chance is 0.1
    assert sorted(os.listdir(tmp_path)) == [
        "epoch-000001.json", "epoch-000001.weights.h5",
        "epoch-000002.json", "epoch-000002.weights.h5"]
