"""Ranks forked from a process that has imported TensorFlow already.

A job that is restarted many times (tests/cluster/test_faults.py's soak)
pays a TensorFlow import (3-4 CPU s) in every rank of every attempt. Here
one server per host imports the costly modules once, and each attempt's
ranks are forked from it:

    from tests.support import forkserver

    with forkserver.Servers(NAME, ["tensorflow", "keras"], env,
                            prefixes=[h.nsenter() for h in hosts]):
        launch(..., forkserver.command(NAME, script, *args))

(`serve` and `run` below: a server per prefix, each in its host, and the
ranks' command.)

`run` (the command mpiexec starts, through kerasdist's rank wrapper) hands
the server its argv, environment, working directory, CPU affinity, ignored
signals and every open file descriptor (stdout, stderr, hydra's PMI_FD
...), over the host's abstract Unix socket NAME (one per network
namespace, so per test host). The server forks; the child takes all of
that in place of the server's, as if exec'd, and runs the script as
`__main__`, with the interpreter's own exit: an uncaught exception prints
its traceback and exits 1, atexit handlers run. `run` waits and ends the
way the child did: its exit code, or killed by the same signal (a rank
that SIGKILLs itself is seen by the launcher as a SIGKILLed rank). The
signals `run` gets (the wrapper forwards SIGINT, SIGTERM, SIGHUP, SIGUSR1,
SIGUSR2) go on to the child; when `run` dies (the wrapper SIGKILLs what
ignores SIGTERM, a frozen rank), the server SIGKILLs the child's process
group. The child dies with the server too (parent-death signal).

What differs from an exec'd rank: the modules imported by the server saw
its environment at import (start it with the ranks' environment: Keras'
backend, TF's variables), and the rank is not a descendant of mpiexec
(the launcher's sweep of a job's leftover processes does not see it; the
server's kill above stands in for it).

Standard library only; the server imports only the modules it is given.
"""

import json
import os
import select
import signal
import socket
import sys

# What a Trainer job's servers import (tests/workers/trainer_*_worker.py).
TRAINER_MODULES = ("tensorflow", "keras", "h5py", "kerasdist.trainer",
                   "kerasdist.tensorflow.collectives")

_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
_MAX_MESSAGE = 1 << 20
_PR_SET_PDEATHSIG = 1
_HIGH_FD = 1000


def _address(name):
    return "\0kerasdist-test-forkserver-" + name


def _open_fds():
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))


# ---- the rank's side -------------------------------------------------------


def run(name, argv):
    """Has the server run `argv` (a script and its arguments) as this
    process would; ends as it ended. Never returns."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(_address(name))
    except OSError as e:
        sys.stderr.write(f"forkserver: no server {name!r} on this host: "
                         f"{e}\n")
        os._exit(1)
    fds = [fd for fd in _open_fds() if fd != sock.fileno()
           and _is_open(fd)]
    ignored = [s for s in range(1, signal.NSIG)
               if _ignored(s)]
    header = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
              "affinity": sorted(os.sched_getaffinity(0)),
              "ignored": ignored, "fds": fds}
    socket.send_fds(sock, [json.dumps(header).encode()], fds)
    for fd in fds:
        if fd > 2:
            os.close(fd)  # the child has them now

    def forward(signum, frame):
        try:
            sock.send(f"signal {signum}".encode())
        except OSError:
            pass

    for sig in _FORWARDED:
        signum = getattr(signal, sig)
        if signum not in ignored:
            signal.signal(signum, forward)
    while True:
        try:
            message = sock.recv(256).decode()
        except InterruptedError:
            continue
        if not message:
            sys.stderr.write(f"forkserver: server {name!r} went away\n")
            os._exit(1)
        kind, value = message.split()
        if kind == "exited":
            os._exit(int(value))
        if kind == "killed":
            signum = int(value)
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)  # a signal that does not end a process


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False  # the listing's own descriptor, closed since


def _ignored(signum):
    try:
        return signal.getsignal(signum) == signal.SIG_IGN
    except (ValueError, OSError):
        return False


# ---- the test's side -------------------------------------------------------


def command(name, script, *args):
    """The ranks' command: run `script` with `args`, forked by server
    `name` on the rank's host."""
    return [sys.executable, os.path.abspath(__file__), "run", name, script,
            *args]


class Servers:
    """One server `name` per argv prefix (a host's nsenter; () for this
    machine), importing `modules`, started with the ranks' environment
    `env` (on which those imports may depend; GLIBC_TUNABLES gets the huge
    pages the launcher's rank wrapper gives a rank, see kerasdist/run/
    _rank.py). A context manager: it waits until every server is ready,
    and at exit closes their stdin (each server SIGKILLs the children it
    still has, and ends) and waits for them."""

    def __init__(self, name, modules, env, prefixes=((),), timeout=120):
        import subprocess
        import time

        from kerasdist.run import _rank
        env = dict(env)
        env[_rank.TUNABLES_ENV] = _rank.with_huge_pages(
            env.get(_rank.TUNABLES_ENV))
        argv = [sys.executable, os.path.abspath(__file__), "serve", name,
                *modules]
        self.procs = []
        try:
            for prefix in prefixes:
                self.procs.append(subprocess.Popen(
                    [*prefix, *argv], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, env=env))
            deadline = time.monotonic() + timeout
            for proc in self.procs:
                ready, _, _ = select.select(
                    [proc.stdout], [], [],
                    max(0.0, deadline - time.monotonic()))
                line = proc.stdout.readline() if ready else b""
                if line != b"ready\n":
                    raise RuntimeError(
                        f"forkserver {name!r} did not start: "
                        f"{proc.args} said {line!r}")
        except BaseException:
            self.close()
            raise

    def close(self):
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---- the server ------------------------------------------------------------


class _Child:
    """What the forked child does instead of the server's loop."""

    def __init__(self, header, fds):
        self.header, self.fds = header, fds

    def become(self):
        """Takes the rank's descriptors, environment and so on; returns the
        script's path and sets sys.argv to the rank's."""
        h = self.header
        high = [os.dup2(fd, _HIGH_FD + i) for i, fd in enumerate(self.fds)]
        for fd in self.fds:
            os.close(fd)
        for target, fd in zip(h["fds"], high):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(h["env"])
        # The rank wrapper's watchdog pipe (kerasdist/run/_rank.py) is for
        # the wrapper's own child, named by its parent's pid: `run` was that
        # child, and this process stands in for it, a child of the server.
        watchdog = os.environ.get("KERASDIST_WATCHDOG", "")
        if ":" in watchdog:
            os.environ["KERASDIST_WATCHDOG"] = (
                f"{watchdog.split(':', 1)[0]}:{os.getppid()}")
        os.chdir(h["cwd"])
        os.sched_setaffinity(0, h["affinity"])
        # The rank's ignored signals (SIGUSR1 in an elastic job); the rest
        # as Python sets them at start, as in the server.
        for signum in range(1, signal.NSIG):
            try:
                if signum in h["ignored"]:
                    signal.signal(signum, signal.SIG_IGN)
                elif signal.getsignal(signum) == signal.SIG_IGN:
                    signal.signal(signum, signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        script = os.path.abspath(h["argv"][0])
        sys.argv = list(h["argv"])
        sys.path[0] = os.path.dirname(script)
        return script


def serve(name, modules):
    """Imports `modules`, prints "ready", and forks a child for every `run`
    until its stdin closes. Returns a _Child in a forked child (the caller
    runs the rank), None when the server is done."""
    import importlib
    for module in modules:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(_address(name))
    listener.listen(16)
    print("ready", flush=True)
    children = {}  # pid -> the connection of its `run`
    conns = {}  # connection -> pid
    while True:
        ready, _, _ = select.select([sys.stdin, listener, *conns], [], [],
                                    0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            for pid in children:
                _kill_group(pid)
            return None
        if listener in ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 64)
            if not data:  # `run` died before it asked
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            header = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)
                import ctypes
                ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                listener.close()
                conn.close()
                for c in conns:
                    c.close()
                return _Child(header, fds)
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child did it first, or is gone already
            for fd in fds:
                os.close(fd)
            children[pid], conns[conn] = conn, pid
        for conn in [c for c in ready if c in conns]:
            pid = conns[conn]
            try:
                message = conn.recv(256).decode()
            except OSError:
                message = ""
            if message.startswith("signal ") and pid in children:
                try:
                    os.kill(pid, int(message.split()[1]))
                except ProcessLookupError:
                    pass
            elif not message:  # `run` died: so does its child
                del conns[conn]
                conn.close()
                if pid in children:
                    _kill_group(pid)
                    children[pid] = None
        _reap(children, conns)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _reap(children, conns):
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        if os.WIFSIGNALED(status):
            message = f"killed {os.WTERMSIG(status)}"
        else:
            message = f"exited {os.waitstatus_to_exitcode(status)}"
        try:
            conn.send(message.encode())
        except OSError:
            pass
        conns.pop(conn, None)
        conn.close()


def main():
    command, name, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if command == "run":
        run(name, rest)
    if command != "serve":
        sys.exit(f"forkserver: unknown command {command!r}")
    child = serve(name, rest)
    if child is None:
        return
    script = child.become()
    del child
    import runpy
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
