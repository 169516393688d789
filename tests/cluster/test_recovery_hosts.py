"""Recovery in place across test hosts (docs/failures-and-elastic.md,
"Recovery in place"): kerasdist built against Open MPI
(tests/cluster/conftest.py's openmpi_root) under `kerasdist run
--recover-in-place -H kdt0:2,kdt1:1`, Open MPI's daemons on both hosts.
Rank 2, alone on kdt1 (tests/workers/recovery_worker.py), is lost at step
7: SIGKILLed or frozen (SIGSTOP), ranks 0 and 1 keep their processes,
re-form at size 2 and finish with the weights numpy computes. A cut link
is not recovered in place with Open MPI 5.0 (its process manager cannot
tell the survivors of ranks it cannot reach): the survivors end at their
re-forming deadline, each in one line, and nothing is left behind.
Over the TCP transport (no MPI, no ULFM; ranks started as a platform
starts them), a lost host and a cut link are both recovered in place, and
a process started on the other host joins the running job in place."""

import os
import signal
import subprocess
import threading
import time

import pytest

from tests.support.cluster import Cluster
from tests.support.cluster import processes_in
from tests.support.cluster import require
from tests.support.cluster import run_on
from tests.support.helpers import kill_tree
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env
from tests.support.recovery import check_joined
from tests.support.recovery import check_survivors
from tests.support.recovery import joining_envs
from tests.support.recovery import read_json
from tests.support.recovery import run_joining

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HOSTS = "kdt0:2,kdt1:1"
LOST, STEP, STEPS, COMMIT_EVERY = 2, 7, 12, 3
TIMEOUT_S = 3  # the heartbeat's
JOB_S = 240  # PyTorch's import on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        yield c





def _run(cluster, tmp_path, signal_name, root):
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=TIMEOUT_S,
                     RECOVERY_STEPS=STEPS, RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                     RECOVERY_STEP_SLEEP=0.2)
    return run_on(cluster, 3, HOSTS, worker_cmd(
        "recovery_worker.py", str(tmp_path), str(LOST), str(STEP),
        signal_name), timeout=JOB_S, env=env, root=root,
        launcher_args=["--recover-in-place"])


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_a_rank_lost_on_another_host_is_recovered_in_place(
        cluster, openmpi_root, tmp_path, signal_name):
    out = _run(cluster, tmp_path, signal_name, openmpi_root)
    assert out.returncode == 0, out.stdout[-6000:]
    if signal_name == "STOP":
        # Its wrapper, on kdt1, kills it once its heartbeat is silent.
        assert (f"kerasdist: rank {LOST}: its heartbeat sent nothing for "
                f"{TIMEOUT_S} s (the process is frozen or hung); killing it"
                in out.stdout), out.stdout[-6000:]
    assert (f"rank {LOST} (host kdt1) exited with signal 9 (SIGKILL); ranks "
            "0, 1 finished without it (recovery in place)." in out.stdout), \
        out.stdout[-6000:]
    lost_at = read_json(tmp_path, "kill.json")["at"]
    commit = check_survivors(tmp_path, [0, 1], STEP, STEPS, COMMIT_EVERY)
    for rank in (0, 1):
        end = read_json(tmp_path, f"end.{rank}.json")
        # The next step: at once after a SIGKILL, within the heartbeat's
        # timeout after a SIGSTOP (and a few seconds for this machine).
        took = end["done_at"][str(commit + 1)] - lost_at
        assert took < (3 if signal_name == "KILL" else TIMEOUT_S + 5), took


def _cut_at_the_kill(cluster, host, directory):
    """Takes `host`'s link down, from a thread, once the worker's kill.json
    appears in `directory` (its SIGCONT: the rank lives on); returns the
    list the cut's wall time is appended to."""
    marker, cut_at = directory / "kill.json", []

    def cut_when_there():
        deadline = time.monotonic() + JOB_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        cluster.cut(host)
        cut_at.append(time.time())

    threading.Thread(target=cut_when_there, daemon=True).start()
    return cut_at


@pytest.mark.timeout(JOB_S + 60)
def test_a_cut_link_ends_the_survivors_at_their_deadline(
        cluster, openmpi_root, tmp_path):
    # kdt1's link goes down as rank 2 reaches step 7 (SIGCONT: no signal
    # to speak of). The heartbeat finds kdt1 lost after 3 s and the
    # survivors' collectives fail, but Open MPI never learns that rank 2
    # is gone, so their shrink waits for it until the deadline (10 s);
    # each ends in one line, code 75 (with --max-restarts: a relaunch).
    kdt1 = cluster.host("kdt1")
    cut_at = _cut_at_the_kill(cluster, kdt1, tmp_path)
    try:
        out = _run(cluster, tmp_path, "CONT", openmpi_root)
        ended = time.time()
    finally:
        cluster.restore(kdt1)
    assert out.returncode == 75, out.stdout[-6000:]
    for rank in (0, 1):
        assert (f"[{rank}]<stderr>:kerasdist: rank {rank}: lost host kdt1 "
                f"(rank {LOST}): no heartbeat for {TIMEOUT_S} s"
                in out.stdout), out.stdout[-6000:]
        assert (f"[{rank}]<stderr>:kerasdist: rank {rank}: recovery in place "
                "failed: the survivors did not re-form within 10 s"
                in out.stdout), out.stdout[-6000:]
    assert not list(tmp_path.glob("end.*.json"))
    # The heartbeat's timeout, the deadline, the launcher's stopping.
    assert cut_at and ended - cut_at[0] < TIMEOUT_S + 10 + 30, (
        ended - cut_at[0], out.stdout[-6000:])
    for host in cluster.hosts:
        left = [c for c in processes_in(cluster, host, settle=10.0)
                if "recovery_worker" in c]
        assert left == [], (host.name, left)


# ---- Over the TCP transport (KERASDIST_TRANSPORT=tcp): no MPI, no ULFM --

def _start_over_tcp(cluster, tmp_path, signal_name, port,
                    hosts=("kdt0", "kdt0", "kdt1"), lost=LOST):
    """Ranks 0, 1 and 2 on `hosts`, each started as a platform starts it
    (torchrun's variables), the test its agent; rank `lost` is lost at
    step STEP (`signal_name`); the Popen of each, by rank."""
    procs = []
    for rank, host in enumerate(hosts):
        env = worker_env(
            RANK=rank, WORLD_SIZE=3, LOCAL_RANK=hosts[:rank].count(host),
            LOCAL_WORLD_SIZE=hosts.count(host),
            MASTER_ADDR="kdt0", MASTER_PORT=port,
            KERASDIST_TRANSPORT="tcp", KERASDIST_RECOVER_IN_PLACE=1,
            KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=TIMEOUT_S,
            RECOVERY_STEPS=STEPS, RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
            RECOVERY_STEP_SLEEP=0.2)
        procs.append(cluster.popen(
            cluster.host(host), worker_cmd(
                "recovery_worker.py", str(tmp_path), str(lost), str(STEP),
                signal_name),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True))
    return procs


def _outputs(cluster, procs, lost, host, then=None):
    """The ranks' outputs: the others' once they end, then, `host`'s link
    restored and `then()` called, the lost rank's; every process killed
    whole and the link restored on leaving. (outputs by rank, all of them
    as one text)."""
    outs = [None] * len(procs)
    try:
        for r in range(len(procs)):
            if r != lost:
                outs[r] = procs[r].communicate(timeout=JOB_S)[0]
        cluster.restore(host)
        if then is not None:
            then()
        outs[lost] = procs[lost].communicate(timeout=120)[0]
    finally:
        cluster.restore(host)
        for p in procs:
            kill_tree(p)
    return outs, "\n".join(f"--- rank {r} ---\n{(o or '')[-3000:]}"
                            for r, o in enumerate(outs))


@pytest.mark.timeout(JOB_S + 90)
@pytest.mark.parametrize("fault", ["KILL", "STOP", "cut"])
def test_over_tcp_a_lost_or_cut_off_host_is_recovered_in_place(
        cluster, tmp_path, fault):
    """Rank 2, alone on kdt1, is SIGKILLed or frozen (SIGSTOP), or kdt1's
    link goes down as it reaches step 7 (it lives on, cut off): ranks 0
    and 1 keep their processes, re-form at size 2 over TCP through the
    rendezvous and finish with the weights numpy computes; a cut-off rank
    2 ends in one line once it finds it was left out."""
    kdt1 = cluster.host("kdt1")
    if fault == "cut":
        _cut_at_the_kill(cluster, kdt1, tmp_path)
    procs = _start_over_tcp(cluster, tmp_path,
                            "CONT" if fault == "cut" else fault,
                            29661 + ["KILL", "cut", "STOP"].index(fault))
    # The frozen rank is killed, not continued: its end in one line is
    # the cut-off rank's (the standby's round waits its window for ranks
    # that finished meanwhile: 30 s more of the suite).
    outs, text = _outputs(cluster, procs, 2, kdt1, then=(
        # Its whole session: the rank within nsenter.
        lambda: os.killpg(procs[2].pid, signal.SIGKILL))
        if fault == "STOP" else None)
    assert [p.returncode for p in procs[:2]] == [0, 0], text
    lost_at = read_json(tmp_path, "kill.json")["at"]
    commit = check_survivors(tmp_path, [0, 1], STEP, STEPS, COMMIT_EVERY)
    for rank in (0, 1):
        end = read_json(tmp_path, f"end.{rank}.json")
        took = end["done_at"][str(commit + 1)] - lost_at
        print(f"{fault}: rank {rank}'s next step {took:.2f} s after the "
              f"loss")
        # At once after a SIGKILL; after a freeze or a cut, the
        # heartbeat's timeout (the loss) and as long again (the round).
        assert took < (3 if fault == "KILL" else 2 * TIMEOUT_S + 5), took
    if fault != "cut":
        assert procs[2].returncode == -9, text
    else:
        assert procs[2].returncode not in (0, None), text
        assert "recovery in place failed" in outs[2], text
        assert not (tmp_path / "end.2.json").exists()


@pytest.mark.timeout(JOB_S + 90)
def test_over_tcp_the_rendezvous_host_cut_off_re_forms_at_the_standby(
        cluster, tmp_path):
    """Rank 0 alone on kdt0, whose process runs the job's rendezvous;
    ranks 1 and 2 on kdt1, where rank 1 runs its standby. kdt0's link
    goes down as rank 0 reaches step 7: ranks 1 and 2 find the rendezvous
    silent, prove themselves to the standby, re-form at 2 there and
    finish with numpy's weights; rank 0, cut off, alone is not more than
    half of the job: the rendezvous refuses it, and it ends in one
    line."""
    kdt0 = cluster.host("kdt0")
    _cut_at_the_kill(cluster, kdt0, tmp_path)
    procs = _start_over_tcp(cluster, tmp_path, "CONT", 29664,
                            hosts=("kdt0", "kdt1", "kdt1"), lost=0)
    outs, text = _outputs(cluster, procs, 0, kdt0)
    assert [p.returncode for p in procs[1:]] == [0, 0], text
    assert "re-forming through its standby at " in outs[1], text
    lost_at = read_json(tmp_path, "kill.json")["at"]
    commit = check_survivors(tmp_path, [1, 2], STEP, STEPS, COMMIT_EVERY)
    took = read_json(tmp_path, "end.1.json")["done_at"][str(commit + 1)] \
        - lost_at
    print(f"the rendezvous's host cut off: the survivors' next step "
          f"{took:.2f} s after the cut")
    assert procs[0].returncode not in (0, None), text
    assert "recovery in place failed" in outs[0], text
    assert "only 1 of the job's 3 ranks could re-form here" in outs[0], text
    assert not (tmp_path / "end.0.json").exists()


@pytest.mark.timeout(JOB_S + 90)
def test_over_tcp_a_process_on_another_host_joins_in_place(cluster,
                                                            tmp_path):
    """Ranks 0 and 1 train on kdt0; after step 4 a process started on kdt1
    with KERASDIST_JOIN=1 joins at the next commit: ranks 0 and 1 keep
    their processes, the job re-forms at 3 over TCP with kdt1 in it, and
    every rank finishes with numpy's weights (2 ranks up to the commit,
    3 after)."""
    listed = tmp_path / "join-now"
    envs = joining_envs(29663, listed, "kdt0",
                        KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=TIMEOUT_S,
                        RECOVERY_STEPS=STEPS,
                        RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                        RECOVERY_STEP_SLEEP=0.2, RECOVERY_GROW_AT=4)

    def start(i):
        return cluster.popen(
            cluster.host("kdt1" if i == 2 else "kdt0"),
            worker_cmd("recovery_worker.py", str(tmp_path)), env=envs[i],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
    procs, outs = run_joining(
        [lambda i=i: start(i) for i in range(3)], listed, JOB_S)
    line, began, end = check_joined(procs, outs, tmp_path, STEPS,
                                    COMMIT_EVERY, 4)
    assert end["host"] == "kdt1", end
    print(line)
    print(f"joining process on kdt1: started to let in "
          f"{began['init_at'] - began['began']:.2f} s, to its first step "
          f"{min(end['done_at'].values()) - began['began']:.2f} s")
