"""Processes started the way platforms start them (torchrun's or Keras'
variables, no mpiexec) form one job in kd.init(); bad variables, a missing
coordinator and a missing rank are one clear error within a bound.

Every test starts real processes with a timeout that kills their trees.
"""

import os
import sys
import time

import pytest

from tests.support.helpers import WORKERS
from tests.support.helpers import free_port
from tests.support.helpers import start_processes
from tests.support.helpers import torchrun_env

pytestmark = pytest.mark.parallel

WORKER = [sys.executable, os.path.join(WORKERS,
                                       "launch_convention_worker.py")]


def _env(rank, size, port, **extra):
    env = torchrun_env(rank, size, port, **extra)
    env["PYTHONPATH"] = WORKERS + os.pathsep + env["PYTHONPATH"]
    return env


def _keras_env(rank, size, port):
    env = _env(rank, size, port)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    env.update(KERAS_DISTRIBUTION_JOB_ADDRESSES=",".join(
        f"127.0.0.1:{port + i}" for i in range(size)),
        KERAS_DISTRIBUTION_NUM_PROCESSES=str(size),
        KERAS_DISTRIBUTION_PROCESS_ID=str(rank))
    return env


def _assert_formed(results, size, convention):
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"process {r}:\n{out}"
        assert f"ok {r} {size} " in out, f"process {r}:\n{out}"
    log = [line for line in results[0][1].splitlines()
           if "launch convention" in line]
    assert len(log) == 1, results[0][1]
    assert f"launch convention {convention}: rank 0 of {size}" in log[0]
    assert not any("launch convention" in out for _, out in results[1:])


@pytest.mark.timeout(150)
def test_torchrun_variables_form_one_job():
    # With a secret, and a foreign client flooding the coordinator's port
    # all the while (PMI commands, forged hellos, garbage, idle
    # connections): the job forms and computes as without.
    import threading

    from tests.support.hostile import foreigner
    port = free_port()
    stop, sent = threading.Event(), []
    flood = threading.Thread(target=foreigner, args=(port, stop, sent))
    flood.start()
    try:
        results = start_processes(
            WORKER, [_env(r, 2, port, KERASDIST_JOB_SECRET="s" * 32)
                     for r in range(2)], timeout=120)
    finally:
        stop.set()
        flood.join(10)
    assert len(sent) > 10
    _assert_formed(results, 2, "torchrun")
    assert "ok 1 2 1 2" in results[1][1]  # local rank from MPI, same host
    assert f"coordinator 127.0.0.1:{port}" in results[0][1]
    assert "unauthenticated" not in results[0][1] + results[1][1]


@pytest.mark.timeout(120)
def test_a_gone_rendezvous_server_is_one_line_not_a_segfault():
    # The server killed after the job formed: MPICH's MPI_Finalize would
    # crash (SIGSEGV) in its PMI barrier; each rank instead says why it
    # skips it, and keeps its own exit status.
    port = free_port()
    worker = [sys.executable, os.path.join(WORKERS,
                                           "rendezvous_gone_worker.py")]
    results = start_processes(worker, [_env(r, 2, port) for r in range(2)],
                              timeout=90)
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"process {r} (rc {rc}):\n{out}"
        assert f"done {r}" in out, out
        assert (f"kerasdist: rank {r}: the job's rendezvous server (rank "
                f"0's, on the coordinator's port) has gone, so MPI cannot "
                f"finalize; this process ends without MPI_Finalize") in out
    # Without a secret, rank 0 says once that the control plane is
    # unauthenticated, naming what sets one.
    notice = "kerasdist: rank 0: the rendezvous is unauthenticated (no "
    assert results[0][1].count(notice) == 1, results[0][1]
    assert "KERASDIST_JOB_SECRET" in results[0][1].partition(notice)[2]
    assert "unauthenticated" not in results[1][1], results[1][1]


LOSS_WORKER = [sys.executable, os.path.join(WORKERS,
                                            "startup_loss_worker.py")]
# The PMI commands of MPICH's MPI_Init on one host with kerasdist's
# rendezvous (initack, init, get_maxes, get_appnum, get_my_kvsname, and
# three gets: PMI_process_mapping, which the server answers, so MPICH
# exchanges no host names and enters no PMI barrier, PMI_hwloc_xmlfile,
# PMI_mpi_memory_alloc_kinds). Rank 1 dies once the last is answered,
# inside MPI_Init, where rank 0 then waits for its shared memory.
# (`startup_loss_worker.py log 1` shows them.)
MPI_INIT_COMMANDS = 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["joined", "mpi_init", "after"])
def test_a_rank_lost_while_or_after_the_job_starts_ends_the_other(when):
    # Inside MPI_Init after its last PMI command, rank 0 would wait for
    # rank 1's shared memory for ever with nothing to say: the rendezvous
    # ends it at once, with the heartbeat's kind of line and code; so too
    # when rank 1 ends between meeting and its MPI's start (rank 0 would
    # wait at MPI's barrier until the rendezvous deadline). After
    # kd.init(), the heartbeat itself does, as before (and the rendezvous
    # says nothing).
    port = free_port()
    ended = []
    results = start_processes(
        LOSS_WORKER + [when, "1", str(MPI_INIT_COMMANDS)],
        [_env(r, 2, port, KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=30)
         for r in range(2)], timeout=90, ended=ended)
    (rc0, out0), (rc1, out1) = results
    assert rc1 == (3 if when == "after" else 1), out1
    assert rc0 == 75, out0
    assert "ok 0" not in out0, out0
    lost = [line for line in out0.splitlines() if "lost rank 1" in line]
    assert len(lost) == 1, out0
    assert lost[0].startswith("kerasdist: rank 0: lost rank 1 on host ")
    assert lost[0].endswith("; ending this rank."), lost[0]
    starting = "its process ended while the job was starting" in lost[0]
    assert starting == (when != "after"), lost[0]
    hello = "its hello's connection to the rendezvous closed" in lost[0]
    assert hello == (when == "joined"), lost[0]
    # From rank 1's end to rank 0's (each seen to 0.05 s).
    assert -0.5 < ended[0] - ended[1] < 10, (ended, out0)


_OWN_IPC = ('[ "$RANK" != 1 ] || exec unshare --ipc --mount sh -c '
            '\'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"\' "$@"; '
            'exec "$@"')


@pytest.mark.timeout(120)
def test_one_host_name_two_ipc_namespaces_are_two_nodes():
    # Two containers given one host name: rank 1 in an IPC and mount
    # namespace of its own, with a /dev/shm of its own. MPI must not take
    # them for one node (it would wait in init() for shared memory they
    # cannot share): each is a node of one, and the job computes.
    import shutil
    import subprocess
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run(
            ["unshare", "--ipc", "--mount", "true"],
            capture_output=True).returncode:
        pytest.skip("needs root and unshare for namespaces of its own")
    port = free_port()
    results = start_processes(["sh", "-c", _OWN_IPC, "sh"] + WORKER,
                              [_env(r, 2, port) for r in range(2)],
                              timeout=90)
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"process {r}:\n{out}"
        assert f"ok {r} 2 0 1" in out, f"process {r}:\n{out}"


# Starts `args` once per environment in a mount namespace of its own whose
# /dev/shm is a tmpfs of SIZE; prints start_processes' results as JSON.
_IN_SMALL_SHM = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.support.helpers import start_processes
with open(sys.argv[2]) as f:
    args, envs = json.load(f)
print(json.dumps(start_processes(args, envs, timeout=60)))
"""


@pytest.mark.timeout(120)
def test_a_full_dev_shm_is_named_not_a_sigbus(tmp_path):
    # MPICH's MPI_Init would die of SIGBUS on a /dev/shm too small for its
    # segment (a full one: Docker's 64 MB default after ~30 killed jobs).
    import json
    import shutil
    import subprocess

    from tests.support.helpers import REPO_ROOT
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs root and unshare for a /dev/shm of its own")
    port = free_port()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([WORKER, [_env(r, 2, port)
                                         for r in range(2)]]))
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=256k tmpfs /dev/shm && exec "$0" "$@"',
         sys.executable, "-c", _IN_SMALL_SHM, REPO_ROOT, str(spec)],
        capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    named = 0
    for r, (rc, out) in enumerate(json.loads(p.stdout)):
        if ("kerasdist.init() failed: /dev/shm has 0.2 MiB free of 0.2 "
                "MiB, and MPI's shared memory for the 2 rank(s) on this "
                "host needs about 2.0 MiB (MPI_Init would die of SIGBUS); "
                "free space in /dev/shm") in out:
            assert rc == 1 and "--shm-size" in out, f"process {r}:\n{out}"
            named += 1
        else:
            # The other rank's failure may end this one first: the
            # rendezvous' watch names it (exit 75), as for any rank that
            # ends while the job starts.
            assert rc == 75 and "lost rank" in out and \
                "while the job was starting" in out, f"process {r}:\n{out}"
    assert named >= 1, p.stdout


@pytest.mark.timeout(150)
def test_keras_distribution_variables_form_one_job():
    port = free_port()
    results = start_processes(
        WORKER, [_keras_env(r, 2, port) for r in range(2)], timeout=120)
    _assert_formed(results, 2, "keras")


@pytest.mark.timeout(150)
def test_coordinator_twenty_seconds_late():
    port = free_port()
    results = start_processes(WORKER, [_env(r, 2, port) for r in range(2)],
                              delays=[20, 0], timeout=110)
    _assert_formed(results, 2, "torchrun")


def _one_error(env, timeout=60):
    start = time.monotonic()
    [(rc, out)] = start_processes(WORKER, [env], timeout=timeout)
    assert rc != 0, out
    return out.strip().splitlines()[-1], time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, message", [
    ({"RANK": "2"}, "ValueError: RANK=2 is not below WORLD_SIZE=2; set RANK"),
    ({"WORLD_SIZE": None},
     "ValueError: RANK is set but WORLD_SIZE is not; set WORLD_SIZE"),
    ({"MASTER_PORT": "http"},
     "ValueError: MASTER_PORT gives port 'http'; set it to a TCP port"),
    ({"KERAS_DISTRIBUTION_PROCESS_ID": "0",
      "KERAS_DISTRIBUTION_NUM_PROCESSES": "2"},
     "ValueError: torchrun says rank 1 of 2 (RANK, WORLD_SIZE) but keras "
     "says rank 0 of 2"),
])
def test_bad_variables_are_one_line_error(change, message):
    env = _env(1, 2, free_port())
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    last, took = _one_error(env)
    assert last.startswith(message), last
    assert took < 60


@pytest.mark.timeout(90)
def test_coordinator_that_never_answers():
    port = free_port()
    env = _env(1, 2, port, KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=3)
    last, took = _one_error(env)
    assert last.startswith(
        f"RuntimeError: kerasdist.init() failed: rank 1 of 2 found no "
        f"coordinator at 127.0.0.1:{port} within 3 s "
        f"(KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"), last
    assert took < 45


@pytest.mark.timeout(90)
def test_rank_that_never_arrives():
    env = _env(0, 3, free_port(), KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=3)
    last, took = _one_error(env)
    assert last.startswith(
        "RuntimeError: kerasdist.init() failed: rank 0 of 3: ranks 1, 2 of 3 "
        "did not reach the coordinator within 3 s"), last
    assert took < 45


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_torchrun_itself():
    """torchrun's agent holds MASTER_PORT (its store): rank 0 serves on a
    free port and publishes it in that store."""
    pytest.importorskip("torch.distributed.run")
    env = _env(0, 1, 1)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    [(rc, out)] = start_processes(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
         "2", "--master-port", str(free_port()), *WORKER[1:]], [env],
        timeout=200)
    assert rc == 0, out
    assert "launch convention torchrun: rank 0 of 2" in out, out
    assert out.count("ok ") == 2, out


# ---- the platforms' conventions after torchrun -------------------------------

import json  # noqa: E402

import numpy as np  # noqa: E402

from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import worker_cmd  # noqa: E402
from tests.support.helpers import worker_env  # noqa: E402


def _platform_env(variables, **extra):
    """A process's environment with exactly `variables` of a platform (no
    launcher's, no torchrun's)."""
    env = _env(0, 1, 1, **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    env.update({k: str(v) for k, v in variables.items()})
    return env


def _rank_one_of_two(port):
    """{convention: rank 1's variables, its coordinator 127.0.0.1:port}."""
    here = f"127.0.0.1:{port}"
    spec = {"cluster": {"chief": [here], "worker": ["127.0.0.1:1"]},
            "task": {"type": "worker", "index": 0}}
    return {
        "jax": {"JAX_COORDINATOR_ADDRESS": here, "JAX_NUM_PROCESSES": 2,
                "JAX_PROCESS_ID": 1},
        "kerasdist": {"KERASDIST_NUM_PROCESSES": 2, "JOB_COMPLETION_INDEX": 1,
                      "KERASDIST_COORDINATOR": here},
        "tf_config": {"TF_CONFIG": json.dumps(spec)},
        "sagemaker": {"SM_HOSTS": '["127.0.0.1", "algo-2"]',
                      "SM_CURRENT_HOST": "algo-2",
                      "KERASDIST_COORDINATOR_PORT": port},
        "slurm": {"SLURM_PROCID": 1, "SLURM_NTASKS": 2, "SLURM_LOCALID": 0,
                  "SLURM_STEP_NODELIST": "127.0.0.1,kdt1",
                  "SLURM_JOB_ID": 5, "SLURM_STEP_ID": 0,
                  "KERASDIST_COORDINATOR_PORT": port},
    }


@pytest.mark.timeout(120)
def test_each_convention_without_its_coordinator_fails_in_time():
    ports = {name: free_port() for name in _rank_one_of_two(1)}
    names = sorted(ports)
    envs = [_platform_env(_rank_one_of_two(ports[n])[n],
                          KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=3)
            for n in names]
    start = time.monotonic()
    results = start_processes(WORKER, envs, timeout=90)
    took = time.monotonic() - start
    for name, (rc, out) in zip(names, results):
        last = out.strip().splitlines()[-1]
        assert rc != 0, (name, out)
        assert last.startswith(
            f"RuntimeError: kerasdist.init() failed: rank 1 of 2 found no "
            f"coordinator at 127.0.0.1:{ports[name]} within 3 s"), (name,
                                                                    last)
    assert took < 60, took


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_training_matches_kerasdist_run(tmp_path):
    """The same script, started from TF_CONFIG (a chief and a worker) and
    under `kerasdist run -np 2`, reaches the same weights."""
    script = worker_cmd("convention_train_worker.py")
    port = free_port()
    spec = {"cluster": {"chief": [f"127.0.0.1:{port}"],
                        "worker": ["127.0.0.1:1"]}}
    envs = [_platform_env({"TF_CONFIG": json.dumps(
        {**spec, "task": {"type": kind, "index": 0}})})
        for kind in ("chief", "worker")]
    results = start_processes(script + [str(tmp_path / "platform.npz")],
                              envs, timeout=200)
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and f"trained {r} 2" in out, out
    assert "launch convention tf_config: rank 0 of 2" in results[0][1]
    under_run = launch(2, script + [str(tmp_path / "run.npz")], timeout=200,
                       env=worker_env())
    assert under_run.returncode == 0, under_run.stdout[-3000:]
    a = np.load(tmp_path / "platform.npz")
    b = np.load(tmp_path / "run.npz")
    assert len(a.files) == len(b.files) == 4
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5)
