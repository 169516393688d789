"""The per-rank wrapper's Watchdog (kerasdist/run/_rank.py) on real
processes, no MPI: with recovery in place, a command whose heartbeat feed
goes silent (here: it stops itself with SIGSTOP, as a frozen rank) is
SIGKILLed after the timeout, and the wrapper dies of the same signal (so
Open MPI would tell the survivors); a feed that said "off" (a heartbeat
that ended: the survivors re-form) is not watched; without recovery in
place the pipe is there too (the heartbeat thread of a job of one rank
feeds it), and a frozen command is killed without dying of its signal."""

import os
import signal
import subprocess
import sys
import time

from kerasdist.run import _rank

WRAPPER = os.path.abspath(_rank.__file__)

# Feeds the wrapper's pipe as the heartbeat thread does (liveness.h), then
# does what argv[1] says: "stop" (SIGSTOP itself) or "off" (disarm, then
# sleep past the timeout and exit 0).
_COMMAND = """
import os, signal, sys, time
fd, parent = map(int, os.environ["KERASDIST_WATCHDOG"].split(":"))
assert parent == os.getppid(), (parent, os.getppid())
os.write(fd, b"arm 0.6\\n")
for _ in range(3):
    time.sleep(0.2)
    os.write(fd, b"beat\\n")
if sys.argv[1] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
os.write(fd, b"off\\n")
time.sleep(1.5)
print("slept", flush=True)
"""


def _wrap(mode, recover="1", timeout=30):
    env = dict(os.environ, KERASDIST_RECOVER_IN_PLACE=recover,
               PMI_RANK="4")
    env.pop("KERASDIST_WATCHDOG", None)
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-I", "-S", WRAPPER, "--",
                          sys.executable, "-c", _COMMAND, mode],
                         capture_output=True, text=True, env=env,
                         timeout=timeout)
    return out, time.monotonic() - began


def test_watchdog_kills_a_frozen_command():
    out, took = _wrap("stop")
    assert out.returncode == -signal.SIGKILL, out
    assert ("kerasdist: rank 4: its heartbeat sent nothing for 0.6 s (the "
            "process is frozen or hung); killing it, so that the other "
            "ranks go on without it (recovery in place).") in out.stderr, out
    assert "status=-9 " in out.stderr, out.stderr
    # The feed for 0.6 s, then silent for 0.6 s: killed soon after.
    assert took < 10, took


def test_watchdog_leaves_a_disarmed_command():
    out, _ = _wrap("off")
    assert out.returncode == 0 and "[4]<stdout>:slept" in out.stdout, out
    assert "killing it" not in out.stderr, out.stderr


def test_watchdog_without_recovery_in_place_ends_the_job():
    # The pipe is there in every job; the heartbeat thread feeds it where
    # no other rank watches this one (a job of one rank).
    out, _ = _wrap("stop", recover="0")
    assert out.returncode == 128 + signal.SIGKILL, out
    assert ("kerasdist: rank 4: its heartbeat sent nothing for 0.6 s (the "
            "process is frozen or hung); killing it, so that the job ends: "
            "no other rank can find it lost.") in out.stderr, out
    assert "status=-9 " in out.stderr, out.stderr


def test_watchdog_lines():
    dog = _rank.Watchdog()
    assert dog.wait_s(0.0) is None and not dog.overdue(100.0)
    dog.feed(b"arm 2.5\nbe", 10.0)  # a line in two reads
    assert dog.timeout == 2.5 and not dog.overdue(12.0)
    dog.feed(b"at\n", 12.0)
    assert not dog.overdue(14.0) and dog.overdue(14.6)
    assert abs(dog.wait_s(13.0) - 1.55) < 1e-9
    dog.feed(b"off\n", 14.0)
    assert not dog.overdue(100.0) and dog.wait_s(100.0) is None
