"""_rank.job_processes and kill_job on real processes (no MPI): the tree by
parent, the sessions its members lead, and odd command names in /proc."""

import os
import subprocess
import sys
import time

from kerasdist.run import _rank
from tests.support.helpers import is_running

# Renames itself to a name with ") " in it (as /proc/PID/stat shows it),
# starts a child in a session of its own and one in a process group of its
# own, prints the three pids and sleeps.
_PARENT = """
import ctypes, subprocess, sys, time
ctypes.CDLL(None).prctl(15, b"odd) name (x", 0, 0, 0)  # PR_SET_NAME
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
a = subprocess.Popen(sleep, start_new_session=True)
b = subprocess.Popen(sleep, process_group=0)
print(__import__("os").getpid(), a.pid, b.pid, flush=True)
time.sleep(600)
"""


def _start():
    proc = subprocess.Popen([sys.executable, "-c", _PARENT],
                            stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, [int(p) for p in proc.stdout.readline().split()]


def test_job_processes_follows_parents_and_sessions():
    proc, (parent, in_session, in_group) = _start()
    try:
        with open(f"/proc/{parent}/comm") as f:
            assert f.read().strip() == "odd) name (x"
        got = _rank.job_processes(roots=(parent,))
        assert set(got) == {parent, in_session, in_group}
        ppid, pgid, sid, _ = got[parent]
        assert (ppid, pgid, sid) == (os.getpid(), parent, parent)
        assert got[in_session][1:3] == (in_session, in_session)
        assert got[in_group][1:3] == (in_group, parent)
        # A session's processes, with their descendants; a root that leads
        # no session brings only its own tree.
        assert set(_rank.job_processes(sessions=(in_session,))) == {
            in_session}
        assert set(_rank.job_processes(roots=(in_group,))) == {in_group}
        # By start time: a pid with another start time is another process.
        start = got[in_group][3]
        assert set(_rank.job_processes(known={in_group: start})) == {
            in_group}
        assert _rank.job_processes(known={in_group: start + 1}) == {}
    finally:
        _rank.kill_job(roots=(proc.pid,))
        proc.wait(timeout=30)


def test_kill_job_kills_the_tree_and_the_sessions_it_leads():
    proc, pids = _start()
    killed = _rank.kill_job(roots=(proc.pid,))
    assert set(killed) == set(pids)
    assert proc.wait(timeout=30) == -9
    deadline = time.monotonic() + 5
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if is_running(p)]
    assert _rank.kill_job(roots=(proc.pid,)) == set()
