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

An elastic job (kerasdist/run/resize.py) may instead be asked to stop for a
resize: once asked, ranks that exit with the resize code are not a failure;
when every rank has, the attempt's Outcome is `resized`.

Over 500 lines: one attempt's life (relaying mpiexec's output, reading the
ranks' exit markers, stopping the job's whole tree, and the outcome), whose
parts share the attempt's state and read in the order they happen.
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
# How long after a rank's failure the launcher waits for more before it
# says what happened: at least _SETTLE_S after the first, and until none has
# come for _SETTLE_QUIET_S, but never more than _SETTLE_MAX_S. A host's ranks
# killed at once reach the launcher through the host's proxy one by one, and
# on a loaded machine more than half a second apart.
_SETTLE_S = 1.0
_SETTLE_QUIET_S = 0.5
_SETTLE_MAX_S = 3.0
# How long, after the first rank exited for a resize, the others have to
# follow before the launcher stops them as failed.
_RESIZE_EXIT_WAIT_S = 60.0


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
        return (f"rank {self.rank}{host} exited with "
                f"{describe_status(self.status)}")


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
        resized: every rank stopped at a checkpoint for the resize the
            launcher asked for; the job goes on at the new size (this is
            no failure and no restart).
        error: what the ranks that failed on their own said last, as a
            comparable value (their ranks, exit codes and last stderr
            lines), or None when one of them was killed by a signal or
            said nothing: a relaunch that fails with the same error met a
            deterministic one (a missing script, a TypeError).
        progressed: a rank saved progress the next attempt resumes from
            (kerasdist/_core/resize.py's report_progress).
    """

    def __init__(self, exit_code, failure=None, timed_out=False, signum=None,
                 reason="", final=False, resized=False, error=None):
        self.exit_code = exit_code
        self.failure = failure
        self.timed_out = timed_out
        self.signum = signum
        self.reason = reason
        self.final = final
        self.resized = resized
        self.error = error
        self.progressed = False

    @property
    def retryable(self):
        return (self.exit_code != 0 and not self.timed_out and not self.signum
                and not self.final and not self.resized)


class Interrupts:
    """Records SIGINT/SIGTERM/SIGHUP sent to the launcher while it runs a
    job. SIGHUP (the terminal or the session went away) stops the job as
    SIGTERM does, as torchrun's does."""

    def __init__(self):
        self.signum = None
        self.count = 0
        self._saved = {}

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
        self.count += 1

    def __enter__(self):
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)


# A rank's prefix, `[3]<stdout>:`, at the start of a piece of output.
_TAG_RE = re.compile(rb"^\[[^\]]*\]<std(?:out|err)>:")


class Log:
    """Writes whole lines to the launcher's stdout/stderr, one at a time.

    One lock for both streams: when they are the same pipe (`2>&1`), a line
    longer than PIPE_BUF would otherwise be split by a line of the other.

    A piece ending in "\r" redraws its line in place (a rank's progress
    bar, see _rank.Units), and a bare "\n" ends such a line. While one is
    open, a redraw of the same rank and stream replaces it; any other
    output first ends it with "\n", so the bar stays whole on its line and
    goes on below.
    """

    def __init__(self, out=None, err=None):
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self.lock = threading.Lock()
        self._open = None  # (stream, rank prefix) of a line being redrawn

    def raw(self, data, stream=None):
        stream = self.err if stream is None else stream
        with self.lock:
            try:
                if self._open is not None and data != b"\n":
                    tag = _TAG_RE.match(data)
                    key = (stream, tag.group(0) if tag else b"")
                    if key != self._open or not data.endswith(b"\r"):
                        self._open[0].write(b"\n")
                        self._open[0].flush()
                        self._open = None
                if data == b"\n" and self._open is not None:
                    stream = self._open[0]
                stream.write(data)
                stream.flush()
                if data.endswith(b"\r"):
                    tag = _TAG_RE.match(data)
                    self._open = (stream, tag.group(0) if tag else b"")
                else:
                    self._open = None
            except (BrokenPipeError, ValueError):
                pass

    def end_line(self):
        """Ends a line left open by a redraw (the job's output is over)."""
        with self.lock:
            if self._open is not None:
                try:
                    self._open[0].write(b"\n")
                    self._open[0].flush()
                except (BrokenPipeError, ValueError):
                    pass
                self._open = None

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


# The line a rank prints when its heartbeat lost a peer (ops/core/control/
# liveness.cc), e.g. "kerasdist: rank 0: lost host node2 (ranks 2, 3): no
# heartbeat for 30 s (...); ending this rank."
_LOST_RE = re.compile(rb"kerasdist: rank (\d+): lost (.*); ending this rank\.")

# A rank's stderr line (its own words, not kerasdist's, tell an error).
_STDERR_RE = re.compile(rb"^\[(\d+)\]<stderr>:(.*?)\r?\n?$")

# The runtime's line (rank 0's) when every rank waits for collectives no
# other rank submitted. The launcher holds it back and says it as its last
# line, once, after the ranks' output.
_DEADLOCK_RE = re.compile(
    rb"^(?:\[\d+\]<stderr>:)?kerasdist: (deadlock: every rank is waiting"
    rb".*?)\r?\n?$")

# hydra's banner when a rank ends badly. The launcher says what happened in
# a line of its own, so the banner is left out (shown with --verbose).
_BANNER_RE = re.compile(
    rb"^(=+|=   (BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES|PID \d+ "
    rb"RUNNING AT .*|EXIT CODE: .*|CLEANING UP REMAINING PROCESSES|YOU CAN "
    rb"IGNORE THE BELOW CLEANUP MESSAGES)|YOUR APPLICATION TERMINATED WITH "
    rb"THE EXIT STRING: .*|This typically refers to a problem with your "
    rb"application\.|Please see the FAQ page for debugging suggestions)\s*$")


# hydra's own error trace, e.g. "[mpiexec@node1] HYDU_sock_write (...): write
# error", printed when it cannot signal a proxy that is gone. Once the
# launcher is stopping the job it has said why, so these are left out.
_HYDRA_TRACE_RE = re.compile(rb"^\[(mpiexec|proxy:[^\]@]*)@[^\]]*\] ")


class Findings:
    """What the relays picked out of the job's output, shared by both."""

    def __init__(self):
        self.lock = threading.Lock()
        self.failures = []  # RankFailure, in the order seen
        self.exited = set()  # every rank whose wrapper reported its exit
        self.lost = {}      # rank -> what its heartbeat lost (text)
        self.unreachable = None
        self.failed = threading.Event()
        self.stopping = threading.Event()  # the launcher is stopping the job
        self.resizable = False  # a rank said it checks for resize requests
        self.grows_in_place = False  # ... and that it grows in place
        self.shrinks_in_place = False  # ... and that it shrinks in place
        self.progressed = False  # a rank saved progress (a checkpoint)
        self.deadlock = None  # the runtime's deadlock message (text)
        self.last_error = {}  # rank -> its last stderr line (text)

    def add_exit(self, rank):
        with self.lock:
            self.exited.add(rank)

    def add_failure(self, failure):
        with self.lock:
            self.exited.add(failure.rank)
            self.failures.append(failure)
        self.failed.set()

    def unreported(self, ranks, most=8):
        """(the first `most` ranks of 0..ranks-1 whose wrapper never
        reported an exit, how many there are): nothing of the job's size is
        built here, in the thread that handles the launcher's signals."""
        with self.lock:
            reported = {r for r in self.exited
                        if r.isdigit() and len(r) < 10 and int(r) < ranks}
            first = []
            for r in range(ranks):
                if len(first) == most:
                    break
                if str(r) not in reported:
                    first.append(r)
        return first, ranks - len(reported)

    def add_lost(self, rank, text):
        with self.lock:
            self.lost.setdefault(rank, text)

    def describe(self):
        """One clause for the launcher's line: who failed and how.

        The ranks that failed on their own come first (grouped by host and
        status); ranks that only ended because their heartbeat lost a peer
        are not named as failing: what they lost is said instead.
        """
        failures, lost, culprits = self._split()
        if culprits:
            return "; ".join(_group_failures(culprits))
        if lost:
            return "lost " + lost[min(lost)]
        return failures[0].describe() if failures else ""

    def error(self):
        """Outcome.error: ((rank, status, last stderr line), ...) of the
        ranks that failed on their own, or None."""
        failures, _, culprits = self._split()
        if not culprits:
            return None
        with self.lock:
            said = [(f.rank, f.status, self.last_error.get(f.rank))
                    for f in culprits]
        # A signal (killed: out of memory, a host's trouble) says nothing
        # of the next attempt, whatever was printed before it.
        if any(line is None or status < 0 for _, status, line in said):
            return None
        return tuple(sorted(said))

    def first_failure(self):
        failures, _, culprits = self._split()
        return (culprits or failures or [None])[0]

    def only_resize_exits(self):
        """Whether every rank that ended badly so far exited with the
        resize code (and some did)."""
        with self.lock:
            failures = list(self.failures)
        return bool(failures) and all(
            f.status == _rank.RESIZE_EXIT_CODE for f in failures)

    def ranks_failed(self):
        with self.lock:
            return {f.rank for f in self.failures}

    def _split(self):
        """(failures, lost, the failures of ranks that lost nothing)."""
        with self.lock:
            failures, lost = list(self.failures), dict(self.lost)
        return failures, lost, [f for f in failures if f.rank not in lost]


def _group_failures(failures):
    groups = {}
    for f in failures:
        groups.setdefault((f.host, f.status), []).append(f.rank)
    out = []
    for (host, status), ranks in groups.items():
        out.append(f"{_ranks_clause(ranks)} (host {host}) exited with "
                   f"{describe_status(status)}")
    return out


def _unreported_clause(missing, count):
    """"ranks 0-7 and 3 more": Findings.unreported's first `missing` of
    `count`."""
    return _ranks_clause(missing) + (
        f" and {count - len(missing)} more" if count > len(missing) else "")


def _ranks_clause(ranks):
    """"rank 3" or "ranks 0, 2", in rank order."""
    ranks = sorted((str(r) for r in ranks),
                   key=lambda r: int(r) if r.isdigit() else 0)
    return (f"rank {ranks[0]}" if len(ranks) == 1 else
            "ranks " + ", ".join(ranks))


_PIECE_END_RE = re.compile(rb"\r\n|\n|\r")


class _Relay(threading.Thread):
    """Copies an output of mpiexec to the log, taking out the exit markers."""

    def __init__(self, pipe, log, stream, findings, banner=False):
        super().__init__(daemon=True)
        self.pipe = pipe
        self.log = log
        self.stream = stream
        self.findings = findings
        self.banner = banner
        self._held = None  # a blank line that may open hydra's banner

    def _pieces(self):
        """mpiexec's output cut after each "\n" and each "\r": the wrappers
        write every line and every redraw of a line in one piece."""
        buf = b""
        for data in _rank.chunks(self.pipe.fileno()):
            buf += data
            start = 0
            for m in _PIECE_END_RE.finditer(buf):
                yield buf[start:m.end()]
                start = m.end()
            buf = buf[start:]
        if buf:
            yield buf + b"\n"

    def run(self):
        token = os.environ.get(_rank.RANK_MARKER_TOKEN_ENV)
        for line in self._pieces():
            # A rank's own markers count with the job's token only; without
            # it they are the program's output.
            if _rank.is_rank_marker(line, _rank.RESIZABLE_MARKER, token):
                self.findings.resizable = True
                if _rank.GROWS_IN_PLACE_WORD + b" " in line:
                    self.findings.grows_in_place = True
                if _rank.SHRINKS_IN_PLACE_WORD + b" " in line:
                    self.findings.shrinks_in_place = True
                continue
            if _rank.is_rank_marker(line, _rank.PROGRESS_MARKER, token):
                self.findings.progressed = True
                continue
            start = line.find(_rank.MARKER)
            if start < 0:
                if not self._note(line):
                    self._write(line)
                continue
            parsed = _rank.parse_marker(
                line[start:], os.environ.get(_rank.MARKER_TOKEN_ENV))
            if parsed is None:  # the rank's own output, not the wrapper's
                self._note(line)
                self._write(line)
                continue
            if start > 0:  # an unprefixed partial line ran into the marker
                self._write(line[:start] + b"\n")
            if parsed[2] != 0:
                self.findings.add_failure(RankFailure(*parsed))
            else:
                self.findings.add_exit(parsed[0])
        if self._held is not None:
            self.log.raw(self._held, self.stream)
        self.pipe.close()

    def _write(self, line):
        if (not self.banner and self.findings.stopping.is_set()
                and _HYDRA_TRACE_RE.match(line)):
            return
        if not self.banner:
            if line.strip() == b"" and self._held is None:
                self._held = line
                return
            if _BANNER_RE.match(line):
                self._held = None
                return
        if self._held is not None:
            self.log.raw(self._held, self.stream)
            self._held = None
        self.log.raw(line, self.stream)

    def _note(self, line):
        """Notes what `line` tells; True when the line is held back."""
        m = _STDERR_RE.match(line)
        if m and m.group(2).strip() and \
                not m.group(2).startswith(b"kerasdist: "):
            with self.findings.lock:
                self.findings.last_error[m.group(1).decode()] = \
                    m.group(2).strip().decode(errors="replace")
        m = _DEADLOCK_RE.match(line)
        if m:
            with self.findings.lock:
                if self.findings.deadlock is None:
                    self.findings.deadlock = m.group(1).decode(
                        errors="replace")
            return True
        m = _LOST_RE.search(line)
        if m:
            self.findings.add_lost(m.group(1).decode(),
                                   m.group(2).decode(errors="replace"))
            return
        m = _UNREACHABLE_RE.match(line)
        if m and self.findings.unreachable is None:
            self.findings.unreachable = Unreachable(
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


def run_attempt(argv, env, interrupts, deadline=None, timeout=None, log=None,
                banner=False, manager="mpiexec", watcher=None, ranks=None,
                keep_survivors=False):
    """Runs mpiexec once and returns its Outcome.

    Args:
        argv: the mpiexec command line.
        env: the environment for mpiexec.
        interrupts: an active Interrupts; a signal it records stops the job.
        deadline: time.monotonic() value after which the job is stopped
            (exit code 124), or None.
        timeout: the --timeout value, for the message only.
        log: a Log.
        banner: pass hydra's "BAD TERMINATION" banner through (--verbose).
        manager: what `argv` starts, for the messages (node mode runs its
            own process manager in mpiexec's place, see node.py).
        watcher: a resize.Watcher of an elastic job, or None; it is
            started and stopped here.
        ranks: how many ranks (0..ranks-1, each under _rank.py) the job
            starts: if mpiexec exits 0 but one of them never reported its
            exit, the attempt failed. None: not checked.
        keep_survivors: a rank that fails stops no other (recovery in
            place, `--recover-in-place`): the survivors re-form without it,
            and the attempt succeeds when one of them finishes with 0 and
            mpirun too.

    Returns:
        An Outcome.
    """
    log = log or Log()
    # mpiexec ends (and ends its ranks) when the launcher does, even when
    # the launcher is killed with SIGKILL.
    _rank.prepare_parent_death()
    launcher = os.getpid()
    try:
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _rank.die_with_parent(signal.SIGTERM,
                                                     launcher),
        )
    except OSError as e:
        log.line(f"cannot run {argv[0]!r}: {e.strerror or e}")
        return Outcome(127, reason=f"{manager} could not be started")
    findings = Findings()
    relays = [_Relay(proc.stderr, log, log.err, findings, banner),
              _Relay(proc.stdout, log, log.out, findings, banner)]
    for relay in relays:
        relay.start()
    stopper = _Stopper(proc, findings, interrupts, deadline, timeout, log,
                       manager, watcher)
    stopper.keep_survivors = keep_survivors
    if watcher is not None:
        watcher.start()
    try:
        while not _has_exited(proc):
            time.sleep(_POLL_S)
            now = time.monotonic()
            if watcher is not None and stopper.since is None:
                watcher.step(now, findings.resizable, proc,
                             findings.grows_in_place,
                             findings.shrinks_in_place)
            stopper.step(now)
    finally:
        if watcher is not None:
            watcher.stop()
    stopper.finish()
    rc = proc.wait()
    for relay in relays:
        relay.join(timeout=5.0)
    log.end_line()
    # The ranks stopped for the resize asked, or declined one asked in
    # place (every rank of the size before it stopped for a relaunch).
    resize = None if watcher is None else (watcher.requested or
                                           watcher.in_place)
    if resize is not None and stopper.reason is None and \
            findings.only_resize_exits() and \
            len(findings.ranks_failed()) == resize.old_np:
        return Outcome(_rank.RESIZE_EXIT_CODE, resized=True,
                       reason="the ranks stopped for a resize")
    outcome = _survivors_outcome(rc, stopper.reason, findings, log,
                                 ranks) if keep_survivors else None
    outcome = outcome or _outcome(rc, stopper.reason, findings, interrupts,
                                  timeout, log, manager, ranks)
    outcome.progressed = findings.progressed
    if findings.deadlock is not None:
        log.line(findings.deadlock)
    return outcome


class _Stopper:
    """Decides when to stop a running job, and stops it step by step."""

    def __init__(self, proc, findings, interrupts, deadline, timeout, log,
                 manager="mpiexec", watcher=None):
        self.proc = proc
        self.watcher = watcher
        self.resize_exit_at = None
        self.manager = manager
        self.findings = findings
        self.interrupts = interrupts
        self.deadline = deadline
        self.timeout = timeout
        self.log = log
        self.reason = None  # "failure", "unreachable", "timeout" or "signal"
        self.since = None
        self.failed_at = None
        self.last_failure_at = None
        self.failures_seen = 0
        self.forced = self.killed = False
        self.known = {}  # the job's processes when it was being stopped
        self.keep_survivors = False  # --recover-in-place
        self.survivors_told = 0  # failures said to leave the others be

    def step(self, now):
        if self.since is None:
            signum = self._why(now)
            if self.reason is not None:
                self.findings.stopping.set()
                self.known = _job_snapshot(self.proc)
                _signal_proc(self.proc, signum)
                self.since = now
            return
        waited = now - self.since
        if not self.forced and (waited > _FORCE_AFTER_S
                                or self.interrupts.count > 1):
            self.forced = True
            _signal_proc(self.proc, signal.SIGINT)
            time.sleep(0.2)
            _signal_proc(self.proc, signal.SIGINT)
        if waited > _KILL_AFTER_S and not self.killed:
            self.killed = True
            _kill_job(self.proc, self.known)

    def _why(self, now):
        if self.interrupts.signum is not None:
            self.reason = "signal"
            name = signal.Signals(self.interrupts.signum).name
            self.log.line(f"received {name}; stopping all ranks.")
            # mpiexec's proxies end their ranks on SIGTERM, not SIGHUP.
            return (signal.SIGTERM if self.interrupts.signum == signal.SIGHUP
                    else self.interrupts.signum)
        # Ranks leaving for the resize they were asked for have not failed.
        if self.findings.failed.is_set() and not self._resizing(now) and \
                not self._survivors_go_on():
            # Failures come in bursts (a host's ranks, then the ranks whose
            # heartbeat lost them): a moment more, and one line says it.
            if self.failed_at is None:
                self.failed_at = now
            seen = len(self.findings.ranks_failed())
            if seen != self.failures_seen:
                self.failures_seen, self.last_failure_at = seen, now
            settled = (now - self.failed_at >= _SETTLE_S
                       and now - self.last_failure_at >= _SETTLE_QUIET_S)
            if settled or now - self.failed_at >= _SETTLE_MAX_S:
                self.reason = "failure"
                self.log.line(f"{self.findings.describe()}; "
                              "stopping the other ranks.")
        elif self.findings.unreachable is not None:
            self.reason = "unreachable"
        elif self.deadline is not None and now >= self.deadline:
            self.reason = "timeout"
            self.log.line(f"timeout: the job ran longer than "
                          f"{self.timeout:g} s; stopping all ranks.")
        return signal.SIGTERM

    def _survivors_go_on(self):
        """--recover-in-place: a rank lost (its process killed by a signal)
        stops no other rank; each new one is said in one line. A rank that
        exits with a nonzero code (an error, or a failed recovery) stops
        the job as without the flag."""
        if not self.keep_survivors:
            return False
        seen = len(self.findings.ranks_failed())
        if seen != self.survivors_told:
            # What to end once mpirun has, whatever comes next: it may
            # leave a frozen rank behind.
            self.known.update(_job_snapshot(self.proc))
        with self.findings.lock:
            if any(f.status >= 0 for f in self.findings.failures):
                return False
        if seen != self.survivors_told:
            self.survivors_told = seen
            self.log.line(f"{self.findings.describe()}; the other ranks go "
                          f"on without it (recovery in place).")
        return True

    def _resizing(self, now):
        """Whether only ranks asked to stop for a resize have exited, with
        the resize code, and the rest still has time to follow."""
        if self.watcher is None or (self.watcher.requested or
                                    self.watcher.in_place) is None or \
                not self.findings.only_resize_exits():
            return False
        self.resize_exit_at = self.resize_exit_at or now
        return now - self.resize_exit_at < _RESIZE_EXIT_WAIT_S

    def finish(self):
        if self.reason is None and not (self.keep_survivors and self.known):
            return
        left = _kill_job(self.proc, self.known)
        if left:
            self.log.line(f"killed {len(left)} process(es) of the job that "
                          f"outlived {self.manager}.")


def _survivors_outcome(rc, stop_reason, findings, log, ranks=None):
    """--recover-in-place: the attempt succeeded (Outcome(0)) when ranks
    were lost but mpirun and a survivor ended with 0; None otherwise (the
    usual outcome then applies). A rank that never reported its exit
    (of `ranks`, where given) was lost with its host or its link."""
    failure = findings.first_failure()
    if stop_reason is not None or rc != 0:
        return None
    if failure is None:
        missing, count = ([], 0) if ranks is None else \
            findings.unreported(ranks)
        with findings.lock:
            finished = sorted(findings.exited)
        if not missing or not finished:
            return None
        who = _unreported_clause(missing, count)
        log.line(f"{who} never reported an exit (lost with its host or its "
                 f"link); {_ranks_clause(finished)} finished without it "
                 f"(recovery in place).")
        return Outcome(0)
    with findings.lock:
        failed = {f.rank for f in findings.failures}
        finished = sorted(findings.exited - failed)
    if not finished:
        return None
    log.line(f"{findings.describe()}; {_ranks_clause(finished)} finished "
             f"without it (recovery in place).")
    return Outcome(0)


def _outcome(rc, stop_reason, findings, interrupts, timeout, log,
             manager="mpiexec", ranks=None):
    failure = findings.first_failure()
    unreachable = findings.unreachable
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
            log.line(f"{findings.describe()}; the job has ended.")
        return Outcome(failure.exit_code, failure,
                       reason=findings.describe(), error=findings.error())
    if rc != 0:
        log.line(f"{manager} exited with {describe_status(rc)}.")
        return Outcome(status_exit_code(rc),
                       reason=f"{manager} exited with {describe_status(rc)}")
    missing, count = ([], 0) if ranks is None else \
        findings.unreported(ranks)
    if missing:
        # A rank that exits without MPI finalize (code 0 all the same) makes
        # hydra kill the others, and its own exit code may then be 0.
        who = _unreported_clause(missing, count)
        reason = (f"{who} never reported an exit: {manager} stopped "
                  f"{'it' if count == 1 else 'them'}")
        with findings.lock:
            ended = list(findings.exited)
        log.line(f"{manager} exited with code 0, but {reason}, as it does "
                 f"when a rank exits without MPI finalize"
                 + (f" ({_ranks_clause(ended)} exited with code 0)"
                    if ended else "") + ".")
        return Outcome(1, reason=reason)
    return Outcome(0)
