"""Node mode: one `kerasdist run` per "host" (here all on localhost), each
starting its own ranks without mpiexec; together they form one job through
the rendezvous. A failing rank ends every node within a bound, and a bad
flag is one line and exit 2.

Every test starts real launchers, each in a session of its own, with a
timeout that kills their whole trees.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.run import _rank  # noqa: E402
from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import assert_all_gone  # noqa: E402
from tests.support.helpers import free_port  # noqa: E402
from tests.support.helpers import kill_tree  # noqa: E402
from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import launcher_env  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402
from tests.support.helpers import worker_cmd  # noqa: E402
from tests.support.helpers import worker_env  # noqa: E402

pytestmark = pytest.mark.parallel

WORKER = worker_cmd("node_mode_worker.py")


def _node_env(**extra):
    env = worker_env(**extra)
    for k in list(env):
        if k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL",
                         "KERAS_DISTRIBUTION_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    return launcher_env(env)


def _node_argv(nnodes, node_rank, nproc, port, *flags):
    return [sys.executable, "-m", "kerasdist.run", "--nnodes", str(nnodes),
            "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            *flags, *WORKER]


class _Agents:
    """Node agents started one by one (after `delays`), each in a session
    of its own; every one's whole tree is killed on leaving."""

    def __init__(self, argvs, env, delays=None):
        self.argvs, self.env = argvs, env
        self.delays = delays or [0] * len(argvs)
        self.procs, self.files = [None] * len(argvs), [None] * len(argvs)
        self.ended_at = [None] * len(argvs)

    def __enter__(self):
        self.started = time.monotonic()
        self.started_wall = time.time()
        for i in sorted(range(len(self.argvs)), key=lambda i: self.delays[i]):
            time.sleep(max(0.0, self.started + self.delays[i]
                           - time.monotonic()))
            self.files[i] = tempfile.TemporaryFile(mode="w+")
            self.procs[i] = subprocess.Popen(
                self.argvs[i], stdout=self.files[i],
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=REPO_ROOT, start_new_session=True)
        return self

    def wait(self, timeout, which=None):
        """Waits for the agents (all, or those in `which`); returns their
        exit codes. An agent still running at `timeout` fails the test."""
        which = range(len(self.procs)) if which is None else which
        deadline = time.monotonic() + timeout
        for i in which:
            try:
                self.procs[i].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"node agent {i} still runs after {timeout} s\n"
                    + self.outputs()) from None
            self.ended_at[i] = self.ended_at[i] or time.monotonic()
        return [self.procs[i].returncode for i in which]

    def output(self, i):
        f = self.files[i]
        f.flush()
        f.seek(0)
        return f.read()

    def outputs(self):
        return "\n".join(f"--- node agent {i} ---\n{self.output(i)}"
                         for i in range(len(self.procs))
                         if self.files[i] is not None)

    def __exit__(self, *exc):
        for p in self.procs:
            if p is not None:
                kill_tree(p)
                p.wait()
        for f in self.files:
            if f is not None:
                f.close()


def _assert_formed(agents, nnodes, nproc):
    codes = agents.wait(150)
    assert codes == [0] * nnodes, agents.outputs()
    size = nnodes * nproc
    first = []
    for node in range(nnodes):
        out = agents.output(node)
        for local in range(nproc):
            r = node * nproc + local
            lines = rank_lines(out, r)
            ok = [line for line in lines if line.startswith("node-ok ")]
            assert len(ok) == 1, out
            # kd's local rank is MPI's: every "node" here is one host.
            assert ok[0].startswith(f"node-ok {r} {size} {local} {nproc} "), \
                out
            assert ok[0].endswith(f" {size}"), out
            at = [float(line.split()[1]) for line in lines
                  if line.startswith("first-collective-at ")]
            first += at
        # Ranks of other nodes are not this one's.
        others = {int(m) for m in re.findall(r"^\[(\d+)\]<", out, re.M)}
        assert others <= set(range(node * nproc, (node + 1) * nproc)), out
    assert len(first) == size
    return max(first) - agents.started_wall


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc", [1, 2])
def test_two_nodes_form_one_job(nproc):
    port = free_port()
    argvs = [_node_argv(2, n, nproc, port) for n in range(2)]
    with _Agents(argvs, _node_env()) as agents:
        took = _assert_formed(agents, 2, nproc)
    print(f"2 nodes x {nproc}: start to first collective {took:.2f} s")


@pytest.mark.timeout(200)
def test_node_zero_twenty_seconds_late():
    """Node 1's ranks wait for the coordinator node 0 serves."""
    port = free_port()
    argvs = [_node_argv(2, n, 1, port) for n in range(2)]
    with _Agents(argvs, _node_env(), delays=[20, 0]) as agents:
        _assert_formed(agents, 2, 1)


@pytest.mark.timeout(150)
def test_one_node_needs_no_master_flags():
    out = launch(None, WORKER, timeout=120, env=_node_env(),
                 launcher_args=("--nproc_per_node", "2"))
    assert out.returncode == 0, out.stdout
    for r in (0, 1):
        assert any(line.startswith(f"node-ok {r} 2 {r} 2 ")
                   for line in rank_lines(out.stdout, r)), out.stdout
    # All its ranks are the launcher's: it made the job a secret.
    assert "the rendezvous is unauthenticated" not in out.stdout


def _failing_job(tmp_path, nproc, fail_rank):
    port = free_port()
    argvs = [_node_argv(2, n, nproc, port) for n in range(2)]
    env = _node_env(NODE_WORKER_FAIL=fail_rank, NODE_WORKER_PIDS=tmp_path,
                    KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=3)
    return _Agents(argvs, env)


def _wait_for(agents, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(text in agents.output(i) for i in range(len(agents.procs))):
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} within {timeout} s\n"
                         + agents.outputs())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc, fail_rank", [(1, 1), (2, 2), (1, 0)])
def test_failing_rank_ends_every_node(tmp_path, nproc, fail_rank):
    fail_node = fail_rank // nproc
    with _failing_job(tmp_path, nproc, fail_rank) as agents:
        failed = _wait_for(agents, "node-ok", 150)
        codes = agents.wait(30)
        assert all(c != 0 for c in codes), agents.outputs()
        # Each agent within the bound: the loss is seen at once (the
        # failed rank's heartbeat connection closes), then the teardown.
        assert max(agents.ended_at) - failed < 20, agents.outputs()
        out = agents.output(fail_node)
        assert re.search(rf"^kerasdist: rank {fail_rank} \(host \S+\) exited "
                         r"with code 1; "
                         r"(stopping the other ranks|the job has ended)\.$",
                         out,
                         re.M), out
        assert f"rank {fail_rank} fails on purpose" in out
        other = agents.output(1 - fail_node)
        assert re.search(rf"^kerasdist: lost ranks? (\d+, )*{fail_rank}\b",
                         other, re.M), other
    assert_all_gone(tmp_path)


@pytest.mark.timeout(200)
def test_frozen_node_ends_the_others_within_the_heartbeat_bound(tmp_path):
    """Node 1's processes all stop (SIGSTOP: a hung host, no connection
    closes). Node 0's ranks lose them after the heartbeat timeout (3 s)
    and node 0's agent ends; once node 1 runs again it ends too."""
    port = free_port()
    argvs = [_node_argv(2, n, 1, port) for n in range(2)]
    env = _node_env(NODE_WORKER_SPIN=1, NODE_WORKER_PIDS=tmp_path,
                    KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=3)
    with _Agents(argvs, env) as agents:
        _wait_for(agents, "node-ok", 150)
        frozen = _rank.job_processes(roots=(agents.procs[1].pid,),
                                     sessions=(agents.procs[1].pid,))
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            [code0] = agents.wait(30, which=[0])
        finally:
            for pid in frozen:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
        took = agents.ended_at[0] - stopped
        assert code0 != 0, agents.outputs()
        assert 3 <= took < 3 + 12, (took, agents.outputs())
        assert re.search(r"^kerasdist: lost rank 1 on host \S+: no heartbeat "
                         r"for 3 s", agents.output(0), re.M), agents.outputs()
        [code1] = agents.wait(30, which=[1])
        assert code1 != 0, agents.outputs()
    print(f"frozen node: the other ended {took:.1f} s after the freeze")
    assert_all_gone(tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     "--node-rank 2 is out of range for --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "1"],
     "--master-addr is required with --nnodes 2"),
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "0"],
     "--master-port '0' is not a TCP port"),
    (["-np", "3", "--nnodes", "2", "--master-addr", "h"],
     "-np 3 does not match --nnodes 2 x --nproc-per-node 1 = 2 ranks"),
    (["--nnodes", "1:4", "--master-addr", "h"],
     "--nnodes 1:4: a range of nodes (growing or shrinking jobs) is not "
     "supported"),
    (["--nproc-per-node", "two"], "--nproc-per-node 'two' is not a positive"),
    (["-H", "a:2", "--nnodes", "2", "--master-addr", "h"],
     "-H does not go with node mode"),
])
def test_bad_flags_are_one_line_and_exit_2(flags, message):
    out = launch(None, [sys.executable, "-c", "pass"], timeout=30,
                 launcher_args=flags)
    assert out.returncode == 2, out.stdout
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout
    assert lines[0].startswith(f"kerasdist run: error: {message}"), lines


_SLEEPER = (
    "import os, sys, time\n"
    "D = sys.argv[1]\n"
    "open(os.path.join(D, 'pid.' + os.environ['RANK']), 'w')"
    ".write(str(os.getpid()))\n"
    "print('up', os.environ['RANK'], flush=True)\n"
    "time.sleep(600)\n")


@pytest.mark.timeout(120)
def test_timeout_stops_this_nodes_ranks(tmp_path):
    start = time.monotonic()
    out = launch(None, [sys.executable, "-c", _SLEEPER, str(tmp_path)],
                 timeout=90, env=_node_env(), launcher_args=(
                     "--nproc-per-node", "2", "--timeout", "4"))
    assert out.returncode == 124, out.stdout
    assert "kerasdist: timeout: the job ran longer than 4 s; stopping all " \
           "ranks." in out.stdout
    assert time.monotonic() - start < 4 + 15, out.stdout
    assert_all_gone(tmp_path)


@pytest.mark.timeout(120)
def test_sigterm_to_the_node_agent_stops_its_ranks(tmp_path):
    argv = [sys.executable, "-m", "kerasdist.run", "--nproc-per-node", "2",
            sys.executable, "-c", _SLEEPER, str(tmp_path)]
    with _Agents([argv], _node_env()) as agents:
        _wait_for_count(agents, "up ", 2, 60)
        os.kill(agents.procs[0].pid, signal.SIGTERM)
        sent = time.monotonic()
        [code] = agents.wait(30)
        assert code == 128 + signal.SIGTERM, agents.outputs()
        assert agents.ended_at[0] - sent < 10, agents.outputs()
        assert "received SIGTERM; stopping all ranks." in agents.output(0)
    assert_all_gone(tmp_path)


def _wait_for_count(agents, text, count, timeout):
    deadline = time.monotonic() + timeout
    while agents.output(0).count(text) < count:
        if time.monotonic() > deadline:
            raise AssertionError(agents.outputs())
        time.sleep(0.1)
