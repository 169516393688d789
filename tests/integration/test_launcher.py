"""Runs the real launcher with real processes (no TensorFlow).

Every launch has a timeout, so no test can hang.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.tools import doctor  # noqa: E402
from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import STRAY_CHILDREN  # noqa: E402
from tests.support.helpers import assert_all_gone  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import launcher_env  # noqa: E402
from tests.support.helpers import parent_pid  # noqa: E402
from tests.support.helpers import pid_file_code  # noqa: E402
from tests.support.helpers import python_cmd  # noqa: E402
from tests.support.helpers import rank_env  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402
from tests.support.helpers import recorded_pids  # noqa: E402

pytestmark = pytest.mark.parallel

# Ranks of a failed job must be gone within this many seconds.
_TEARDOWN_S = 30


def test_prefixes_stdout_and_stderr_and_env(tmp_path):
    code = (
        "import os, sys\n"
        "r = os.environ['PMI_RANK']\n"
        "print('out', r, os.environ['KERASDIST_FUSION_THRESHOLD'],\n"
        "      os.environ['KERASDIST_CYCLE_TIME'],\n"
        "      os.environ['KERASDIST_TIMELINE'],\n"
        "      os.environ['KERASDIST_AUTOTUNE'],\n"
        "      os.environ['KERASDIST_RESTART_ATTEMPT'])\n"
        "print('err', r, file=sys.stderr)\n"
        "sys.stdout.write('no newline at the end')\n"
    )
    out = launch(2, python_cmd(code), timeout=60, launcher_args=(
        "--fusion-threshold-mb", "2", "--cycle-time-ms", "1.5",
        "--timeline-filename", "tl.json", "--autotune"), cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout
    timeline = str(tmp_path / "tl.json")
    for r in (0, 1):
        assert rank_lines(out.stdout, r) == [
            f"out {r} 2097152 1.5 {timeline} 1 0", "no newline at the end"]
        assert rank_lines(out.stdout, r, "stderr") == [f"err {r}"]


# A rank mallocs 64 MiB (as TensorFlow's CPU allocator does for a large
# tensor), touches every page and prints its GLIBC_TUNABLES and how much of
# the block's mapping the kernel backs by huge pages (/proc/self/smaps).
_HUGE = (
    "import ctypes, os, re\n"
    "libc = ctypes.CDLL(None)\n"
    "libc.malloc.restype = ctypes.c_void_p\n"
    "n = 64 << 20\n"
    "p = libc.malloc(n)\n"
    "ctypes.memset(p, 1, n)\n"
    "kb, inside = None, False\n"
    "for line in open('/proc/self/smaps'):\n"
    "    m = re.match(r'([0-9a-f]+)-([0-9a-f]+) ', line)\n"
    "    if m:\n"
    "        inside = int(m.group(1), 16) <= p < int(m.group(2), 16)\n"
    "    elif inside and line.startswith('AnonHugePages:'):\n"
    "        kb = int(line.split()[1])\n"
    "print('huge', os.environ.get('GLIBC_TUNABLES'), kb)\n"
)


def _huge_of(out, r):
    lines = [l for l in rank_lines(out.stdout, r) if l.startswith("huge ")]
    assert len(lines) == 1, out.stdout
    _, tunables, kb = lines[0].split()
    return tunables, int(kb)


def test_ranks_malloc_on_huge_pages_unless_told_not_to():
    mode = doctor._thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'absent'} here")
    plain = {k: v for k, v in launcher_env().items() if k != "GLIBC_TUNABLES"}
    out = launch(2, python_cmd(_HUGE), timeout=60, env=plain)
    assert out.returncode == 0, out.stdout
    for r in (0, 1):
        tunables, kb = _huge_of(out, r)
        assert tunables == "glibc.malloc.hugetlb=1", out.stdout
        assert kb >= 32 * 1024, out.stdout  # most of the 64 MiB block
    # A user's own tunables are kept; their own hugetlb setting wins.
    env = dict(plain, GLIBC_TUNABLES="glibc.malloc.hugetlb=0:"
               "glibc.malloc.arena_max=4")
    out = launch(1, python_cmd(_HUGE), timeout=60, env=env)
    assert out.returncode == 0, out.stdout
    assert _huge_of(out, 0)[0] == env["GLIBC_TUNABLES"], out.stdout
    if mode == "madvise":  # under "always" every block is huge
        assert _huge_of(out, 0)[1] == 0, out.stdout
    env = dict(plain, GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    out = launch(1, python_cmd(_HUGE), timeout=60, env=env)
    assert _huge_of(out, 0)[0] == ("glibc.malloc.arena_max=4:"
                                    "glibc.malloc.hugetlb=1"), out.stdout
    out = launch(1, python_cmd(_HUGE), timeout=60, env=plain,
                 launcher_args=("--no-huge-pages",))
    tunables, kb = _huge_of(out, 0)
    assert tunables == "None", out.stdout
    if mode == "madvise":
        assert kb == 0, out.stdout


_AFFINITY = "import os; print('cpus', sorted(os.sched_getaffinity(0)))"


def _cpus_of(out, r):
    lines = [l for l in rank_lines(out.stdout, r) if l.startswith("cpus ")]
    assert len(lines) == 1, out.stdout
    return set(eval(lines[0][5:]))


def test_ranks_are_bound_to_disjoint_cpu_shares():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs to give 2 ranks a share each")
    out = launch(2, python_cmd(_AFFINITY), timeout=60,
                 launcher_args=("--verbose",))
    assert out.returncode == 0, out.stdout
    shares = [_cpus_of(out, r) for r in (0, 1)]
    assert shares[0] and shares[1] and not shares[0] & shares[1], shares
    assert shares[0] | shares[1] == allowed, shares
    assert abs(len(shares[0]) - len(shares[1])) <= 1
    assert "kerasdist: rank 1: bound to CPU(s)" in out.stdout, out.stdout


def test_bind_to_none_and_oversubscribed_ranks_are_not_bound():
    allowed = os.sched_getaffinity(0)
    out = launch(2, python_cmd(_AFFINITY), timeout=60,
                 launcher_args=("--bind-to", "none"))
    assert out.returncode == 0, out.stdout
    assert [_cpus_of(out, r) for r in (0, 1)] == [allowed, allowed]
    # One rank more than CPUs: the launcher (and so the ranks) gets at most
    # two CPUs, so that this stays small on a big machine.
    few = set(sorted(allowed)[:2])
    np_ = len(few) + 1
    os.sched_setaffinity(0, few)
    try:
        out = launch(np_, python_cmd(_AFFINITY), timeout=60,
                     launcher_args=("--verbose",))
    finally:
        os.sched_setaffinity(0, allowed)
    assert out.returncode == 0, out.stdout
    assert all(_cpus_of(out, r) == few for r in range(np_))
    assert f"not bound: {np_} ranks on this host" in out.stdout, out.stdout


def test_exit_code_zero_and_early_exit_is_not_failure():
    code = ("import os, time\n"
            "if os.environ['PMI_RANK'] == '1': time.sleep(1.5)\n")
    out = launch(2, python_cmd(code), timeout=60)
    assert out.returncode == 0, out.stdout
    assert "kerasdist:" not in out.stdout


@pytest.mark.parametrize("failing, code, message", [
    ("sys.exit(3)", 3, "rank 1 (host {host}) exited with code 3"),
    ("os.kill(os.getpid(), 9)", 137,
     "rank 1 (host {host}) exited with signal 9 (SIGKILL)"),
])
def test_failed_rank_stops_the_job(tmp_path, failing, code, message):
    body = (f"if r == 1: time.sleep(0.5); {failing}\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    out = launch(2, python_cmd(pid_file_code(tmp_path, body)),
                 timeout=_TEARDOWN_S + 30)
    assert time.monotonic() - start < _TEARDOWN_S, out.stdout
    assert out.returncode == code, out.stdout
    import socket
    assert message.format(host=socket.gethostname()) in out.stdout
    assert "stopping the other ranks" in out.stdout
    assert_all_gone(tmp_path)


def test_rank_ignoring_sigterm_is_killed(tmp_path):
    body = ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "if r == 0: time.sleep(0.5); sys.exit(5)\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    out = launch(3, python_cmd(pid_file_code(tmp_path, body)),
                 timeout=_TEARDOWN_S + 30)
    assert time.monotonic() - start < _TEARDOWN_S, out.stdout
    assert out.returncode == 5, out.stdout
    assert "rank 0 (host" in out.stdout
    assert_all_gone(tmp_path)


@pytest.mark.parametrize("launcher_args, command", [
    (("-np", "0"), ["true"]),
    (("-np", "-2"), ["true"]),
    (("-np", "x"), ["true"]),
    (("-np", "2", "-H", "host:abc"), ["true"]),
    (("-np", "2", "--hostfile", "/nonexistent/hostfile"), ["true"]),
    (("-np", "2"), []),
    (("-np", "3", "-H", "localhost:2"), ["true"]),
])
def test_bad_input_exits_2(launcher_args, command):
    out = subprocess.run(
        [sys.executable, "-m", "kerasdist.run", *launcher_args, *command],
        capture_output=True, text=True, timeout=60, env=launcher_env(),
        cwd=REPO_ROOT)
    assert out.returncode == 2, out
    assert out.stderr.startswith("kerasdist run: error: "), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("launcher_args, line", [
    (("-np", "100000000000000000000"),
     "kerasdist run: error: argument -np/-n/--num-proc: "
     "100000000000000000000 is above 1048576, the most ranks of a kerasdist "
     "job; give the number of ranks to run\n"),
    (("--nproc-per-node", "1000000000"),
     "kerasdist run: error: --nproc-per-node 1000000000 is above "),
])
def test_a_typo_in_a_rank_count_is_one_line_not_a_full_host(launcher_args,
                                                            line):
    # Once: one rank ran, then the launcher grew to 17.6 GB (a list the
    # size of -np, built in the thread that handles SIGTERM), or started
    # ranks until the host ran out. Here under a 2 GB address space, so a
    # regression fails this test, not the machine.
    start = time.monotonic()
    out = launch(None, ["true"], timeout=30, launcher_args=launcher_args,
                 prefix=("sh", "-c", 'ulimit -v 2000000; exec "$@"', "sh"))
    assert out.returncode == 2, out.stdout
    assert out.stdout.startswith(line), out.stdout
    assert out.stdout.count("\n") == 1, out.stdout
    assert time.monotonic() - start < 15


def test_max_restarts_relaunches_failed_job():
    code = ("import os, sys\n"
            "a = os.environ['KERASDIST_RESTART_ATTEMPT']\n"
            "print('attempt', a)\n"
            "if a == '0' and os.environ['PMI_RANK'] == '1':\n"
            "    os.kill(os.getpid(), 9)\n")
    out = launch(2, python_cmd(code), timeout=60,
                 launcher_args=("--max-restarts", "1"))
    assert out.returncode == 0, out.stdout
    assert ("kerasdist: attempt 2 of 2 (the last attempt ended because "
            f"rank 1 (host {socket.gethostname()}) exited with signal 9 "
            "(SIGKILL))") in out.stdout
    for r in (0, 1):
        assert rank_lines(out.stdout, r)[-1] == "attempt 1", out.stdout


def test_a_frozen_rank_alone_in_its_job_is_killed_and_restarted():
    # No other rank's heartbeat watches a job of one rank: its wrapper
    # kills it once its heartbeat thread is silent for the timeout, and
    # the launcher restarts the job. Before, the job waited for ever.
    code = ("import os, signal, time\n"
            "import kerasdist as kd\n"
            "kd.init()\n"
            "a = os.environ['KERASDIST_RESTART_ATTEMPT']\n"
            "print('attempt', a, 'size', kd.size(), flush=True)\n"
            "time.sleep(3)  # beats go on while the main thread waits\n"
            "if a == '0':\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "kd.shutdown()\n")
    start = time.monotonic()
    out = launch(1, python_cmd(code), timeout=90,
                 env=rank_env(KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=2),
                 launcher_args=("--max-restarts", "1"))
    assert out.returncode == 0, out.stdout
    assert ("kerasdist: rank 0: its heartbeat sent nothing for 2 s (the "
            "process is frozen or hung); killing it, so that the job ends: "
            "no other rank can find it lost.") in out.stdout, out.stdout
    assert ("kerasdist: attempt 2 of 2 (the last attempt ended because "
            f"rank 0 (host {socket.gethostname()}) exited with signal 9 "
            "(SIGKILL))") in out.stdout, out.stdout
    assert rank_lines(out.stdout, 0) == ["attempt 0 size 1",
                                         "attempt 1 size 1"], out.stdout
    assert time.monotonic() - start < 60


def test_max_restarts_gives_up_with_last_code():
    out = launch(2, python_cmd("import sys; sys.exit(7)"), timeout=60,
                 launcher_args=("--max-restarts", "1"))
    assert out.returncode == 7, out.stdout
    assert "attempt 2 of 2" in out.stdout
    assert "giving up after 2 attempts" in out.stdout


def test_restarts_back_off_and_timeout_holds_between_them():
    # A job that fails at once, with restarts to spare: the launcher
    # waits longer before each restart, and --timeout ends it on time.
    start = time.monotonic()
    out = launch(1, python_cmd("import sys; sys.exit(3)"), timeout=60,
                 launcher_args=("--max-restarts", "50", "--timeout", "3"))
    took = time.monotonic() - start
    assert out.returncode == 124, out.stdout
    assert "waiting 0.5 s before the next" in out.stdout, out.stdout
    assert "waiting 1 s before the next" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith(
        "kerasdist: the job timed out after 3 s; not restarting."), out.stdout
    assert out.stdout.count("kerasdist: attempt ") < 6, out.stdout
    assert took < 20, took


def test_max_restarts_does_not_repeat_a_deterministic_error():
    code = ("import os\n"
            "print('attempt', os.environ['KERASDIST_RESTART_ATTEMPT'])\n"
            "raise TypeError('build_model() got an unexpected keyword')\n")
    out = launch(2, python_cmd(code), timeout=60,
                 launcher_args=("--max-restarts", "5"))
    assert out.returncode == 1, out.stdout
    assert "attempt 2 of 6" in out.stdout and "attempt 3" not in out.stdout
    assert out.stdout.rstrip("\n").splitlines()[-1] == (
        "kerasdist: not restarting: attempt 2 failed as attempt 1 did (rank "
        "0: TypeError: build_model() got an unexpected keyword), an error a "
        "restart repeats."), out.stdout


def test_an_attempt_that_saved_progress_restarts_at_once():
    # Each attempt reports a checkpoint (as the Trainer and elastic commits
    # do), then fails at once with the same words: no backoff, and the
    # error is not taken for one a restart repeats.
    code = ("from kerasdist._core import resize as _resize\n"
            "_resize.report_progress()\n"
            "raise RuntimeError('a node went away')\n")
    out = launch(1, python_cmd(code), timeout=60,
                 launcher_args=("--max-restarts", "2"))
    assert out.returncode == 1, out.stdout
    assert "attempt 3 of 3" in out.stdout, out.stdout
    assert "giving up after 3 attempts" in out.stdout, out.stdout
    assert "before the next" not in out.stdout, out.stdout
    assert "kerasdist-progress" not in out.stdout, out.stdout


def test_a_printed_progress_marker_does_not_skip_the_backoff():
    # Once, one printed line turned 7 attempts in 60 s into 286: without
    # the job's token it is the program's output, not saved progress.
    out = launch(1, python_cmd(
        "import sys; sys.stderr.write('\\x1ekerasdist-progress\\n'); "
        "sys.exit(3)"), timeout=60,
        launcher_args=("--max-restarts", "50", "--timeout", "3"))
    # Backed off, and stopped as a failure that repeats (or by --timeout).
    assert out.returncode in (3, 124), out.stdout
    assert "waiting 0.5 s before the next" in out.stdout, out.stdout
    assert out.stdout.count("kerasdist: attempt ") < 6, out.stdout
    assert "[0]<stderr>:\x1ekerasdist-progress" in out.stdout


@pytest.mark.parametrize("given, seen", [(None, "1"), ("0", "0")])
def test_tensorflow_start_up_lines_are_quiet_unless_asked(given, seen):
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    if given is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = given
    out = launch(1, python_cmd(
        "import os; print('level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))"),
        timeout=60, env=env)
    assert out.returncode == 0, out.stdout
    assert rank_lines(out.stdout, 0) == [f"level {seen}"], out.stdout


def test_timeout_stops_job_with_124(tmp_path):
    body = "print('up', flush=True); time.sleep(600)\n"
    start = time.monotonic()
    out = launch(2, python_cmd(pid_file_code(tmp_path, body)), timeout=60,
                 launcher_args=("--timeout", "2"))
    assert out.returncode == 124, out.stdout
    assert time.monotonic() - start < _TEARDOWN_S
    assert "timeout" in out.stdout
    assert rank_lines(out.stdout, 1) == ["up"]
    assert_all_gone(tmp_path)


@pytest.mark.slow
def test_timeout_kills_children_that_left_the_rank(tmp_path):
    # Each rank's children ignore SIGTERM, one in a process group of its own
    # (out of reach of the wrapper's signals), one in a session of its own
    # (out of reach of a kill of mpiexec's session): --timeout must still
    # leave no process of the job running.
    out = launch(2, python_cmd(pid_file_code(tmp_path, STRAY_CHILDREN)),
                 timeout=90, launcher_args=("--timeout", "8"))
    assert out.returncode == 124, out.stdout
    assert [rank_lines(out.stdout, r) for r in (0, 1)] == [["up"]] * 2, (
        "the ranks did not start within the 8 s timeout:\n" + out.stdout)
    assert sorted(recorded_pids(tmp_path)) == [
        "pid.0", "pid.0.group", "pid.0.session",
        "pid.1", "pid.1.group", "pid.1.session"]
    assert "killed 4 process(es) of the job that outlived mpiexec" in (
        out.stdout), out.stdout
    assert_all_gone(tmp_path, within=2)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP,
                                    signal.SIGKILL])
def test_sigint_to_launcher_stops_all_ranks(tmp_path, signum):
    # SIGHUP (the terminal or the session gone) stops the job as torchrun
    # does, not ignored; SIGKILL, which the launcher cannot see, ends
    # mpiexec and the ranks all the same (their parent-death signal).
    body = "print('up', flush=True); time.sleep(600)\n"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kerasdist.run", "-np", "2",
         *python_cmd(pid_file_code(tmp_path, body))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=launcher_env(), cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("pid.*"))) < 2:
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        # Each rank's parent: its wrapper (kerasdist/run/_rank.py), which
        # must end too, not only the ranks.
        wrappers = [parent_pid(p) for p in recorded_pids(tmp_path).values()]
        for w in wrappers:
            with open(f"/proc/{w}/cmdline", "rb") as f:
                assert b"/run/_rank.py" in f.read(), w
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=_TEARDOWN_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signum, out
    else:
        assert proc.returncode == 128 + signum, out
        assert f"received {signal.Signals(signum).name}" in out
    assert_all_gone(tmp_path, also=wrappers)


def test_np3_oversubscribes_and_no_prefix():
    # Each rank also has the job's secret, not the token of the wrapper's
    # exit markers, and prints a forged marker that says it failed: the
    # job goes on and the line is the rank's output.
    code = ("import os, sys; print('rank', os.environ['PMI_RANK']); "
            "assert len(os.environ['KERASDIST_JOB_SECRET']) == 64; "
            "assert 'KERASDIST_MARKER_TOKEN' not in os.environ; "
            "sys.stderr.write('\\x1ekerasdist-rank-exit rank=0 host=h "
            "status=9\\n')")
    out = launch(3, python_cmd(code), timeout=60)
    assert out.returncode == 0, out.stdout
    for r in range(3):
        assert rank_lines(out.stdout, r) == [f"rank {r}"]
        assert (f"[{r}]<stderr>:\x1ekerasdist-rank-exit rank=0 host=h "
                f"status=9\n") in out.stdout, out.stdout
    out = launch(3, python_cmd(code), timeout=60,
                 launcher_args=("--no-prefix", "--verbose"))
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    assert sorted(x for x in lines if x.startswith("rank")) == [
        "rank 0", "rank 1", "rank 2"]
    assert any(x.startswith("kerasdist: running: ") and "mpiexec" in x
               for x in lines)


def test_long_lines_are_not_interleaved():
    # Lines up to PIPE_BUF (4096 bytes) reach mpiexec in one write.
    code = ("import os, sys\n"
            "r = os.environ['PMI_RANK']\n"
            "for i in range(300):\n"
            "    print(r * 3000, flush=True)\n"
            "    print(r * 3000, file=sys.stderr, flush=True)\n")
    out = launch(2, python_cmd(code), timeout=60)
    assert out.returncode == 0, out.stdout[-2000:]
    for r in (0, 1):
        for stream in ("stdout", "stderr"):
            lines = rank_lines(out.stdout, r, stream)
            assert lines == [str(r) * 3000] * 300


def test_mpi_works_through_the_wrapper():
    pytest.importorskip("mpi4py")
    code = ("from mpi4py import MPI\n"
            "c = MPI.COMM_WORLD\n"
            "print(c.Get_size(), c.allreduce(c.Get_rank() + 1))\n")
    out = launch(2, python_cmd(code), timeout=120)
    assert out.returncode == 0, out.stdout
    assert rank_lines(out.stdout, 0) == ["2 3"]
    assert rank_lines(out.stdout, 1) == ["2 3"]


def test_kerasdist_cli_run():
    out = subprocess.run(
        [sys.executable, "-m", "kerasdist.tools.cli", "run", "-np", "2",
         *python_cmd("print('hi')")],
        capture_output=True, text=True, timeout=60, env=launcher_env(),
        cwd=REPO_ROOT)
    assert out.returncode == 0, out
    assert rank_lines(out.stdout, 1) == ["hi"]


# --- growing and shrinking: --host-discovery-script while the job runs -----

def _listed(tmp_path, hosts):
    """A hosts file and a discovery script that prints it."""
    listed = tmp_path / "hosts.txt"
    listed.write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    return listed, script


def _elastic_args(script):
    return ("--host-discovery-script", str(script), "--max-np", "2",
            "--discovery-interval", "0.5")


# Says it checks for resize requests (as the Trainer does, with the
# launcher's marker line and the job's token), then lists a second slot.
_ANNOUNCE_AND_GROW = (
    "    from kerasdist._core import resize; resize.announce(0)\n"
    "    open(L, 'w').write('localhost:2\\n')\n")

_GREW = ("kerasdist: growing from 1 to 2 ranks: host localhost has 2 slot(s) "
         "now, not 1")


def test_sigusr1_does_not_kill_a_command_that_does_not_handle_it(tmp_path):
    # The launcher's resize request reaches the command's process group (a
    # child with a handler of its own notes it), but the command, which has
    # no handler, was started with SIGUSR1 ignored: it goes on and ends
    # normally, and so does the job, at its size.
    listed, script = _listed(tmp_path, "localhost:1\n")
    got = tmp_path / "got"
    code = (f"L, G = {str(listed)!r}, {str(got)!r}\n"
            "import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, "
            "time, sys; signal.signal(signal.SIGUSR1, lambda *a: open(sys.argv"
            "[1], \"w\").close()); print(1, flush=True); time.sleep(30)', G],"
            " stdout=subprocess.PIPE)\n"
            "child.stdout.readline()\n"
            "if True:\n" + _ANNOUNCE_AND_GROW +
            "deadline = time.monotonic() + 30\n"
            "while not os.path.exists(G) and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            "child.kill()\n"
            "mask = [l for l in open('/proc/self/status')\n"
            "        if l.startswith('SigIgn:')][0].split()[1]\n"
            "print('survived', os.path.exists(G),\n"
            "      bool(int(mask, 16) >> (signal.SIGUSR1 - 1) & 1))\n")
    out = launch(1, python_cmd(code), timeout=90,
                 launcher_args=_elastic_args(script))
    assert out.returncode == 0, out.stdout
    assert _GREW in out.stdout, out.stdout
    assert rank_lines(out.stdout, 0) == ["survived True True"], out.stdout


def test_a_resize_relaunches_at_the_new_size_without_a_restart(tmp_path):
    # A command that stops when asked (exit code 76, as the Trainer does
    # after its checkpoint) is relaunched on 2 ranks, with no
    # --max-restarts: a resize is no failure.
    listed, script = _listed(tmp_path, "localhost:1\n")
    code = (f"L = {str(listed)!r}\n"
            "import os, signal, sys, time\n"
            "a = os.environ['KERASDIST_RESTART_ATTEMPT']\n"
            "if a == '0':\n"
            "    signal.signal(signal.SIGUSR1, lambda *x: sys.exit(76))\n"
            + _ANNOUNCE_AND_GROW +
            "    time.sleep(30)\n"
            "    sys.exit('never asked')\n"
            "print('attempt', a, 'size', os.environ['PMI_SIZE'])\n")
    out = launch(1, python_cmd(code), timeout=90,
                 launcher_args=_elastic_args(script))
    assert out.returncode == 0, out.stdout
    assert _GREW in out.stdout, out.stdout
    assert "attempt 2 of" not in out.stdout and "exited with" not in out.stdout
    for r in (0, 1):
        assert rank_lines(out.stdout, r) == ["attempt 1 size 2"], out.stdout


def test_a_printed_resizable_marker_asks_for_no_resize(tmp_path):
    # The marker without the job's token is the program's output: the
    # launcher does not take it for a command that checks for resizes.
    listed, script = _listed(tmp_path, "localhost:2\n")
    code = ("import os, time\n"
            "os.write(2, b'\\x1ekerasdist-resizable rank=0\\n')\n"
            "time.sleep(2.5)\n")
    out = launch(1, python_cmd(code), timeout=60,
                 launcher_args=_elastic_args(script))
    assert out.returncode == 0, out.stdout
    assert "growing" not in out.stdout, out.stdout
    assert "[0]<stderr>:\x1ekerasdist-resizable rank=0" in out.stdout


def test_exit_code_76_unasked_is_a_failure(tmp_path):
    _, script = _listed(tmp_path, "localhost:1\n")
    out = launch(1, python_cmd("import sys; sys.exit(76)"), timeout=60,
                 launcher_args=_elastic_args(script))
    assert out.returncode == 76, out.stdout
    assert "rank 0 (host " in out.stdout and "exited with code 76" in \
        out.stdout, out.stdout
