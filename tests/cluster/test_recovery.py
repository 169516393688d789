"""Recovery in place (docs/failures-and-elastic.md, "Recovery in place"),
on real processes of this machine: kerasdist built against Open MPI
(tests/support/site_mpi.py) under `kerasdist run --recover-in-place`. One
of 3 ranks (PyTorch or JAX, tests/workers/recovery_worker.py) SIGKILLs
itself mid-step; the other two keep their processes,
re-form at size 2, resume from the last commit in memory and finish, and
their weights are the ones numpy computes for that commit continued at
size 2; growing (2 ranks to 3) and shrinking (3 to 2) in place under a
discovery script (a rank lost while the job grows: a relaunch); with a
process set, its old object fails with one error after
the re-form and the set added again sums right. The default build
(mpich) refuses the flag in one line."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import site_mpi
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import launch
from tests.support.helpers import rank_env
from tests.support.helpers import worker_cmd
from tests.support.recovery import check_grown_weights
from tests.support.recovery import grown_ends
from tests.support.recovery import read_json
from tests.support.recovery import sgd
from tests.support.recovery import worker_module

pytestmark = pytest.mark.cluster

KILL_RANK, KILL_STEP, STEPS, COMMIT_EVERY = 2, 7, 12, 3
# A job's bound: PyTorch's import alone took 40 s on this 2-core machine
# under another job's load (recovering takes 0.02 s of it).
JOB_S = 300





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
    m = worker_module()
    # The truth: the commit made at 3 ranks, continued at 2.
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 3), commit,
                 STEPS, 2)
    # Not what a run that kept the steps after the commit would give.
    kept = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, KILL_STEP, 3),
                KILL_STEP, STEPS, 2)
    assert not np.allclose(truth, kept, rtol=1e-6, atol=0)
    for new_rank, rank in enumerate(survivors):
        start, end = (read_json(tmp_path, f"start.{rank}.json"),
                      read_json(tmp_path, f"end.{rank}.json"))
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
        end = read_json(directory, f"end.{rank}.json")
        assert len(end["lost_at"]) == 1, end
        assert end["set_error"] is not None and (
            "this process set was dropped when the job re-formed in place "
            "after a lost rank (now 2 ranks, renumbered); its ranks are the "
            "old job's. Add the set again with the new ranks"
            in end["set_error"]), end
    assert read_json(directory, "end.0.json")["set_sums"] == {}
    # Start ranks 1 and 2 sum 2 + 3 before the loss; rank 1 alone, 2, after.
    sums = read_json(directory, "end.1.json")["set_sums"]
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
def test_a_frozen_rank_is_recovered_in_place(openmpi_root, tmp_path):
    # SIGSTOP: MPI never learns of it, and the heartbeat (3 s) alone would
    # leave the survivors' shrink waiting for it. Its wrapper's watchdog
    # kills it once its heartbeat is silent for the timeout; the survivors
    # then re-form as after a SIGKILL, within about the timeout of the stop.
    timeout_s = 3
    out = launch(3, worker_cmd("recovery_worker.py", str(tmp_path),
                               str(KILL_RANK), str(KILL_STEP), "STOP"),
                 timeout=JOB_S, root=openmpi_root,
                 launcher_args=["--recover-in-place"],
                 env=rank_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=timeout_s,
                              RECOVERY_STEPS=STEPS,
                              RECOVERY_COMMIT_EVERY=COMMIT_EVERY))
    assert out.returncode == 0, out.stdout
    assert (f"kerasdist: rank {KILL_RANK}: its heartbeat sent nothing for "
            f"{timeout_s} s (the process is frozen or hung); killing it, so "
            "that the other ranks go on without it (recovery in place)."
            in out.stdout), out.stdout
    assert "exited with signal 9 (SIGKILL); ranks 0, 1 finished without " \
        "it (recovery in place)." in out.stdout, out.stdout
    assert "re-formed in place at 2 rank(s) (was 3)" in out.stdout, out.stdout
    stopped = read_json(tmp_path, "kill.json")["at"]
    commit = KILL_STEP // COMMIT_EVERY * COMMIT_EVERY
    m = worker_module()
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 3), commit,
                 STEPS, 2)
    for new_rank, rank in enumerate((0, 1)):
        start, end = (read_json(tmp_path, f"start.{rank}.json"),
                      read_json(tmp_path, f"end.{rank}.json"))
        assert (end["pid"], end["rank"], end["size"], end["resumed"]) == (
            start["pid"], new_rank, 2, [commit]), (start, end)
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
        # The first step after the recovery: within the heartbeat's
        # timeout of the stop, and a few seconds for this busy machine.
        first = end["done_at"][str(commit + 1)]
        assert first - stopped < timeout_s + 5, (first - stopped, end)


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
    m = worker_module()
    truth = sgd(m, np.zeros(m.FEATURES), 0, STEPS, 3)
    commit = KILL_STEP // COMMIT_EVERY * COMMIT_EVERY
    for rank in range(3):
        end = read_json(tmp_path, f"a1.end.{rank}.json")
        assert end["size"] == 3 and min(map(int, end["done_at"])) == \
            commit + 1, end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)


GROW_AT = 4  # rank 0 lists a third slot once 4 steps are done


def _grow_job(tmp_path, first, then, min_np=2, backend="torch", np_=2,
              resize_size=3, extra_args=(), extra_env=None, kill=(), **kw):
    """Runs tests/workers/recovery_worker.py at `np_` ranks (`backend`)
    under --recover-in-place with a discovery script that lists `first`,
    and `then` once rank 0 has done GROW_AT steps (the job trains 6 steps
    at `resize_size` ranks; `kill`: the worker's KILL_RANK, KILL_STEP);
    returns the output."""
    listed = tmp_path / "hosts.txt"
    listed.write_text(first)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    return launch(np_, worker_cmd("recovery_worker.py", str(tmp_path),
                                  *map(str, kill)),
                  timeout=JOB_S,
                  launcher_args=["--recover-in-place",
                                 "--host-discovery-script", str(script),
                                 "--min-np", str(min_np), "--max-np", "3",
                                 "--discovery-interval", "0.5",
                                 *extra_args],
                  env=rank_env(RECOVERY_STEPS=STEPS,
                               RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                               RECOVERY_GROW_AT=GROW_AT,
                               RECOVERY_GROW_LIST=listed,
                               RECOVERY_GROW_TO=then,
                               RECOVERY_RESIZE_SIZE=resize_size,
                               RECOVERY_BACKEND=backend,
                               KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=120,
                               **(extra_env or {})),
                  **kw)


def _check_grown(out, tmp_path, why):
    """The job grew from 2 ranks to 3 in place: the two kept their
    processes, the third trained from the commit they re-formed at, and
    every rank's weights are numpy's for the steps up to that commit at 2
    ranks and the rest at 3."""
    assert (f"kerasdist: growing from 2 to 3 ranks: {why}; in place, at "
            f"the ranks' next commit" in out.stdout), out.stdout
    ends = grown_ends(out, tmp_path, why)
    check_grown_weights(ends, STEPS, COMMIT_EVERY, GROW_AT)


@pytest.mark.timeout(JOB_S + 60)
# PyTorch, and JAX's eager collectives.
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_grow_in_place_a_discovered_slot_joins_at_a_commit(openmpi_root,
                                                           tmp_path,
                                                           backend):
    # Discovery lists a third slot on this host at step 4; the launcher
    # writes its grow request and asks the ranks to resize; at the next
    # commit the two ranks start the third themselves (MPI_Comm_spawn, in
    # the background), train on while it starts, and at the first commit
    # after it joined re-form at 3 ranks with their processes kept; the
    # new rank gets the state by broadcast and trains from that commit.
    out = _grow_job(tmp_path, "localhost:2\n", "localhost:3\n",
                    backend=backend, root=openmpi_root)
    _check_grown(out, tmp_path, "host localhost has 3 slot(s) now, not 2")


@pytest.mark.timeout(JOB_S + 60)
def test_a_rank_lost_while_new_ranks_start_falls_back_to_a_relaunch(
        openmpi_root, tmp_path):
    # The job grows at the commit of step 6, and rank 1 SIGKILLs itself
    # at step 20, while the new rank is still starting (PyTorch's import
    # alone takes seconds): the start is a collective of the job as it
    # was, which would wait for rank 1 for ever. Rank 0 ends in one line,
    # and --max-restarts relaunches 3 ranks from the last commit on disk.
    kill_step = 20
    out = _grow_job(tmp_path, "localhost:2\n", "localhost:3\n", min_np=1,
                    root=openmpi_root, kill=(1, kill_step),
                    extra_args=["--max-restarts", "1"])
    assert out.returncode == 0, out.stdout
    assert ("[0]<stderr>:kerasdist.elastic: recovery in place failed: "
            "rank 0: a rank of the job was lost (") in out.stdout, out.stdout
    assert ("; lost while the job was growing in place, which needs "
            "every rank of the job until the new ones have joined; ending "
            "this rank (a relaunch resumes from the last commit on "
            "disk)") in out.stdout
    assert "kerasdist: attempt 2 of 2 on 3 rank(s)" in out.stdout, out.stdout
    assert "re-formed in place" not in out.stdout, out.stdout
    m = worker_module()
    ends = [read_json(tmp_path, f"a1.end.{rank}.json") for rank in range(3)]
    commit = min(map(int, ends[0]["done_at"])) - 1
    last = max(map(int, ends[0]["done_at"]))
    assert commit == kill_step // COMMIT_EVERY * COMMIT_EVERY, ends[0]
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 2), commit,
                last, 3)
    for end in ends:
        assert end["size"] == 3, end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(JOB_S + 60)
# PyTorch, and JAX's eager collectives.
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_shrink_in_place_the_highest_rank_leaves_at_a_commit(openmpi_root,
                                                             tmp_path,
                                                             backend):
    # Discovery lists 2 slots of the 3 at step 4: the launcher writes its
    # shrink request (rank 2 leaves, the highest on the host) and asks the
    # ranks to resize; at the next commit (step 6) rank 2 exits with 0 and
    # ranks 0 and 1 split off (MPI_Comm_split), keep their processes, run
    # the reset callbacks and train on at 2 ranks from that commit: no step
    # restored, lost or trained twice.
    why = "host localhost has 2 slot(s) now, not 3"
    out = _grow_job(tmp_path, "localhost:3\n", "localhost:2\n", np_=3,
                    resize_size=2, backend=backend, root=openmpi_root)
    assert out.returncode == 0, out.stdout
    assert (f"kerasdist: shrinking from 3 to 2 ranks: {why}; in place, at "
            f"the ranks' next commit" in out.stdout), out.stdout
    assert f"shrank in place to 2 rank(s) (was 3; {why}): rank(s) 2 " \
        "left" in out.stdout, out.stdout
    assert "rank 2 leaves the job" in out.stdout, out.stdout
    assert "attempt 2" not in out.stdout and "exited with" not in \
        out.stdout, out.stdout
    assert read_json(tmp_path, "asked.json")["heard"], out.stdout
    left = read_json(tmp_path, "left.2.json")
    start2 = read_json(tmp_path, "start.2.json")
    commit = left["step"]
    assert commit % COMMIT_EVERY == 0 and commit > GROW_AT, left
    assert (left["pid"], left["code"]) == (start2["pid"], 0), left
    assert left["trained"] == list(range(commit)), left
    m = worker_module()
    at_commit = sgd(m, np.zeros(m.FEATURES), 0, commit, 3)
    np.testing.assert_allclose(left["w"], at_commit, rtol=1e-12, atol=1e-12)
    last = max(STEPS, commit + 6)
    truth = sgd(m, at_commit, commit, last, 2)
    assert not np.allclose(truth, sgd(m, np.zeros(m.FEATURES), 0, last, 3),
                           rtol=1e-6, atol=0)
    for rank in range(2):
        start = read_json(tmp_path, f"start.{rank}.json")
        end = read_json(tmp_path, f"end.{rank}.json")
        assert (end["pid"], end["rank"], end["size"], start["size"]) == (
            start["pid"], rank, 2, 3), (start, end)
        # The reset callbacks ran once, at the commit; every step once.
        assert end["resumed"] == [commit], end
        assert end["trained"] == list(range(last)), end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(JOB_S + 60)
def test_a_failed_shrink_in_place_falls_back_to_a_relaunch(openmpi_root,
                                                           tmp_path):
    # As above, but rank 1 dies in its reset callback, after the split:
    # rank 0's sync fails, it says so in one line and ends, and under
    # --max-restarts 1 the launcher relaunches 2 ranks, which resume from
    # the commit on disk (step 6) and end with numpy's weights.
    out = _grow_job(tmp_path, "localhost:3\n", "localhost:2\n", np_=3,
                    resize_size=2, extra_args=["--max-restarts", "1"],
                    extra_env={"RECOVERY_DIE_IN_RESET": 1},
                    root=openmpi_root)
    assert out.returncode == 0, out.stdout
    lines = [line for line in out.stdout.splitlines()
             if "shrinking in place failed: " in line]
    assert len(lines) == 1 and lines[0].startswith(
        "[0]<stderr>:kerasdist.elastic: shrinking in place failed: "), (
        out.stdout)
    assert "rank 2 leaves the job" in out.stdout, out.stdout
    assert "kerasdist: attempt 2 of 2 on 2 rank(s) (localhost:2) (the " \
        "last attempt ended because " in out.stdout, out.stdout
    commit = read_json(tmp_path, "left.2.json")["step"]
    m = worker_module()
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 3), commit,
                 commit + 6, 2)
    for rank in range(2):
        end = read_json(tmp_path, f"a1.end.{rank}.json")
        assert end["size"] == 2 and end["trained"] == list(
            range(commit, commit + 6)), end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
