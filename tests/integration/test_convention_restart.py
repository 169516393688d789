"""A Trainer job whose processes a platform starts and restarts (no
mpiexec, no `kerasdist run`): tests/workers/trainer_fault_worker.py started
with exactly torchrun's variables, as a Kubernetes Job's pods or torchrun's
agent would start it.

- One rank is SIGKILLed in the middle of epoch 2, once a step checkpoint
  of that epoch is on disk: the other rank must end by the heartbeat,
  within its bound, never hang.
- The platform then starts the job again the same way: at 2 ranks on the
  same coordinator port, it resumes from the newest step checkpoint and
  ends with the uninterrupted job's final state, bit for bit, having
  trained the same examples in every step; at 1 rank (WORLD_SIZE=1), every
  epoch trains each example exactly once and the loss is within the
  run-to-run spread (the tolerance of tests/parallel/test_trainer_faults.py
  for a resume at another size).
- Under torchrun itself, `--max-restarts 1` restarts the group after the
  kill and the job resumes the same way (exact).

The uninterrupted reference job is started the same way (2 ranks).
"""

import re
import shutil
import sys

import numpy as np
import pytest

from tests.support import trainer_records as tr
from tests.support.helpers import free_port
from tests.support.helpers import start_processes
from tests.support.helpers import torchrun_env
from tests.support.helpers import worker_cmd

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

N, BATCH = tr.N, 8  # as in the worker
PER_EPOCH = N // (2 * BATCH)  # steps of an epoch at 2 ranks
# In the middle of epoch 2, between two step checkpoints (the worker
# writes one every 4 steps: at steps 19 and 23 of this epoch), as in
# tests/parallel/test_trainer_faults.py.
KILL_STEP = 22
HEARTBEAT_S = 3
# From the kill to the other rank's end: a dead peer's heartbeat
# connection closes at once; the rest is slack for a loaded machine.
BOUND_S = HEARTBEAT_S + 12
_TIMEOUT = 300
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(rank, size, port):
    return torchrun_env(rank, size, port,
                        KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_S,
                        KERASDIST_HEARTBEAT_INTERVAL_SECONDS=0.5,
                        KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=120)


def _start(size, port, *args, ended=None):
    """The worker on `size` processes with torchrun's variables."""
    return start_processes(
        worker_cmd("trainer_fault_worker.py", *map(str, args)),
        [_env(r, size, port) for r in range(size)], timeout=_TIMEOUT,
        ended=ended)


def _assert_done(results):
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"process {r}:\n{out[-6000:]}"
        assert re.search(r"^DONE$", out, re.M), f"process {r}:\n{out[-3000:]}"


def _loss(out):
    return float(re.search(r"^LOSS (\S+)$", out, re.M).group(1))


def _resumed(out):
    """(epoch index, examples done in it, optimizer step) of the resume."""
    m = tr.RESUMED.search(out)
    assert m, "no resume in:\n" + out[-4000:]
    return int(m.group(1)) - 1, int(m.group(2) or 0), int(m.group(3))


def _assert_exact(root, tag, first, second, step):
    """The final state and every step's ids and learning rate are the
    reference's, once the steps after the resumed checkpoint are dropped."""
    np.testing.assert_array_equal(np.load(root / f"{tag}.npy"),
                                  np.load(root / "ref.npy"))
    reference = tr.steps(root, "ref", 0, 2)
    for r in range(2):
        kept = [row for row in first[r] if row[0] <= step]
        assert kept + second[r] == reference[r], r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("platform")
    results = _start(2, free_port(), "reference", root / "ref", root,
                     "--tag", "ref")
    _assert_done(results)
    out = results[0][1]
    assert "launch convention torchrun: rank 0 of 2" in out, out[-3000:]
    spread = [_loss(out)] + [float(v) for v in
                             re.findall(r"^SPREAD \d (\S+)$", out, re.M)]
    assert len(spread) == 4, out[-3000:]
    return root, spread


@pytest.fixture(scope="module")
def killed(reference):
    """The job at 2 ranks, rank 1 SIGKILLed after step KILL_STEP:
    (its coordinator port, its results, each process's end time)."""
    root, _ = reference
    port, ended = free_port(), []
    results = _start(2, port, "run", root / "cut", root, "--tag", "cut",
                     "--kill-rank", 1, "--kill-step", KILL_STEP,
                     ended=ended)
    return port, results, ended


def _copy_of_the_checkpoints(root, name):
    shutil.copytree(root / "cut", root / name)
    return root / name


@pytest.mark.timeout(2 * _TIMEOUT)
def test_the_other_rank_ends_within_the_heartbeat_bound(killed):
    _, [(rc0, out0), (rc1, out1)], ended = killed
    assert rc1 == -9, out1[-3000:]  # SIGKILL
    assert f"rank 1 kills itself: after step {KILL_STEP}" in out1
    # Rank 0 learns of the loss from its heartbeat and ends with 75.
    assert rc0 == 75, out0[-3000:]
    assert re.search(r"kerasdist: rank 0: lost rank 1 .*; ending this rank",
                     out0), out0[-3000:]
    assert "DONE" not in out0
    took = ended[0] - ended[1]
    assert 0 <= took < BOUND_S, (took, out0[-3000:])


@pytest.mark.timeout(2 * _TIMEOUT)
def test_restart_at_the_same_size_on_the_same_port_is_exact(reference,
                                                            killed):
    root, _ = reference
    port = killed[0]
    ckpt = _copy_of_the_checkpoints(root, "same")
    results = _start(2, port, "run", ckpt, root, "--tag", "same")
    _assert_done(results)
    out = results[0][1]
    epoch, samples, step = _resumed(out)
    # Within epoch 2, at a step checkpoint before the kill.
    assert epoch == 1 and 0 < samples < N, out[-3000:]
    assert PER_EPOCH < step < KILL_STEP, out[-3000:]
    assert samples == (step - PER_EPOCH) * 2 * BATCH
    _assert_exact(root, "same", tr.steps(root, "cut", 0, 2),
                  tr.steps(root, "same", 0, 2), step)


@pytest.mark.timeout(2 * _TIMEOUT)
def test_restart_at_one_rank_trains_every_example_once(reference, killed):
    root, spread = reference
    ckpt = _copy_of_the_checkpoints(root, "one")
    [(rc, out)] = results = _start(1, killed[0], "run", ckpt, root,
                                   "--tag", "one")
    _assert_done(results)
    assert "written at 2 ranks, now 1" in out, out[-3000:]
    epoch, samples, step = _resumed(out)
    assert epoch == 1 and 0 < samples < N, out[-3000:]
    assert samples == (step - PER_EPOCH) * 2 * BATCH
    before = tr.steps(root, "cut", 0, 2)
    after = tr.steps(root, "one", 0, 1)
    # Every epoch, the interrupted one too, trains each example once.
    epochs = tr.epochs(tr.job_steps(before, until=step) +
                       tr.job_steps(after))
    assert len(epochs) == 3
    for ids in epochs:
        assert sorted(ids) == list(range(N))
    reference_steps = tr.job_steps(tr.steps(root, "ref", 0, 2))
    assert sum(map(len, epochs)) == sum(map(len, reference_steps))
    # The loss: within the spread of four uninterrupted runs (seeds 0-3),
    # widened by that spread on either side.
    lo, hi = min(spread), max(spread)
    assert lo - (hi - lo) <= _loss(out) <= hi + (hi - lo), (_loss(out),
                                                          spread)


@pytest.mark.timeout(2 * _TIMEOUT)
def test_torchrun_max_restarts_resumes_exactly(reference):
    pytest.importorskip("torch.distributed.run")
    root, _ = reference
    env = _env(0, 1, 1)
    for k in _TORCHRUN_VARIABLES:
        env.pop(k)
    [(rc, out)] = start_processes(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
         "2", "--max-restarts", "1", "--master-port", str(free_port()),
         *worker_cmd("trainer_fault_worker.py", "run", str(root / "tr"),
                     str(root), "--tag", "tr", "--kill-rank", "1",
                     "--kill-step", str(KILL_STEP))[1:]],
        [env], timeout=_TIMEOUT)
    assert rc == 0, out[-6000:]
    assert f"rank 1 kills itself: after step {KILL_STEP}" in out
    assert out.count("DONE") == 2, out[-3000:]
    assert ("kerasdist.Trainer: restart attempt 2 "
            "(TORCHELASTIC_RESTART_COUNT=1)") in out, out[-3000:]
    epoch, samples, step = _resumed(out)
    assert epoch == 1 and 0 < samples < N, out[-3000:]
    assert PER_EPOCH < step < KILL_STEP, out[-3000:]
    _assert_exact(root, "tr", tr.steps(root, "tr", 0, 2),
                  tr.steps(root, "tr", 1, 2), step)
