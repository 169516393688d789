"""Recovery in place over the TCP transport (KERASDIST_TRANSPORT=tcp with
KERASDIST_RECOVER_IN_PLACE=1), no ULFM and no MPI: 3 ranks started as a
platform starts them (torchrun's variables, each process by the test),
one SIGKILLs itself mid-step (tests/workers/recovery_worker.py, PyTorch);
the other two keep their processes, re-form at size 2 through the
rendezvous (rendezvous/reform.py), resume from the last commit in memory
and finish with the weights numpy computes for that commit continued at
size 2. Rank 0 too: the rendezvous's server, which rank 0 started,
outlives it while the survivors are connected. And the same under
`kerasdist run` in node mode with --recover-in-place. Growing: a process
started with KERASDIST_JOIN=1 joins a running job of 2 at a commit,
takes the state from rank 0 and trains on with the two, which keep their
processes, to numpy's weights. Shrinking under `kerasdist run -np` over
TCP: a relaunch, said in one line.

Every process in a session of its own, killed on leaving.
"""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import free_port  # noqa: E402
from tests.support.helpers import kill_tree  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import worker_cmd  # noqa: E402
from tests.support.helpers import worker_env  # noqa: E402
from tests.support.recovery import check_joined  # noqa: E402
from tests.support.recovery import check_survivors  # noqa: E402
from tests.support.recovery import joining_envs  # noqa: E402
from tests.support.recovery import read_json  # noqa: E402
from tests.support.recovery import run_joining  # noqa: E402
from tests.support.recovery import run_with_join  # noqa: E402

pytestmark = pytest.mark.parallel

KILL_STEP, STEPS, COMMIT_EVERY = 7, 12, 3
JOB_S = 240


def _run(tmp_path, killed):
    port = free_port()
    procs, outs = [], []
    try:
        for r in range(3):
            env = worker_env(
                RANK=r, WORLD_SIZE=3, LOCAL_RANK=r, LOCAL_WORLD_SIZE=3,
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                KERASDIST_TRANSPORT="tcp", KERASDIST_RECOVER_IN_PLACE=1,
                KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=5,
                RECOVERY_STEPS=STEPS, RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                RECOVERY_BACKEND="torch")
            env.pop("KERASDIST_ELASTIC_DIR", None)
            procs.append(subprocess.Popen(
                worker_cmd("recovery_worker.py", str(tmp_path), str(killed),
                           str(KILL_STEP)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=env, cwd=REPO_ROOT, start_new_session=True))
        for p in procs:
            outs.append(p.communicate(timeout=JOB_S)[0])
    finally:
        for p in procs:
            kill_tree(p)
    return procs, outs


@pytest.mark.timeout(JOB_S + 60)
def test_survivors_re_form_over_tcp_in_place(tmp_path):
    # Rank 0: the rendezvous's server, which its process started, must
    # outlive it. (Another rank: the launcher's test below.)
    killed = 0
    procs, outs = _run(tmp_path, killed)
    survivors = [r for r in range(3) if r != killed]
    text = "\n".join(f"--- rank {r} ---\n{o[-3000:]}"
                     for r, o in enumerate(outs))
    assert procs[killed].returncode == -9, text
    for r in survivors:
        assert procs[r].returncode == 0, text
    line = [x for x in outs[survivors[0]].splitlines()
            if "re-formed in place at 2 rank(s) (was 3)" in x]
    assert line, text
    print(line[0])
    check_survivors(tmp_path, survivors, KILL_STEP, STEPS, COMMIT_EVERY)


@pytest.mark.timeout(JOB_S + 60)
def test_kerasdist_run_node_mode_recovers_in_place_over_tcp(tmp_path):
    """`kerasdist run --nproc-per-node 3 --recover-in-place` with
    KERASDIST_TRANSPORT=tcp: the launcher's node manager stops no survivor
    of the killed rank, says so in one line, and exits 0 once they
    finish."""
    env = worker_env(KERASDIST_TRANSPORT="tcp",
                     KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=5,
                     RECOVERY_STEPS=STEPS, RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                     RECOVERY_BACKEND="torch")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "KERASDIST_ELASTIC_DIR"):
        env.pop(k, None)
    out = launch(None, worker_cmd("recovery_worker.py", str(tmp_path), "1",
                                  str(KILL_STEP)),
                 timeout=JOB_S, env=env,
                 launcher_args=("--nproc-per-node", "3",
                                "--recover-in-place"))
    assert out.returncode == 0, out.stdout[-4000:]
    assert ("rank 1 (host " in out.stdout and "exited with signal 9 "
            "(SIGKILL)" in out.stdout and "the other ranks go on without it "
            "(recovery in place)." in out.stdout), out.stdout[-4000:]
    for new_rank, rank in enumerate((0, 2)):
        start, end = (read_json(tmp_path, f"start.{rank}.json"),
                      read_json(tmp_path, f"end.{rank}.json"))
        assert (end["pid"], end["rank"], end["size"]) == (
            start["pid"], new_rank, 2), (start, end)


GROW_AT = 4


@pytest.mark.timeout(JOB_S + 60)
# PyTorch, and JAX's eager collectives.
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_process_joins_a_running_tcp_job_in_place(tmp_path, backend):
    listed = tmp_path / "join-now"
    envs = joining_envs(free_port(), listed, "127.0.0.1",
                        RECOVERY_BACKEND=backend,
                        KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=5,
                        RECOVERY_STEPS=STEPS,
                        RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                        RECOVERY_GROW_AT=GROW_AT)

    def start(i):
        return subprocess.Popen(
            worker_cmd("recovery_worker.py", str(tmp_path)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=envs[i], cwd=REPO_ROOT, start_new_session=True)
    procs, outs = run_joining(
        [lambda i=i: start(i) for i in range(3)], listed, JOB_S)
    line, began, end = check_joined(procs, outs, tmp_path, STEPS,
                                    COMMIT_EVERY, GROW_AT)
    print(line)
    print(f"joining process: started to let in "
          f"{began['init_at'] - began['began']:.2f} s, to its first step "
          f"{min(end['done_at'].values()) - began['began']:.2f} s")


@pytest.mark.timeout(JOB_S + 60)
def test_kerasdist_run_join_starts_processes_that_join(tmp_path):
    """`kerasdist run --nproc-per-node 1 --master-addr A --master-port P
    --join` on a host (here the same one) starts a process that joins the
    running job of `kerasdist run --nproc-per-node 2 --recover-in-place`
    at its next commit; both launchers exit 0."""
    port, listed = free_port(), tmp_path / "join-now"
    env = joining_envs(port, listed, "127.0.0.1",
                       KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=5,
                       RECOVERY_STEPS=STEPS,
                       RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                       RECOVERY_GROW_AT=GROW_AT)[2]
    env.pop("KERASDIST_JOIN")
    for k in ("MASTER_ADDR", "MASTER_PORT", "KERASDIST_RECOVER_IN_PLACE"):
        env.pop(k)
    procs, outs, _ = run_with_join(
        worker_cmd("recovery_worker.py", str(tmp_path)), env, port, listed,
        JOB_S)
    check_joined(procs, outs, tmp_path, STEPS, COMMIT_EVERY, GROW_AT)
    assert (f"kerasdist: 1 process(es) joining the running job at "
            f"127.0.0.1:{port}" in outs[1]), outs[1]
    assert "[+0]<stdout>:rank 2 done at size 3" in outs[1], outs[1]


@pytest.mark.timeout(JOB_S + 60)
def test_kerasdist_run_np_over_tcp_shrinks_by_a_relaunch(tmp_path):
    """`kerasdist run -np 3 --recover-in-place --host-discovery-script`
    over TCP (the launcher starts the ranks, kerasdist/run/tcp_launch.py):
    the script lists 2 slots at step 4; shrinking in place is MPI's
    split, so the launcher says in one line that it relaunches, the ranks
    commit and stop, and 2 resume from that commit on disk."""
    listed = tmp_path / "hosts.txt"
    listed.write_text("localhost:3\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    env = worker_env(KERASDIST_TRANSPORT="tcp", RECOVERY_STEPS=STEPS,
                     RECOVERY_COMMIT_EVERY=COMMIT_EVERY, RECOVERY_GROW_AT=4,
                     RECOVERY_GROW_LIST=listed, RECOVERY_GROW_TO="localhost:2",
                     RECOVERY_RESIZE_SIZE=2, RECOVERY_BACKEND="torch")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "KERASDIST_ELASTIC_DIR"):
        env.pop(k, None)
    out = launch(3, worker_cmd("recovery_worker.py", str(tmp_path)),
                 timeout=JOB_S, env=env,
                 launcher_args=("--recover-in-place", "--host-discovery-script",
                                str(script), "--min-np", "2",
                                "--discovery-interval", "0.5"))
    assert out.returncode == 0, out.stdout[-4000:]
    assert ("kerasdist: cannot shrink in place (over TCP a job shrinks by a "
            "relaunch: shrinking in place needs Open MPI's ULFM); "
            "relaunching instead." in out.stdout), out.stdout[-4000:]
    assert "now 2" in out.stdout, out.stdout[-4000:]
    for rank in (0, 1):
        end = read_json(tmp_path, f"a1.end.{rank}.json")
        assert (end["rank"], end["size"]) == (rank, 2), end


@pytest.mark.timeout(60)
def test_recover_in_place_in_node_mode_needs_tcp():
    env = worker_env()
    env.pop("KERASDIST_TRANSPORT", None)
    out = launch(None, [sys.executable, "-c", "pass"], timeout=50, env=env,
                 launcher_args=("--nproc-per-node", "2",
                                "--recover-in-place"))
    assert out.returncode == 2, out.stdout
    assert ("--recover-in-place in node mode needs the TCP transport "
            "(KERASDIST_TRANSPORT=tcp" in out.stdout), out.stdout
