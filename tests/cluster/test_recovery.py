"""Recovery in place (docs/failures-and-elastic.md, "Recovery in place"),
on real processes of this machine: kerasdist built against Open MPI
(tests/support/site_mpi.py) under `kerasdist run --recover-in-place`. One
of 3 ranks (PyTorch or JAX, tests/workers/recovery_worker.py) SIGKILLs
itself mid-step; the other two keep their processes,
re-form at size 2, resume from the last commit in memory and finish, and
their weights are the ones numpy computes for that commit continued at
size 2; with a process set, its old object fails with one error after
the re-form and the set added again sums right. The default build
(mpich) refuses the flag in one line."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support import site_mpi
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import WORKERS
from tests.support.helpers import launch
from tests.support.helpers import rank_env
from tests.support.helpers import worker_cmd

pytestmark = pytest.mark.cluster

KILL_RANK, KILL_STEP, STEPS, COMMIT_EVERY = 2, 7, 12, 3
# A job's bound: PyTorch's import alone took 40 s on this 2-core machine
# under another job's load (recovering takes 0.02 s of it).
JOB_S = 300


def _worker_module():
    """tests/workers/recovery_worker.py's data and step, for the truth."""
    path = os.path.join(WORKERS, "recovery_worker.py")
    spec = importlib.util.spec_from_file_location("recovery_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sgd(m, w, first, last, size):
    """The worker's steps first..last-1 at `size` ranks, in numpy."""
    x, y = m.data()
    for step in range(first, last):
        g = sum(m.gradient(w, x, y, m.rows_for(step, r, size))
                for r in range(size)) / size
        w = w - m.LR * g
    return w


def _read(directory, name):
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


@pytest.mark.timeout(JOB_S + 60)
# Rank 0 too: the coordinator, whose survivors renumber. PyTorch, and
# JAX's eager collectives; and with a process set (ranks 1 and 2), rank 1
# inside the set's allreduce when rank 2 goes.
@pytest.mark.parametrize("killed,backend,with_set", [
    (KILL_RANK, "torch", False), (0, "torch", False),
    (KILL_RANK, "jax", False), (KILL_RANK, "torch", True)])
def test_ranks_lost_error_survivors_recover_in_place(openmpi_root, tmp_path,
                                                     killed, backend,
                                                     with_set):
    survivors = [r for r in range(3) if r != killed]
    out = launch(3, worker_cmd("recovery_worker.py", str(tmp_path),
                               str(killed), str(KILL_STEP)),
                 timeout=JOB_S, root=openmpi_root,
                 launcher_args=["--recover-in-place"],
                 env=rank_env(RECOVERY_STEPS=STEPS,
                              RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                              RECOVERY_BACKEND=backend,
                              RECOVERY_PROCESS_SET=int(with_set)))
    assert out.returncode == 0, out.stdout
    assert (f"rank {killed} (host " in out.stdout and "exited with signal "
            f"9 (SIGKILL); ranks {survivors[0]}, {survivors[1]} finished "
            "without it (recovery in place)." in out.stdout), out.stdout
    assert "re-formed in place at 2 rank(s) (was 3)" in out.stdout, out.stdout
    assert not os.path.exists(tmp_path / f"end.{killed}.json")
    commit = KILL_STEP // COMMIT_EVERY * COMMIT_EVERY
    m = _worker_module()
    # The truth: the commit made at 3 ranks, continued at 2.
    truth = _sgd(m, _sgd(m, np.zeros(m.FEATURES), 0, commit, 3), commit,
                 STEPS, 2)
    # Not what a run that kept the steps after the commit would give.
    kept = _sgd(m, _sgd(m, np.zeros(m.FEATURES), 0, KILL_STEP, 3),
                KILL_STEP, STEPS, 2)
    assert not np.allclose(truth, kept, rtol=1e-6, atol=0)
    for new_rank, rank in enumerate(survivors):
        start, end = (_read(tmp_path, f"start.{rank}.json"),
                      _read(tmp_path, f"end.{rank}.json"))
        # The same process, now rank `new_rank` of 2.
        assert (start["size"], end["pid"], end["rank"], end["size"]) == (
            3, start["pid"], new_rank, 2), (start, end)
        assert end["resumed"] == [commit], end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
    if with_set:
        _check_process_set_dropped_and_added_again(tmp_path, commit)


def _check_process_set_dropped_and_added_again(directory, commit):
    """test_ranks_lost_error_survivors_recover_in_place with a process set
    of ranks 1 and 2, rank 2 lost: rank 1's set allreduce failed with
    RanksLostError (not a hang, not another error), the old ProcessSet
    then failed with one error saying why, and the set added again in the
    reset callback (now rank 1 alone) summed the right values."""
    for rank in (0, 1):
        end = _read(directory, f"end.{rank}.json")
        assert len(end["lost_at"]) == 1, end
        assert end["set_error"] is not None and (
            "this process set was dropped when the job re-formed in place "
            "after a lost rank (now 2 ranks, renumbered); its ranks are the "
            "old job's. Add the set again with the new ranks"
            in end["set_error"]), end
    assert _read(directory, "end.0.json")["set_sums"] == {}
    # Start ranks 1 and 2 sum 2 + 3 before the loss; rank 1 alone, 2, after.
    sums = _read(directory, "end.1.json")["set_sums"]
    assert sums == {str(s): 5.0 if s < commit else 2.0
                    for s in range(STEPS)}, sums


def test_recover_in_place_needs_ulfm(openmpi_root):
    # Open MPI without --with-ft: kd.init() says so in one line.
    mpirun = os.path.join(site_mpi.openmpi_home(), "bin", "mpirun")
    code = "import kerasdist as kd; kd.init(); print('started')"
    env = rank_env(KERASDIST_RECOVER_IN_PLACE=1, OMPI_ALLOW_RUN_AS_ROOT=1,
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
                   PYTHONPATH=openmpi_root)
    out = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable,
                          "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=openmpi_root)
    assert out.returncode != 0 and "started" not in out.stdout, out
    assert ("KERASDIST_RECOVER_IN_PLACE=1, but this job's MPI started "
            "without fault tolerance: start it with kerasdist run "
            "--recover-in-place") in out.stderr, out.stderr


def test_recover_in_place_refused_on_the_mpich_build():
    # The repository's build is the mpich wheel's: the launcher refuses the
    # flag in one line, and kd.init() refuses the variable.
    out = launch(2, [sys.executable, "-c", "print('COMMAND-RAN')"], timeout=60,
                 launcher_args=["--recover-in-place"])
    assert out.returncode == 2 and "COMMAND-RAN" not in out.stdout, \
        out.stdout
    assert out.stdout.startswith(
        "kerasdist run: error: --recover-in-place needs kerasdist built "
        "against Open MPI 5"), out.stdout
    code = "import kerasdist as kd; kd.init()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60, cwd=REPO_ROOT,
                         env=rank_env(KERASDIST_RECOVER_IN_PLACE=1,
                                      PYTHONPATH=REPO_ROOT))
    assert out.returncode != 0, out
    assert "KERASDIST_RECOVER_IN_PLACE=1 (kerasdist run --recover-in-place) " \
        "needs an MPI with ULFM" in out.stderr, out.stderr


@pytest.mark.timeout(JOB_S + 60)
def test_a_second_failure_while_recovering_ends_in_one_line(openmpi_root,
                                                            tmp_path):
    # Rank 1 dies in its reset callback, once the job has re-formed at 2:
    # rank 0's sync fails; it says so in one line and ends, and so does
    # the job, nonzero (a relaunch would resume from the commit on disk).
    out = launch(3, worker_cmd("recovery_worker.py", str(tmp_path),
                               str(KILL_RANK), str(KILL_STEP)),
                 timeout=JOB_S, root=openmpi_root,
                 launcher_args=["--recover-in-place"],
                 env=rank_env(RECOVERY_DIE_IN_RESET=1))
    # The first failure's code (rank 2's SIGKILL), as without the flag.
    assert out.returncode == 137, out.stdout
    lines = [l for l in out.stdout.splitlines()
             if "recovery in place failed: " in l]
    assert len(lines) == 1 and lines[0].startswith(
        "[0]<stderr>:kerasdist.elastic: recovery in place failed: "), (
        out.stdout)
    assert "rank 0 (host " in out.stdout and "exited with code 1" in \
        out.stdout, out.stdout
    assert not list(tmp_path.glob("end.*.json"))


@pytest.mark.timeout(JOB_S + 60)
def test_a_frozen_rank_ends_the_recovery_at_its_deadline(openmpi_root,
                                                         tmp_path):
    # SIGSTOP: MPI never learns of it; the heartbeat (3 s) does and the
    # survivors' collectives fail, but the shrink waits for the frozen
    # rank: at its deadline (10 s) each survivor ends in one line, and the
    # launcher ends the job, the frozen rank included (mpirun leaves it).
    out = launch(3, worker_cmd("recovery_worker.py", str(tmp_path),
                               str(KILL_RANK), str(KILL_STEP), "STOP"),
                 timeout=JOB_S, root=openmpi_root,
                 launcher_args=["--recover-in-place"],
                 env=rank_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=3))
    took = time.time() - _read(tmp_path, "kill.json")["at"]
    assert out.returncode == 75, out.stdout
    assert "lost rank 2 on host" in out.stdout and "no heartbeat for 3 s" in \
        out.stdout, out.stdout
    for rank in (0, 1):
        assert any(l.startswith(f"[{rank}]<stderr>:kerasdist: rank {rank}: "
                                "recovery in place failed: the survivors did "
                                "not re-form within 10 s")
                   for l in out.stdout.splitlines()), out.stdout
    assert "kerasdist: killed 2 process(es) of the job that outlived " \
        "mpiexec." in out.stdout, out.stdout
    # From the SIGSTOP to the launcher's exit.
    assert took < 75, (took, out.stdout)


@pytest.mark.timeout(JOB_S + 60)
def test_a_failed_recovery_falls_back_to_a_relaunch(openmpi_root, tmp_path):
    # As above, under --max-restarts 1: the launcher relaunches 3 ranks,
    # which resume from the last commit on disk (step 6) and finish with
    # the weights of 3 ranks from there.
    out = launch(3, worker_cmd("recovery_worker.py", str(tmp_path),
                               str(KILL_RANK), str(KILL_STEP)),
                 timeout=JOB_S, root=openmpi_root,
                 launcher_args=["--recover-in-place", "--max-restarts", "1"],
                 env=rank_env(RECOVERY_DIE_IN_RESET=1))
    assert out.returncode == 0, out.stdout
    assert "kerasdist: attempt 2 of 2 (the last attempt ended because " \
        "ranks 1, 2 (host " in out.stdout, out.stdout
    assert "resuming from the last commit" in out.stdout, out.stdout
    m = _worker_module()
    truth = _sgd(m, np.zeros(m.FEATURES), 0, STEPS, 3)
    commit = KILL_STEP // COMMIT_EVERY * COMMIT_EVERY
    for rank in range(3):
        end = _read(tmp_path, f"a1.end.{rank}.json")
        assert end["size"] == 3 and min(map(int, end["done_at"])) == \
            commit + 1, end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
