"""No test leaves a process behind, and none can hang the session.

- pytest becomes a child subreaper: a process orphaned by a test (a rank
  whose launcher was killed, a child of a killed rank) is re-parented to
  pytest instead of init, so it stays in pytest's process tree.
- After every test, every process the test started that is still running
  (with its tree, sessions and process groups) is killed, and the test is
  warned about by name; then the orphans it left are reaped.
- pytest-timeout (the `signal` method, see pyproject.toml) fails a test that
  runs past its timeout: the exception unwinds through the test, whose
  launches kill their process trees (tests/support/helpers.py), and the teardown
  above kills the rest. A test stuck where the exception cannot reach it
  (inside C code) is caught by a backstop thread _BACKSTOP_S later, which
  prints every thread's stack, kills every process pytest started and
  exits.
- SIGTERM (the overall bound in .ci/run sends it) kills every process
  pytest started, then stops the session as Ctrl-C does, so the summary
  and the slowest tests still print.
- Under pytest-xdist (`make test` runs two workers), each test file is one
  group on one worker, so a file's module fixtures (one launch for many
  checks) run once. Files share a group where they share a session fixture
  that is costly to make (the Open MPI build) or must never run at the
  same time (the native build into the tree's object directories):
  _SHARED_GROUPS. The longest groups start first (_FIRST_GROUPS).
"""

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import warnings

import pytest

from kerasdist.run import _rank

_PR_SET_CHILD_SUBREAPER = 36
# Seconds past a test's timeout before the backstop kills the session
# (tests/integration/test_no_hang.py sets it short).
_BACKSTOP_S = float(os.environ.get("TESTS_TIMEOUT_BACKSTOP_S", "60"))
_BACKSTOP_KEY = pytest.StashKey[threading.Timer]()
_TESTS = os.path.dirname(os.path.abspath(__file__))
# Test files (relative to tests/) grouped onto one xdist worker, in order:
# the files that use the session's Open MPI build of kerasdist
# (tests/cluster/conftest.py), so it is built once, and the files that run
# the native build into the tree's object directories. Every other file is
# a group of its own; each cluster test file makes its own namespace hosts
# (tests/support/cluster.py), so two can run at once.
_SHARED_GROUPS = {
    "cluster/test_multihost.py": "cluster-openmpi",
    "cluster/test_k8s_contracts.py": "cluster-openmpi",
    "cluster/test_site_mpi.py": "cluster-openmpi",
    "cluster/test_slurm.py": "cluster-openmpi",
    "cluster/test_recovery.py": "cluster-openmpi",
    "cluster/test_recovery_fit.py": "cluster-openmpi",
    "integration/test_wheel.py": "build",
    "unit/test_build_nccl.py": "build",
    "unit/test_core_cpp.py": "build",
}
# The longest groups (minutes each), handed out first, longest first, so
# the shorter files fill the run around them; xdist would order groups by
# their number of tests and start these late (pytest_xdist_make_scheduler).
_FIRST_GROUPS = (
    "cluster-openmpi",
    "cluster/test_faults.py",
    "cluster/test_intel_mpi.py",
    "cluster/test_ray.py",
    "build",
)


def _become_subreaper():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: orphans go to init, the rest still holds


def _started_by_pytest():
    """{pid: start time} of every live process in pytest's tree."""
    procs = _rank.job_processes(roots=(os.getpid(),))
    return {pid: st[3] for pid, st in procs.items()}


def _command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _reap_orphans(keep):
    """Reaps the zombie children of pytest whose pids are not in `keep`
    (the children a longer-lived fixture may still wait for)."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if fields[0] == b"Z" and int(fields[1]) == me:
            try:
                os.waitpid(int(name), os.WNOHANG)
            except ChildProcessError:
                pass


def _kill_everything_started():
    _rank.kill_job(roots=(os.getpid(),))


@pytest.fixture(autouse=True)
def _no_process_left_behind(request):
    before = _started_by_pytest()
    yield
    left = {pid: start for pid, start in _started_by_pytest().items()
            if before.get(pid) != start}
    if left:
        names = {pid: _command_line(pid) for pid in left}
        _rank.kill_job(known=left)
        warnings.warn(
            f"{request.node.nodeid} left {len(left)} process(es) running; "
            f"killed: {sorted(names.items())}", stacklevel=1)
    _reap_orphans(keep=set(before))


def _backstop(item, timeout):
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # else the message would die with the capture
        capture.suspend_global_capture(item)
    sys.stderr.write(
        f"\n+++ {item.nodeid} is still running {_BACKSTOP_S:g} s after its "
        f"{timeout:g} s timeout (stuck where the timeout's exception cannot "
        "reach it): killing every process pytest started, and pytest. "
        "Stacks:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    _kill_everything_started()
    os._exit(1)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    timer = threading.Timer(settings.timeout + _BACKSTOP_S, _backstop,
                            (item, settings.timeout))
    timer.daemon = True
    timer.start()
    item.stash[_BACKSTOP_KEY] = timer
    # None: pytest-timeout goes on to set its own timer.


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(_BACKSTOP_KEY, None)
    if timer is not None:
        timer.cancel()


def _on_sigterm(signum, frame):
    _kill_everything_started()
    raise KeyboardInterrupt("SIGTERM: the session ran past its bound")


def _xdist_group(nodeid):
    """The group of a test's node id ("tests/unit/test_x.py::test_y")."""
    path = nodeid.split("::", 1)[0]
    rel = path[len("tests/"):] if path.startswith("tests/") else path
    for prefix, group in _SHARED_GROUPS.items():
        if rel.startswith(prefix):
            return group
    return rel


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler, by the groups above: xdist's own
    `loadgroup` reads a node id attribute that pytest 9 no longer has."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _xdist_group(nodeid)

        def _assign_work_unit(self, node):
            for group in _FIRST_GROUPS:
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
                    break
            super()._assign_work_unit(node)

    return FileGroups(config, log)


# KERASDIST_TEST_TALLY, taken out of the environment at start so that a
# pytest a test runs (tests/integration/test_no_hang.py) adds nothing.
_TALLY = {}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Appends "passed failed skipped" of this session to the file named by
    KERASDIST_TEST_TALLY (tools/tiers.sh, `make test`'s tier table)."""
    path = _TALLY.get("path")
    if not path or hasattr(config, "workerinput"):
        return
    stats = terminalreporter.stats
    counts = [len(stats.get("passed", ())),
              len(stats.get("failed", ())) + len(stats.get("error", ())),
              len(stats.get("skipped", ()))]
    with open(path, "a") as f:
        f.write(" ".join(map(str, counts)) + "\n")


def _rank_site_first():
    site = os.path.join(_TESTS, "support", "rank_site")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site] + [p for p in paths if p])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the tests in tests/unit `unit` (before `-m` selects), so that
    `make test-fast` takes them with `-m "unit or fast"`."""
    unit = os.path.join(_TESTS, "unit") + os.sep
    for item in items:
        if str(item.path).startswith(unit):
            item.add_marker(pytest.mark.unit)


def pytest_configure(config):
    _become_subreaper()
    _rank_site_first()
    _TALLY["path"] = os.environ.pop("KERASDIST_TEST_TALLY", None)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)

