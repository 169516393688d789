"""A test that hits its timeout leaves no process behind.

Each case runs a small pytest session of its own (a test file written to
tmp_path) whose test launches ranks that never end, each with two children
that ignore SIGTERM and left the rank's process group or session
(tests/support/helpers.py STRAY_CHILDREN). The inner test hits its
pytest-timeout;
then every process the ranks recorded must be gone, checked by pid in /proc.
"""

import os
import subprocess
import sys

import pytest

from tests.support.helpers import assert_all_gone
from tests.support.helpers import launcher_env
from tests.support.helpers import recorded_pids

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

# The inner test's timeout: long enough for two ranks (no TensorFlow) and
# their children to start on a busy machine.
_INNER_TIMEOUT_S = 10
_PIDS = ["pid.0", "pid.0.group", "pid.0.session",
         "pid.1", "pid.1.group", "pid.1.session"]

_HEADER = f"""
import os, signal, subprocess, sys
import pytest
from tests.support.helpers import (STRAY_CHILDREN, launch, launcher_env,
                                   pid_file_code, python_cmd)

CODE = python_cmd(pid_file_code(os.path.dirname(__file__), STRAY_CHILDREN))


def start_launcher():
    return subprocess.Popen(
        [sys.executable, "-m", "kerasdist.run", "-np", "2", *CODE],
        env=launcher_env(), stdout=subprocess.DEVNULL,
        start_new_session=True)


@pytest.mark.timeout({_INNER_TIMEOUT_S})
"""

_THROUGH_THE_HELPER = _HEADER + """
def test_hangs():
    launch(2, CODE, timeout=600)
"""

_OWN_LAUNCHER = _HEADER + """
def test_hangs():
    start_launcher().wait()
"""

# SIGALRM blocked: pytest-timeout's exception never comes, as when a test
# is stuck in C code.
_TIMEOUT_CANNOT_REACH = _HEADER + """
def test_hangs():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    start_launcher().wait()
"""


def _run_inner(tmp_path, source, *pytest_args, **env):
    path = tmp_path / "test_inner.py"
    path.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *pytest_args, str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=_INNER_TIMEOUT_S + 120, cwd=tmp_path,
        env=launcher_env(dict(os.environ, **env)))


def _assert_timed_out_and_all_gone(tmp_path, out, needle):
    assert out.returncode == 1, out.stdout
    assert needle in out.stdout, out.stdout
    assert sorted(recorded_pids(tmp_path)) == _PIDS, (
        f"the ranks did not start within {_INNER_TIMEOUT_S} s:\n"
        + out.stdout)
    assert_all_gone(tmp_path)


def test_timeout_in_launch_kills_the_whole_job(tmp_path):
    # No conftest in the inner session: the launch helper alone must kill
    # the launcher's tree, mpiexec's session and the strays included.
    out = _run_inner(tmp_path, _THROUGH_THE_HELPER)
    _assert_timed_out_and_all_gone(
        tmp_path, out, f"Timeout (>{_INNER_TIMEOUT_S:.1f}s)")


def test_timeout_kills_a_launcher_the_test_started_itself(tmp_path):
    # The launcher is the test's own Popen: tests/conftest.py's teardown
    # finds what the test left and kills it.
    out = _run_inner(tmp_path, _OWN_LAUNCHER, "-p", "tests.conftest")
    _assert_timed_out_and_all_gone(
        tmp_path, out, f"Timeout (>{_INNER_TIMEOUT_S:.1f}s)")
    assert "process(es) running; killed" in out.stdout, out.stdout


def test_backstop_when_the_timeout_cannot_reach_the_test(tmp_path):
    out = _run_inner(tmp_path, _TIMEOUT_CANNOT_REACH, "-p", "tests.conftest",
                     TESTS_TIMEOUT_BACKSTOP_S="3")
    _assert_timed_out_and_all_gone(
        tmp_path, out, "is still running 3 s after its 10 s timeout")
