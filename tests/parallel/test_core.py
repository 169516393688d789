"""The core runtime on real ranks: every collective against numpy (through the
C API, without TensorFlow), the TF ops, and failures that must not hang."""

import time

import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.helpers import launch
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env
from tests.support.worker_checks import WorkerChecks
from tests.support.worker_checks import add_job_tests

pytestmark = pytest.mark.parallel


def _assert_all_ranks(out, np_, line):
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(np_):
        assert any(l.startswith(line) for l in rank_lines(out.stdout, r)), (
            f"rank {r} did not print {line!r}:\n{out.stdout[-4000:]}")


def _core_groups(np_, path):
    if path == "cma-choice":
        return ("choice",)
    return (("collectives",) + (("ranks",) if np_ > 1 else ())
            + (("pieces",) if path in ("shm", "cma") and np_ > 1 else ()))


# One test per check of core_collectives_worker.py and job, e.g.
# test_collectives_np2_shm[allreduce_path]; one launch per job. "cma" has
# every allreduce read the other ranks' tensors in place, "shm" sends every
# one through shared-memory slots (the two-rank direct sum and the
# reduce-scatter of three ranks), "mpi" none; "mixed" has shared memory off
# on one rank only, so all must agree on MPI, "cma-mixed" the in-place
# reads, so all must agree on the slots.
add_job_tests(globals(), {
    f"test_collectives_np{np_}_{path.replace('-', '_')}": WorkerChecks(
        "core_collectives_worker.py", np=np_, args=(path,),
        groups=_core_groups(np_, path), timeout=180)
    for np_, path in [
        (1, "default"), (2, "default"), (3, "default"), (4, "default"),
        (2, "cma"), (3, "cma"), (2, "shm"), (3, "shm"), (2, "mpi"),
        (3, "mixed"), (3, "cma-mixed"), (2, "cma-choice")]})


def _small_dev_shm_prefix():
    """`unshare -m` + a 40 MiB tmpfs on /dev/shm for one command, or None
    where this machine does not allow it (needs root and mount namespaces)."""
    import shutil
    import subprocess
    if shutil.which("unshare") is None:
        return None
    mount = "mount -t tmpfs -o size=40m tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", mount + ' && exec "$@"', "sh"]


def test_shm_allreduce_falls_back_to_mpi_when_dev_shm_is_small():
    # 2 ranks x 48 MiB cannot be reserved in 40 MiB: with the in-place reads
    # off, every rank must agree on MPI for that size, and go back to the
    # slots for smaller ones; with them on, /dev/shm is not needed at all.
    # Reducescatter and allgather fall back alike, in-place reads or not.
    import subprocess
    import sys
    prefix = _small_dev_shm_prefix()
    if prefix is None:
        pytest.skip("needs root and mount namespaces (unshare -m) to give "
                    "the job a small /dev/shm")
    out = subprocess.run(
        prefix + [sys.executable, "-m", "kerasdist.run", "-np", "2",
                  *worker_cmd("shm_fallback_worker.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=180,
        env=worker_env(),
        cwd=REPO_ROOT)
    _assert_all_ranks(out, 2, "OK fallback")
    assert "OK 48 MiB (MPI)" in out.stdout, out.stdout[-3000:]
    assert "OK 48 MiB (in place)" in out.stdout, out.stdout[-3000:]
    # reducescatter and allgather: the slots, MPI, the slots, each time
    assert out.stdout.count("OK rs/ag 48 MiB (MPI)") == 4, out.stdout[-3000:]
    assert out.stdout.count("OK rs/ag 2 MiB (slots)") == 8, out.stdout[-3000:]


# The TF ops eagerly, in tf.function, under GradientTape and out of order:
# test_tf_ops_np2[allgather], ..., one launch per size.
add_job_tests(globals(), {
    f"test_tf_ops_np{np_}": WorkerChecks("tf_ops_worker.py", np=np_,
                                         timeout=300, fast=np_ == 2)
    for np_ in (2, 3)},
    # its launch may take 300 s
    marks=(pytest.mark.slow, pytest.mark.timeout(400)))


def test_init_errors_shutdown_is_initialized_current_settings():
    out = launch(2, worker_cmd("core_errors_worker.py", "init"), timeout=60,
                 env=worker_env())
    _assert_all_ranks(out, 2, "OK init")


def test_init_with_an_mpi4py_subcommunicator():
    out = launch(3, worker_cmd("core_errors_worker.py", "comm"), timeout=60,
                 env=worker_env())
    _assert_all_ranks(out, 3, "OK comm")


@pytest.mark.parametrize("np_", [2, 3])
def test_mismatch_fails_every_rank_with_names(np_):
    out = launch(np_, worker_cmd("core_errors_worker.py", "mismatch"),
                 timeout=60, env=worker_env())
    _assert_all_ranks(out, np_, "OK mismatch")
    assert "Mismatched shape for allreduce 'shape.x'" in out.stdout


@pytest.mark.parametrize("np_", [1, 2])
def test_enqueue_callback_reports_results_and_failures(np_):
    out = launch(np_, worker_cmd("core_errors_worker.py", "callback"),
                 timeout=60, env=worker_env())
    _assert_all_ranks(out, np_, "OK callback")


def test_stall_warns_then_fails_every_rank():
    out = launch(2, worker_cmd("core_errors_worker.py", "stall"), timeout=60,
                 env=worker_env(KERASDIST_STALL_CHECK_TIME_SECONDS=1,
                          KERASDIST_STALL_SHUTDOWN_TIME_SECONDS=3))
    _assert_all_ranks(out, 2, "OK stall")
    warnings = [l for l in rank_lines(out.stdout, 0, "stderr")
                if "kerasdist: stall:" in l]
    assert warnings and "'lonely.tensor'" in warnings[0], out.stdout
    assert "still missing on rank(s) 1" in warnings[0]


@pytest.mark.parametrize("how,needle", [
    ("exit", "rank 1 shut down"),
    ("kill", "rank 1"),
])
def test_rank_that_leaves_ends_the_job(how, needle):
    start = time.monotonic()
    out = launch(2, worker_cmd("core_errors_worker.py", "exit"), timeout=60,
                 env=worker_env(HOW=how))
    assert time.monotonic() - start < 30, out.stdout
    assert out.returncode != 0, out.stdout
    assert needle in out.stdout, out.stdout[-3000:]
