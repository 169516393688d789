"""Faults across test hosts: whatever dies or goes silent, no rank waits
forever. Each case starts 3 ranks (kdt0: rank 0; kdt1: ranks 1 and 2), and
rank 2 brings a fault about at a chosen moment (tests/workers/
fault_worker.py): SIGKILL of itself or of its whole host's ranks, SIGSTOP,
an uncaught exception, its host's link taken down, or every packet on it
dropped by nftables. Then `kerasdist run` must end nonzero within the bound,
say in a line of its own which host and ranks were lost, leave no rank
behind on any host, and not show MPI's "BAD TERMINATION" banner."""

import os
import re
import threading
import time

import pytest

from tests.support import forkserver
from tests.support import system
from tests.support import trainer_records as tr
from tests.support.cluster import Cluster
from tests.support.cluster import processes_in
from tests.support.cluster import require
from tests.support.cluster import run_on
from tests.support.helpers import WORKERS
from tests.support.helpers import launch
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HEARTBEAT_TIMEOUT_S = 3
# From the fault to the launcher's exit: the heartbeat's timeout, the
# launcher's settling moment, and its escalation when mpiexec waits for a
# host it cannot reach (SIGKILL after 20 s).
BOUND_S = HEARTBEAT_TIMEOUT_S + 25
HOSTS = "kdt0:1,kdt1:2"

# What the launcher's own line must say, by fault.
EXPECTED = {
    "kill": r"rank 2 \(host kdt1\) exited with signal 9 \(SIGKILL\)",
    "kill_host": r"ranks 1, 2 \(host kdt1\) exited with signal 9 \(SIGKILL\)",
    "exception": r"rank 2 \(host kdt1\) exited with code 1",
    "freeze": r"lost rank 2 on host kdt1: no heartbeat for 3 s",
    "link_down": r"lost host kdt1 \(ranks 1, 2\): no heartbeat for 3 s",
    "drop": r"lost host kdt1 \(ranks 1, 2\): no heartbeat for 3 s",
}

CASES = [("allreduce", f) for f in EXPECTED] + [
    ("broadcast", "kill"), ("broadcast", "freeze"), ("broadcast", "drop"),
    ("mpi4py", "exception"), ("mpi4py", "freeze")]


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        yield c


def _launcher_lines(output):
    """The launcher's own lines (not a rank's)."""
    return [l for l in output.splitlines() if l.startswith("kerasdist: ")]


@pytest.mark.parametrize("where, fault", CASES)
def test_a_fault_ends_every_rank_within_the_bound(cluster, tmp_path, where,
                                                  fault):
    if fault == "drop":
        system.require("nftables")
    kdt1 = cluster.host("kdt1")
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S,
                     KERASDIST_HEARTBEAT_INTERVAL_SECONDS=0.5)
    try:
        out = run_on(cluster, 3, HOSTS, worker_cmd(
            "fault_worker.py", where, fault, "2", str(tmp_path)),
            timeout=BOUND_S + 90, env=env)
        ended = time.time()
    finally:
        cluster.restore(kdt1)
        cluster.undrop(kdt1)
    assert out.returncode != 0, out.stdout[-3000:]
    with open(os.path.join(tmp_path, "fault")) as f:
        faulted = float(f.read().split()[0])
    assert ended - faulted < BOUND_S, (ended - faulted, out.stdout[-3000:])
    said = _launcher_lines(out.stdout)
    assert any(re.search(EXPECTED[fault], l) for l in said), (
        said, out.stdout[-6000:])
    assert "BAD TERMINATION" not in out.stdout
    assert "finished" not in out.stdout
    for host in cluster.hosts:
        left = [c for c in processes_in(cluster, host, settle=10.0)
                if "fault_worker" in c]
        assert left == [], (host.name, left)


def _when(path, then, timeout=120.0):
    """Runs `then` in a thread once `path` exists (or after the timeout)."""
    def wait():
        deadline = time.monotonic() + timeout
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        then()
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("hosts_from", ["-H", "discovery"])
def test_restart_goes_on_without_a_lost_host_and_takes_it_back(
        cluster, tmp_path, hosts_from):
    # Attempt 1 loses kdt1's link: attempt 2 runs on kdt0 alone (--min-np
    # 1); kdt1 comes back while it runs, and attempt 3, after attempt 2
    # failed, runs on both hosts again. With a --host-discovery-script the
    # hosts come from its output, which drops kdt1 and lists it again.
    kdt1 = cluster.host("kdt1")
    listed = tmp_path / "hosts.txt"
    listed.write_text("kdt0:1\nkdt1:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    where = (["-H", "kdt0:1,kdt1:1"] if hosts_from == "-H" else
             ["--host-discovery-script", str(script)])

    def bring_back():
        cluster.restore(kdt1)
        listed.write_text("kdt0:1\nkdt1:1\n")
        open(tmp_path / "go", "w").close()

    def fault_seen():
        if hosts_from == "discovery":
            listed.write_text("kdt0:1\n")

    first = _when(tmp_path / "fault0", fault_seen)
    waiter = _when(tmp_path / "attempt1", bring_back)
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S)
    try:
        out = launch(2, worker_cmd("elastic_worker.py", str(tmp_path)),
                     timeout=300, env=env, prefix=cluster.launcher_prefix(),
                     launcher_args=(
                         "--ssh-command", cluster.remote_shell,
                         "--network-interface", cluster.bridge, *where,
                         "--max-restarts", "2", "--min-np", "1"))
    finally:
        cluster.restore(kdt1)
        first.join(timeout=5)
        waiter.join(timeout=5)
    assert out.returncode == 0, out.stdout[-4000:]
    said = _launcher_lines(out.stdout)
    assert any(re.search(r"lost host kdt1 \(rank 1\)", l) for l in said), said
    if hosts_from == "-H":
        assert any(l.startswith("kerasdist: host kdt1 does not answer")
                   for l in said), said
    assert any(l.startswith("kerasdist: attempt 2 of 3 on 1 rank(s) "
                            "(kdt0:1)") for l in said), said
    # (-H: the hosts asked for; discovery: the script's, said in full.)
    assert any(re.match(r"kerasdist: attempt 3 of 3 (on 2 rank\(s\) "
                        r"\(kdt0:1,kdt1:1\) )?\(the last attempt ended "
                        r"because rank 0 \(host kdt0\) exited with code 3\)",
                        l) for l in said), said
    assert rank_lines(out.stdout, 0)[-2:] == ["attempt 2 size 2 host kdt0",
                                              "finished"], out.stdout[-3000:]
    assert rank_lines(out.stdout, 1)[-2:] == ["attempt 2 size 2 host kdt1",
                                              "finished"], out.stdout[-3000:]
    assert "attempt 1 size 1 host kdt0" in rank_lines(out.stdout, 0)


def test_restart_gives_up_below_min_np(cluster, tmp_path):
    kdt1 = cluster.host("kdt1")
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S)
    try:
        out = run_on(cluster, 2, "kdt0:1,kdt1:1",
                     worker_cmd("elastic_worker.py", str(tmp_path)),
                     timeout=200, env=env, launcher_args=(
                         "--max-restarts", "2"))
    finally:
        cluster.restore(kdt1)
    assert out.returncode != 0
    said = _launcher_lines(out.stdout)
    assert ("kerasdist: giving up: the hosts that answer have 1 slot(s) "
            "(kdt0:1), fewer than --min-np 2.") in said, said
    assert "attempt 1 size" not in out.stdout


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """An uninterrupted Trainer job on both hosts (one rank each), with the
    losses of three more seeds (the run-to-run spread)."""
    root = tmp_path_factory.mktemp("trainer")
    out = run_on(cluster, 2, "kdt0:1,kdt1:1", worker_cmd(
        "trainer_fault_worker.py", "reference", str(root / "ref"),
        str(root), "--tag", "ref"), timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    spread = [tr.loss(out)] + [
        float(v) for v in re.findall(r"SPREAD \d (\S+)", "\n".join(
            rank_lines(out.stdout, 0)))]
    assert len(spread) == 4, out.stdout[-3000:]
    return root, spread


def test_trainer_frozen_on_one_host_resumes_exactly(cluster, reference):
    # kdt1's rank freezes in the middle of epoch 2; the heartbeat ends the
    # job and --max-restarts relaunches it at the same size: the same final
    # state as the uninterrupted job, bit for bit.
    import numpy as np

    root, _ = reference
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S)
    out = run_on(cluster, 2, "kdt0:1,kdt1:1", worker_cmd(
        "trainer_fault_worker.py", "run", str(root / "frozen"), str(root),
        "--tag", "frozen", "--kill-rank", "1", "--kill-step", "22",
        "--kill-how", "freeze"), timeout=400, env=env,
        launcher_args=("--max-restarts", "1"))
    assert out.returncode == 0, out.stdout[-4000:]
    assert "lost host kdt1 (rank 1): no heartbeat" in out.stdout
    epoch, samples, _ = tr.resumed(out)
    assert epoch == 1 and samples > 0, out.stdout[-3000:]
    np.testing.assert_array_equal(np.load(root / "frozen.npy"),
                                  np.load(root / "ref.npy"))


def test_trainer_goes_on_without_a_silent_host(cluster, reference):
    # kdt1 drops every packet in the middle of epoch 2: the job goes on at
    # one rank on kdt0 (--min-np 1) from the last step checkpoint. Every
    # epoch trains each example once (as many seen as uninterrupted), and
    # the loss is within the run-to-run spread.
    system.require("nftables")
    root, spread = reference
    kdt1 = cluster.host("kdt1")
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S)
    try:
        out = run_on(cluster, 2, "kdt0:1,kdt1:1", worker_cmd(
            "trainer_fault_worker.py", "run", str(root / "shrunk"),
            str(root), "--tag", "shrunk", "--kill-rank", "1",
            "--kill-step", "22", "--kill-how", "drop"), timeout=400,
            env=env, launcher_args=("--max-restarts", "1", "--min-np", "1"))
    finally:
        cluster.undrop(kdt1)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "attempt 2 of 2 on 1 rank(s) (kdt0:1)" in out.stdout
    assert "written at 2 ranks, now 1" in out.stdout, out.stdout[-3000:]
    epoch, samples, step = tr.resumed(out)
    assert epoch == 1 and samples > 0, out.stdout[-3000:]
    before = tr.steps(root, "shrunk", 0, 2)  # attempt 0: both ranks
    after = tr.steps(root, "shrunk", 1, 1)   # attempt 1: rank 0 alone
    epochs = tr.epochs(tr.job_steps(before, until=step)
                       + tr.job_steps(after))
    assert len(epochs) == 3
    for ids in epochs:
        assert sorted(ids) == list(range(tr.N))
    lo, hi = min(spread), max(spread)
    assert lo - (hi - lo) <= tr.loss(out) <= hi + (hi - lo), (
        tr.loss(out), spread)


def _resumes(out):
    """(epoch index, examples done in it, optimizer step) of every resume
    rank 0 logged, in order."""
    found = []
    for line in rank_lines(out.stdout, 0):
        m = tr.RESUMED.search(line)
        if m:
            found.append((int(m.group(1)) - 1, int(m.group(2) or 0),
                          int(m.group(3))))
    return found


@pytest.mark.timeout(600)
def test_trainer_grows_and_shrinks_with_the_discovery_script(
        cluster, reference, tmp_path):
    # A Trainer job starts on kdt0 alone (the discovery script lists
    # kdt0:1). At its first step the script's file lists kdt1 too: the job
    # grows to 2 ranks at its next step checkpoint; at the first step on 2
    # ranks the file lists kdt0 alone again: it shrinks back to 1, and
    # finishes. No restart is counted, every attempt stops at the very step
    # the next resumes from, every epoch trains every example exactly once,
    # and the loss is within the run-to-run spread (as a resume at another
    # size after a failure).
    root, spread = reference
    listed = tmp_path / "hosts.txt"
    listed.write_text("kdt0:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    changed, done = {}, threading.Event()

    def change_at_first_step_of(attempt, hosts, what):
        mark = root / f"first.grow.a{attempt}"

        def wait():
            while not done.is_set():
                if mark.exists():
                    changed[what] = time.time()
                    listed.write_text(hosts)
                    return
                time.sleep(0.05)
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        return t

    waiters = [change_at_first_step_of(0, "kdt0:1\nkdt1:1\n", "grow"),
               change_at_first_step_of(1, "kdt0:1\n", "shrink")]
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S)
    try:
        out = launch(1, worker_cmd(
            "trainer_fault_worker.py", "run", str(root / "grow"), str(root),
            "--tag", "grow", "--step-sleep", "0.15", "--mark-first-step"),
            timeout=400, env=env, prefix=cluster.launcher_prefix(),
            launcher_args=(
                "--ssh-command", cluster.remote_shell,
                "--network-interface", cluster.bridge,
                "--host-discovery-script", str(script), "--max-np", "2",
                "--min-np", "1", "--discovery-interval", "1"))
    finally:
        done.set()
        for waiter in waiters:
            waiter.join(timeout=5)
    assert out.returncode == 0, out.stdout[-5000:]
    said = _launcher_lines(out.stdout)
    assert "kerasdist: growing from 1 to 2 ranks: host kdt1 joined" in said, \
        said
    assert "kerasdist: shrinking from 2 to 1 ranks: host kdt1 left" in said, \
        said
    assert not [l for l in said if re.match(r"kerasdist: attempt \d", l)], \
        said
    assert "written at 1 ranks, now 2" in out.stdout, out.stdout[-4000:]
    assert "written at 2 ranks, now 1" in out.stdout, out.stdout[-4000:]
    # The request reached every rank, kdt1's too (through hydra's proxy
    # there); a rank of the last attempt, which finished, got none.
    seen = r"worker: SIGUSR1 seen: (\w+)"
    assert [re.match(seen, l).group(1) for l in rank_lines(out.stdout, 0)
            if re.match(seen, l)] == ["True", "True", "False"], out.stdout
    assert [re.match(seen, l).group(1) for l in rank_lines(out.stdout, 1)
            if re.match(seen, l)] == ["True"], out.stdout
    resumes = _resumes(out)
    assert len(resumes) == 2, (resumes, out.stdout[-4000:])
    (_, _, grown_at), (_, _, shrunk_at) = resumes
    attempts = [tr.steps(root, "grow", 0, 1), tr.steps(root, "grow", 1, 2),
                tr.steps(root, "grow", 2, 1)]
    # All ranks stopped at the step of the checkpoint the next attempt
    # resumed from: nothing trained after it, nothing lost.
    for records, stop in ((attempts[0], grown_at), (attempts[1], shrunk_at)):
        assert {rows[-1][0] for rows in records.values()} == {stop}, (
            stop, {r: rows[-1][0] for r, rows in records.items()})
    epochs = tr.epochs(tr.job_steps(attempts[0], until=grown_at)
                       + tr.job_steps(attempts[1], until=shrunk_at)
                       + tr.job_steps(attempts[2]))
    assert len(epochs) == 3
    for ids in epochs:
        assert sorted(ids) == list(range(tr.N))
    lo, hi = min(spread), max(spread)
    assert lo - (hi - lo) <= tr.loss(out) <= hi + (hi - lo), (
        tr.loss(out), spread)
    # The cost of a resize: from the script's change to the first step at
    # the new size.
    firsts = [(root / f"first.grow.a{a}").read_text().split()
              for a in (1, 2)]
    assert [int(f[1]) for f in firsts] == [2, 1], firsts
    grow_s = float(firsts[0][0]) - changed["grow"]
    shrink_s = float(firsts[1][0]) - changed["shrink"]
    print(f"\nresize cost (the discovery script's change to the first step "
          f"at the new size): growing 1 -> 2 ranks {grow_s:.1f} s, "
          f"shrinking 2 -> 1 {shrink_s:.1f} s")
    assert 0 < grow_s < 120 and 0 < shrink_s < 120, (grow_s, shrink_s)


SOAK_FAULTS = 20


@pytest.mark.timeout(1500)
def test_soak_twenty_faults_in_a_row_each_recovered(cluster, tmp_path):
    # A Trainer job on two hosts is broken 20 times (tests/workers/
    # trainer_soak_worker.py: SIGKILL, SIGSTOP, an exception, or kdt1's
    # packets dropped, at random steps) and restarted each time, at one or
    # two ranks (--min-np 1). It must finish, and its newest checkpoint
    # must load into a fresh model with the trained weights. The ranks are
    # forked from a server per host that has imported TensorFlow
    # (tests/support/forkserver.py): 5-6 CPU s less per attempt.
    system.require("nftables")  # one of the faults drops packets
    kdt1 = cluster.host("kdt1")
    ckpt, state = tmp_path / "ckpt", tmp_path / "state"
    ckpt.mkdir()
    state.mkdir()
    done = threading.Event()

    def dropping():
        return cluster.run(kdt1, ["nft", "list", "table", "inet", "kdt_drop"],
                           check=False).returncode == 0

    def undrop_after_each_drop():
        # The rank writes its fault file, then drops kdt1's packets: the
        # rule is taken away once it has been in place past the heartbeat's
        # timeout (a loaded machine may start `nft` seconds late).
        handled = set()
        while not done.is_set():
            for name in os.listdir(state):
                if (name.startswith("fault.") and not name.endswith(".tmp")
                        and name not in handled):
                    handled.add(name)
                    if " drop " in (state / name).read_text():
                        deadline = time.monotonic() + 60
                        while not dropping() and time.monotonic() < deadline:
                            time.sleep(0.2)
                        time.sleep(HEARTBEAT_TIMEOUT_S + 1)
                        cluster.undrop(kdt1)
            time.sleep(0.2)

    helper = threading.Thread(target=undrop_after_each_drop, daemon=True)
    helper.start()
    env = worker_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_TIMEOUT_S)
    name = f"soak{os.getpid()}"
    try:
        with forkserver.Servers(name, forkserver.TRAINER_MODULES, env,
                                prefixes=[h.nsenter()
                                          for h in cluster.hosts]):
            out = run_on(cluster, 2, "kdt0:1,kdt1:1", forkserver.command(
                name, os.path.join(WORKERS, "trainer_soak_worker.py"),
                str(ckpt), str(state), "7", str(SOAK_FAULTS)),
                timeout=1400, env=env, launcher_args=(
                    "--max-restarts", str(SOAK_FAULTS + 2), "--min-np",
                    "1"))
    finally:
        done.set()
        helper.join(timeout=10)
        cluster.undrop(kdt1)
    assert out.returncode == 0, out.stdout[-5000:]
    faults = sorted(n for n in os.listdir(state) if n.startswith("fault.")
                    and not n.endswith(".tmp"))
    assert len(faults) == SOAK_FAULTS, (faults, out.stdout[-5000:])
    restarts = [l for l in _launcher_lines(out.stdout)
                if re.match(r"kerasdist: attempt \d+ of", l)]
    assert len(restarts) == SOAK_FAULTS, restarts
    # Each attempt saved a checkpoint before its fault: no backoff.
    assert "before the next" not in out.stdout, out.stdout[-5000:]
    assert "worker: the newest checkpoint loads" in out.stdout
    kinds = {(state / n).read_text().split()[1] for n in faults}
    assert kinds == {"kill", "freeze", "exception", "drop"}, kinds
