"""Trainer step checkpoints, restarts and resizes with real ranks
(tests/workers/trainer_fault_worker.py).

The reference job trains 3 epochs at np 2 without a fault. Its final state,
and the example ids and learning rate of every step of every rank, are the
truth the interrupted jobs are held to:

- killed in the middle of an epoch and restarted by `--max-restarts` at the
  same size: the same final state bit for bit, and the same steps (ids and
  learning rates) once the steps lost after the last checkpoint are
  dropped;
- killed at np 2 and resumed at np 1, or the other way round: every epoch
  trains each example exactly once (the interrupted one included), so the
  number of examples seen equals the reference's; the learning rate is that
  of the warmup at the new size from the same point of the epoch; the loss
  is within the spread of four uninterrupted runs;
- killed in each phase of a checkpoint write and in the broadcast of a
  resumed state: every restart resumes from the newest checkpoint that was
  complete, and the job ends where the reference ended.
"""

import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support import forkserver  # noqa: E402
from tests.support import trainer_records as tr  # noqa: E402
from tests.support.helpers import WORKERS  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402
from tests.support.helpers import worker_cmd  # noqa: E402
from tests.support.helpers import worker_env  # noqa: E402

pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

N, BATCH, EPOCHS, WARMUP, LR = tr.N, 8, 3, 2, 0.01  # as in the worker
_TIMEOUT = 300


def _run(np_, mode, ckpt, logs, *args, launcher_args=(), server=None):
    """The worker's job; with `server`, its ranks are forked by that
    tests/support/forkserver.py server."""
    argv = [mode, str(ckpt), str(logs), *map(str, args)]
    if server is None:
        command = worker_cmd("trainer_fault_worker.py", *argv)
    else:
        command = forkserver.command(
            server, os.path.join(WORKERS, "trainer_fault_worker.py"), *argv)
    return launch(np_, command, timeout=_TIMEOUT, env=worker_env(),
                  launcher_args=launcher_args)


def _assert_done(out, np_):
    assert out.returncode == 0, out.stdout[-6000:]
    for r in range(np_):
        assert rank_lines(out.stdout, r)[-1] == "DONE", out.stdout[-3000:]


def _warmup_lr(size, epoch, batch, steps):
    """LearningRateWarmupCallback's rate at (fractional) `batch` of
    `epoch`, computed here from its documented formula."""
    e = epoch + (batch + 1) / steps
    if epoch >= WARMUP:
        return LR * size
    return LR * (e * (size - 1) / WARMUP + 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    out = _run(2, "reference", root / "ref", root, "--tag", "ref")
    _assert_done(out, 2)
    spread = [tr.loss(out)] + [
        float(m.group(1)) for m in re.finditer(
            r"SPREAD \d (\S+)", "\n".join(rank_lines(out.stdout, 0)))]
    assert len(spread) == 4, out.stdout[-3000:]
    return root, tr.steps(root, "ref", 0, 2), spread


def test_reference_trains_every_example_once_an_epoch(reference):
    root, records, _ = reference
    steps = tr.job_steps(records)
    assert len(steps) == EPOCHS * N // (2 * BATCH)
    for ids in tr.epochs(steps):
        assert sorted(ids) == list(range(N))
    # Step checkpoints give way to the epoch checkpoints that follow them.
    assert sorted(os.listdir(root / "ref")) == [
        f"epoch-00000{e}.{x}" for e in (1, 2, 3)
        for x in ("json", "weights.h5")]


def test_restart_mid_epoch_same_size_is_exact(reference):
    root, ref_records, _ = reference
    out = _run(2, "run", root / "same", root, "--tag", "same",
               "--kill-rank", 1, "--kill-step", 22,
               launcher_args=("--max-restarts", "1"))
    _assert_done(out, 2)
    assert "rank 1 kills itself: after step 22" in out.stdout
    epoch, samples, step = tr.resumed(out)
    # Resumed within epoch 2 (index 1), at a step checkpoint before the kill.
    assert epoch == 1 and 0 < samples < N and 15 < step < 22, out.stdout
    assert samples == (step - 15) * 2 * BATCH
    np.testing.assert_array_equal(np.load(root / "same.npy"),
                                  np.load(root / "ref.npy"))
    first, second = tr.steps(root, "same", 0, 2), tr.steps(root, "same", 1, 2)
    for r in range(2):
        kept = [row for row in first[r] if row[0] <= step]
        assert kept + second[r] == ref_records[r], r


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_resume_at_another_size(reference, sizes):
    root, ref_records, spread = reference
    old, new = sizes
    tag = f"resize{old}{new}"
    ckpt = root / tag
    per_epoch = N // (old * BATCH)
    kill = per_epoch + per_epoch // 2 + 1  # in the middle of epoch 2
    out = _run(old, "run", ckpt, root, "--tag", f"{tag}a",
               "--kill-rank", old - 1, "--kill-step", kill)
    assert out.returncode != 0 and "kills itself" in out.stdout
    out = _run(new, "run", ckpt, root, "--tag", f"{tag}b")
    _assert_done(out, new)
    assert f"written at {old} ranks, now {new}" in out.stdout
    epoch, samples, step = tr.resumed(out)
    assert epoch == 1 and 0 < samples < N, out.stdout
    assert samples == (step - per_epoch) * old * BATCH

    before = tr.steps(root, f"{tag}a", 0, old)
    after = tr.steps(root, f"{tag}b", 0, new)
    # Every epoch, the interrupted one too, trains each example once: as
    # many examples seen as in the reference, none twice, none left out.
    epochs = tr.epochs(tr.job_steps(before, until=step) + tr.job_steps(after))
    assert len(epochs) == EPOCHS
    for ids in epochs:
        assert sorted(ids) == list(range(N))
    assert sum(map(len, epochs)) == sum(map(len, tr.job_steps(ref_records)))

    # The warmup goes on at the new size from the same point of epoch 2.
    new_steps = N // (new * BATCH)
    first_lr = after[0][0][1]
    want = _warmup_lr(new, epoch, samples / (new * BATCH), new_steps)
    np.testing.assert_allclose(first_lr, want, rtol=1e-6)
    assert after[0][-1][1] == pytest.approx(LR * new, rel=1e-6)

    # The loss: within the spread of four uninterrupted runs (seeds 0-3),
    # widened by that spread on either side.
    lo, hi = min(spread), max(spread)
    assert lo - (hi - lo) <= tr.loss(out) <= hi + (hi - lo), (tr.loss(out),
                                                            spread)


def test_faults_in_checkpoint_writes_and_broadcast(reference):
    root, _, _ = reference
    ckpt = root / "faults"
    # The ranks of its 7 attempts are forked from a server that imported
    # TensorFlow once (tests/support/forkserver.py).
    server = f"trainer-faults{os.getpid()}"
    with forkserver.Servers(server, forkserver.TRAINER_MODULES,
                            worker_env()):
        out = _run(2, "faults", ckpt, root, "--tag", "faults",
                   launcher_args=("--max-restarts", "6"), server=server)
    _assert_done(out, 2)
    # One attempt per fault of the worker's FAULTS, each one hit.
    attempts = re.split(r"kerasdist: attempt \d+ of 7", out.stdout)
    assert len(attempts) == 7, out.stdout[-6000:]
    faults = [r"rank 0 kills itself: at written of \.tmp-\w+epoch-\d+-"
              r"sample-\d+\.weights\.h5",
              r"rank 1 kills itself: in the broadcast kerasdist\.trainer"
              r"\.sync\.",
              r"rank 0 kills itself: at renamed of epoch-\d+-sample-\d+"
              r"\.weights\.h5",
              r"rank 0 kills itself: at written of \.tmp-\w+epoch-\d+-"
              r"sample-\d+\.json",
              r"rank 0 kills itself: at committed of epoch-\d+-sample-\d+"
              r"\.json",
              r"rank 0 kills itself: at written of \.tmp-\w+epoch-\d+"
              r"\.weights\.h5"]
    for text, fault in zip(attempts, faults):
        assert re.search(fault, text), (fault, text[-3000:])
    # Each restart finds, and resumes from, the newest checkpoint that was
    # complete when the last attempt died.
    committed = None
    for i, text in enumerate(attempts):
        newest = re.search(r"worker: newest on disk: (\S+)", text).group(1)
        assert newest == (committed or "none"), (i, newest, committed)
        resumed = re.search(r"resuming from \S*/(\S+) at", text)
        if i == 1:  # died in the broadcast, before the resume is logged
            assert resumed is None, text[-3000:]
        elif committed:
            assert resumed and resumed.group(1) == committed, (
                i, text[-3000:])
        names = re.findall(r"worker: committed (\S+)\.json", text)
        if names:
            committed = names[-1] + ".weights.h5"
    assert committed == "epoch-000003.weights.h5"
    np.testing.assert_array_equal(np.load(root / "faults.npy"),
                                  np.load(root / "ref.npy"))
