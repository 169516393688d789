"""`kerasdist run -np N -H hosts` over the TCP transport
(KERASDIST_TRANSPORT=tcp, kerasdist/run/tcp_launch.py): the launcher
starts each test host's ranks itself through the remote shell, no MPI;
with --recover-in-place a rank lost on the other host costs the others
no process, and with --host-discovery-script a host listed while the job
runs gets new processes that join it at its next commit
(docs/failures-and-elastic.md)."""

import sys
import threading
import time

import pytest

from tests.support.cluster import Cluster
from tests.support.cluster import openssh
from tests.support.cluster import processes_in
from tests.support.cluster import require
from tests.support.cluster import run_on
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env
from tests.support.recovery import check_grown_weights
from tests.support.recovery import check_survivors
from tests.support.recovery import grown_files
from tests.support.recovery import read_json

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS, COMMIT_EVERY = 12, 3
TIMEOUT_S = 3  # the heartbeat's
JOB_S = 240


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        yield c


_SUM = ("import os, socket, numpy as np, kerasdist as kd, "
        "kerasdist.jax as kdj\n"
        "kd.init()\n"
        "total = np.asarray(kdj.allreduce(np.full(3, kd.rank() + 1.0), "
        "op=kd.Sum))\n"
        "print(socket.gethostname(), kd.rank(), kd.size(), "
        "os.environ['LOCAL_RANK'], total.tolist())\n")


def test_over_tcp_plain_ssh_starts_each_hosts_ranks(cluster, tmp_path):
    """3 ranks over kdt0:2,kdt1:1 through each host's OpenSSH server: each
    rank on its host, numbered as mpiexec places them, and their sum the
    sum of 1..3; nothing left (the secret: tests/unit/test_tcp_launch.py)."""
    with openssh(cluster, tmp_path) as ssh:
        out = run_on(cluster, 3, "kdt0:2,kdt1:1",
                     [sys.executable, "-c", _SUM], timeout=120,
                     ssh_command=ssh,
                     env=worker_env(KERASDIST_TRANSPORT="tcp",
                                    KERAS_BACKEND="jax",
                                    KERASDIST_JOB_SECRET="s" * 40))
        assert out.returncode == 0, out.stdout[-3000:]
        for r, (host, local) in enumerate([("kdt0", 0), ("kdt0", 1),
                                           ("kdt1", 0)]):
            assert rank_lines(out.stdout, r) == [
                f"{host} {r} 3 {local} [6.0, 6.0, 6.0]"], out.stdout
        for host in cluster.hosts:
            assert _left_in(cluster, host, 5) == [], host


@pytest.mark.timeout(JOB_S + 60)
def test_over_tcp_a_host_cut_off_past_sshs_keep_alive_is_lost(cluster,
                                                               tmp_path):
    """kdt1's link goes down as rank 2, alone there, reaches step 7 (it
    lives on, cut off; ssh to it with a keep-alive of 1 s x 2): ranks 0
    and 1 re-form at 2 after the heartbeat's timeout and finish with
    numpy's weights; the ssh to kdt1 ends with 255, the launcher counts
    rank 2 lost (its exit never reported) and exits 0; the cut-off rank
    ends by itself and nothing is left once the link is back."""
    kdt1 = cluster.host("kdt1")
    marker = tmp_path / "kill.json"

    def cut_when_there():
        deadline = time.monotonic() + JOB_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        cluster.cut(kdt1)

    with openssh(cluster, tmp_path / "ssh") as ssh:
        threading.Thread(target=cut_when_there, daemon=True).start()
        t0 = time.monotonic()
        try:
            out = run_on(cluster, 3, "kdt0:2,kdt1:1", worker_cmd(
                "recovery_worker.py", str(tmp_path), "2", "7", "CONT"),
                timeout=JOB_S, env=_env(), launcher_args=["--recover-in-place"],
                ssh_command=ssh + " -o ServerAliveInterval=1 "
                "-o ServerAliveCountMax=2")
        finally:
            cluster.restore(kdt1)
        print(f"cut link: the job ended {time.monotonic() - t0:.1f} s "
              f"after its start")
        assert out.returncode == 0, out.stdout[-6000:]
        assert ("host kdt1: its remote shell ended with code 255 (the host "
                "or its link lost)" in out.stdout), out.stdout[-6000:]
        assert ("rank 2 never reported an exit (lost with its host or its "
                "link); ranks 0, 1 finished without it (recovery in place)."
                in out.stdout), out.stdout[-6000:]
        check_survivors(tmp_path, [0, 1], 7, STEPS, COMMIT_EVERY)
        assert not (tmp_path / "end.2.json").exists()
        for host in cluster.hosts:
            assert _left_in(cluster, host, 60) == [], host


def _left_in(cluster, host, settle):
    """The processes alive in `host` but its sshd, after waiting up to
    `settle` s for them to end."""
    deadline = time.monotonic() + settle
    while True:
        left = [c for c in processes_in(cluster, host, settle=0)
                if "sshd" not in c]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def _env(**extra):
    return worker_env(KERASDIST_TRANSPORT="tcp",
                      KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=TIMEOUT_S,
                      RECOVERY_STEPS=STEPS,
                      RECOVERY_COMMIT_EVERY=COMMIT_EVERY,
                      RECOVERY_STEP_SLEEP=0.2, **extra)


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_over_tcp_a_rank_lost_on_the_other_host_costs_no_process(
        cluster, tmp_path, signal_name):
    """Rank 2, alone on kdt1, SIGKILLs itself at step 7, or freezes
    (SIGSTOP: its wrapper kills it once its heartbeat is silent): ranks 0
    and 1 keep their processes, re-form at 2 over TCP and finish with
    numpy's weights; the launcher says so and exits 0."""
    out = run_on(cluster, 3, "kdt0:2,kdt1:1", worker_cmd(
        "recovery_worker.py", str(tmp_path), "2", "7", signal_name),
        timeout=JOB_S, env=_env(), launcher_args=["--recover-in-place"])
    assert out.returncode == 0, out.stdout[-6000:]
    assert ("rank 2 (host kdt1) exited with signal 9 (SIGKILL); ranks 0, 1 "
            "finished without it (recovery in place)." in out.stdout), \
        out.stdout[-6000:]
    lost_at = read_json(tmp_path, "kill.json")["at"]
    commit = check_survivors(tmp_path, [0, 1], 7, STEPS, COMMIT_EVERY)
    took = read_json(tmp_path, "end.0.json")["done_at"][str(commit + 1)] \
        - lost_at
    print(f"SIG{signal_name} on kdt1: the survivors' next step "
          f"{took:.2f} s later")
    assert took < (3 if signal_name == "KILL" else TIMEOUT_S + 5), took
    for host in cluster.hosts:
        assert processes_in(cluster, host) == [], host


@pytest.mark.timeout(JOB_S + 60)
def test_over_tcp_a_discovered_host_joins_in_place(cluster, tmp_path):
    """The discovery script lists kdt0:2, then also kdt1:1 once rank 0
    trained 4 steps: the launcher starts a process on kdt1 that joins the
    job at its next commit; ranks 0 and 1 keep their processes and every
    rank ends with numpy's weights (2 ranks up to that commit, 3 after)."""
    listed = tmp_path / "hosts.txt"
    listed.write_text("kdt0:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    out = run_on(cluster, 2, None, worker_cmd(
        "recovery_worker.py", str(tmp_path)), timeout=JOB_S,
        env=_env(RECOVERY_GROW_AT=4, RECOVERY_GROW_LIST=listed,
                 RECOVERY_GROW_TO="kdt0:2\nkdt1:1\n", RECOVERY_GROW_JOIN=1),
        launcher_args=["--recover-in-place", "--host-discovery-script",
                       str(script), "--min-np", "2", "--max-np", "3",
                       "--discovery-interval", "0.5"])
    assert out.returncode == 0, out.stdout[-6000:]
    assert ("kerasdist: growing from 2 to 3 ranks: host kdt1 joined; in "
            "place, at the ranks' next commit" in out.stdout), out.stdout
    assert ("grew in place to 3 rank(s) (was 2; 1 process(es) asked to "
            "join)" in out.stdout), out.stdout
    ends = grown_files(tmp_path)
    check_grown_weights(ends, STEPS, COMMIT_EVERY, 4)
    assert [e["host"] for e in ends] == ["kdt0", "kdt0", "kdt1"], ends
    took = min(ends[2]["done_at"].values()) - \
        read_json(tmp_path, "asked.json")["listed"]
    print(f"kdt1 listed: its process's first step {took:.2f} s later")
    for host in cluster.hosts:
        assert processes_in(cluster, host) == [], host
