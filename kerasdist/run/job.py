"""Runs one attempt of a job under mpiexec and decides how it ended.

The launcher starts mpiexec in its own session, relays mpiexec's stdout and
stderr line by line (picking out the exit markers of the per-rank wrapper,
see _rank.py) and stops the whole job when a rank fails, when the timeout
passes, or when the launcher gets SIGINT/SIGTERM.

Stopping a job: send the ending signal to mpiexec, which forwards it to every
rank's wrapper, which forwards it to the command and SIGKILLs the command
after _rank.KILL_GRACE_S. If mpiexec is still alive after _FORCE_AFTER_S it
gets two SIGINTs (hydra's "Ctrl-C again to force abort"), and after
_KILL_AFTER_S mpiexec and every process of the job get SIGKILL. Once mpiexec
has exited, whatever of the job outlived it is killed too: the processes of
mpiexec's session, and those the job had when it was being stopped (a rank's
child may have left the session or its parent's tree).
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

from kerasdist.run import _rank

_POLL_S = 0.1
_FORCE_AFTER_S = 12.0
_KILL_AFTER_S = 20.0


def describe_status(status):
    """Describes a Popen-style return code: "code 3", "signal 9 (SIGKILL)"."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
        return f"signal {-status} ({name})"
    return f"code {status}"


def status_exit_code(status):
    """The shell convention: a code as is, a signal N as 128+N."""
    return 128 - status if status < 0 else status


class RankFailure:
    """A rank whose command exited nonzero or was killed by a signal."""

    def __init__(self, rank, host, status):
        self.rank = rank
        self.host = host
        self.status = status

    @property
    def exit_code(self):
        return status_exit_code(self.status)

    def describe(self, with_host=True):
        host = f" (host {self.host})" if with_host else ""
        return f"rank {self.rank}{host} exited with {describe_status(self.status)}"


class Outcome:
    """How an attempt ended.

    Attributes:
        exit_code: the code the launcher should exit with.
        failure: the first RankFailure seen, or None.
        timed_out: whether the launcher's --timeout stopped the job.
        signum: the signal that interrupted the launcher, or None.
        reason: a short description for logs ("rank 1 exited with code 3").
        final: a relaunch would fail the same way (e.g. a host cannot
            reach this machine), so --max-restarts does not apply.
    """

    def __init__(self, exit_code, failure=None, timed_out=False, signum=None,
                 reason="", final=False):
        self.exit_code = exit_code
        self.failure = failure
        self.timed_out = timed_out
        self.signum = signum
        self.reason = reason
        self.final = final

    @property
    def retryable(self):
        return (self.exit_code != 0 and not self.timed_out and not self.signum
                and not self.final)


class Interrupts:
    """Records SIGINT/SIGTERM sent to the launcher while it runs a job."""

    def __init__(self):
        self.signum = None
        self.count = 0
        self._saved = {}

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
        self.count += 1

    def __enter__(self):
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)


class Log:
    """Writes whole lines to the launcher's stdout/stderr, one at a time.

    One lock for both streams: when they are the same pipe (`2>&1`), a line
    longer than PIPE_BUF would otherwise be split by a line of the other.
    """

    def __init__(self, out=None, err=None):
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self.lock = threading.Lock()

    def raw(self, data, stream=None):
        stream = self.err if stream is None else stream
        with self.lock:
            try:
                stream.write(data)
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass

    def line(self, text):
        self.raw(f"kerasdist: {text}\n".encode())


# hydra's proxy on a host that cannot connect back to mpiexec, e.g.
# "[proxy:1@node2] main (...): unable to connect to server head at port 36959
# (check for firewalls!)". Launched by ssh, mpiexec then ends by itself;
# launched by srun it waits forever, so the launcher stops it.
_UNREACHABLE_RE = re.compile(
    rb"^\[proxy:\d+@(\S+)\] .*unable to connect to server (\S+) at port "
    rb"(\d+)")


class Unreachable:
    """A host whose hydra proxy could not connect back to mpiexec."""

    def __init__(self, host, server, port):
        self.host = host
        self.server = server
        self.port = port

    def describe(self):
        return (f"host {self.host} could not connect back to this machine "
                f"at {self.server}:{self.port}; give the interface the hosts "
                "reach this machine on with --network-interface (hydra's "
                "-iface)")


class _Relay(threading.Thread):
    """Copies an output of mpiexec to the log, taking out the exit markers."""

    def __init__(self, pipe, log, stream):
        super().__init__(daemon=True)
        self.pipe = pipe
        self.log = log
        self.stream = stream
        self.failure = None
        self.failed = threading.Event()
        self.unreachable = None

    def run(self):
        for line in iter(self.pipe.readline, b""):
            start = line.find(_rank.MARKER)
            if start < 0:
                self._note_unreachable(line)
                self.log.raw(line, self.stream)
                continue
            if start > 0:  # an unprefixed partial line ran into the marker
                self.log.raw(line[:start] + b"\n", self.stream)
            parsed = _rank.parse_marker(line[start:])
            if parsed and parsed[2] != 0 and self.failure is None:
                self.failure = RankFailure(*parsed)
                self.failed.set()
        self.pipe.close()

    def _note_unreachable(self, line):
        m = _UNREACHABLE_RE.match(line)
        if m and self.unreachable is None:
            self.unreachable = Unreachable(
                *(g.decode(errors="replace") for g in m.groups()))


def _signal_proc(proc, signum):
    try:
        proc.send_signal(signum)
    except (ProcessLookupError, OSError):
        pass


def _has_exited(proc):
    """Whether mpiexec has exited, without reaping it.

    Until proc.wait() reaps it, mpiexec's pid (also its session's id) cannot
    be given to another process, so the job's processes can still be found
    by it.
    """
    try:
        info = os.waitid(os.P_PID, proc.pid,
                         os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except ChildProcessError:  # reaped already
        return True
    return info is not None


def _job_snapshot(proc):
    """{pid: start time} of mpiexec and every process of the job now."""
    roots = (proc.pid,) if proc.returncode is None else ()
    procs = _rank.job_processes(roots=roots, sessions=(proc.pid,))
    return {pid: st[3] for pid, st in procs.items()}


def _kill_job(proc, known):
    # Walk from mpiexec's pid only while no wait() has reaped it (poll(),
    # e.g. inside send_signal, may have): a reaped pid may be another
    # process's by now. Its session id stays taken while the session lasts.
    roots = (proc.pid,) if proc.returncode is None else ()
    return _rank.kill_job(roots=roots, sessions=(proc.pid,), known=known)


def run_attempt(argv, env, interrupts, deadline=None, timeout=None, log=None):
    """Runs mpiexec once and returns its Outcome.

    Args:
        argv: the mpiexec command line.
        env: the environment for mpiexec.
        interrupts: an active Interrupts; a signal it records stops the job.
        deadline: time.monotonic() value after which the job is stopped
            (exit code 124), or None.
        timeout: the --timeout value, for the message only.
        log: a Log.

    Returns:
        An Outcome.
    """
    log = log or Log()
    try:
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        log.line(f"cannot run {argv[0]!r}: {e.strerror or e}")
        return Outcome(127, reason="mpiexec could not be started")
    relay = _Relay(proc.stderr, log, log.err)
    relay.start()
    out_relay = _Relay(proc.stdout, log, log.out)
    out_relay.start()

    stop_reason = None  # "failure", "unreachable", "timeout" or "signal"
    stopping_since = None
    forced = killed = False
    known = {}  # the job's processes when it was being stopped
    while not _has_exited(proc):
        time.sleep(_POLL_S)
        now = time.monotonic()
        if stopping_since is None:
            if interrupts.signum is not None:
                stop_reason, signum = "signal", interrupts.signum
                name = signal.Signals(signum).name
                log.line(f"received {name}; stopping all ranks.")
            elif relay.failed.is_set():
                stop_reason, signum = "failure", signal.SIGTERM
                log.line(f"{relay.failure.describe()}; "
                         "stopping the other ranks.")
            elif (relay.unreachable or out_relay.unreachable) is not None:
                stop_reason, signum = "unreachable", signal.SIGTERM
            elif deadline is not None and now >= deadline:
                stop_reason, signum = "timeout", signal.SIGTERM
                log.line(f"timeout: the job ran longer than {timeout:g} s; "
                         "stopping all ranks.")
            if stop_reason is not None:
                known = _job_snapshot(proc)
                _signal_proc(proc, signum)
                stopping_since = now
        else:
            waited = now - stopping_since
            if not forced and (waited > _FORCE_AFTER_S or interrupts.count > 1):
                forced = True
                _signal_proc(proc, signal.SIGINT)
                time.sleep(0.2)
                _signal_proc(proc, signal.SIGINT)
            if waited > _KILL_AFTER_S and not killed:
                killed = True
                _kill_job(proc, known)
    if stop_reason is not None:
        left = _kill_job(proc, known)
        if left:
            log.line(f"killed {len(left)} process(es) of the job that "
                     "outlived mpiexec.")
    rc = proc.wait()
    relay.join(timeout=5.0)
    out_relay.join(timeout=5.0)

    failure = relay.failure
    unreachable = relay.unreachable or out_relay.unreachable
    if unreachable is not None and stop_reason in (None, "unreachable"):
        # Said once, after hydra's own lines; a relaunch would fail the same.
        log.line(f"{unreachable.describe()}.")
        return Outcome(1, final=True, reason=unreachable.describe())
    if stop_reason == "timeout":
        return Outcome(124, failure, timed_out=True,
                       reason=f"the job timed out after {timeout:g} s")
    if stop_reason == "signal":
        signum = interrupts.signum
        return Outcome(128 + signum, failure, signum=signum,
                       reason=f"the launcher received "
                              f"{signal.Signals(signum).name}")
    if failure is not None:
        if stop_reason is None:  # mpiexec ended before the loop saw it
            log.line(f"{failure.describe()}.")
        return Outcome(failure.exit_code, failure,
                       reason=failure.describe(with_host=False))
    if rc != 0:
        log.line(f"mpiexec exited with {describe_status(rc)}.")
        return Outcome(status_exit_code(rc),
                       reason=f"mpiexec exited with {describe_status(rc)}")
    return Outcome(0)
