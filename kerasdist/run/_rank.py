"""Per-rank wrapper that `kerasdist run` puts between mpiexec and the command.

mpiexec starts one wrapper per rank; the wrapper starts the user's command
and:

- prefixes every output line with the rank (`[1]<stdout>:text`), writing each
  line with a single write() so lines of different ranks never mix mid-line
  (for lines up to PIPE_BUF bytes, which pipes write atomically); a line
  that redraws itself with carriage returns (Keras' progress bar) is passed
  on live, one write() per redraw, each with the prefix (see Units); with
  `--no-prefix` the lines are passed on whole all the same;
- forwards SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 to the command and, after a
  grace period, kills it (and every process it started) if it ignores an
  ending signal;
- kills the command if the wrapper itself dies (Linux parent-death signal);
- reports the command's exit (its code or signal, 0 too) to the launcher as
  one marker line on stderr, which the launcher removes from the output: a
  rank that never reports was stopped from outside (hydra kills the job's
  other ranks when one exits without MPI finalize, and may then exit 0);
- in an elastic job (KERASDIST_ELASTIC=1, set by `kerasdist run
  --host-discovery-script`), starts the command with SIGUSR1 ignored, so
  the launcher's resize request (SIGUSR1, see kerasdist/run/resize.py)
  never kills a command that does not handle it (kd.init() installs the
  handler), and reports the command's resize exit (RESIZE_EXIT_CODE) to
  hydra as 0, so hydra does not stop the other ranks while they write
  their checkpoint and exit too; the marker line still tells the launcher;
- watches the command's heartbeat thread through a pipe
  (KERASDIST_WATCHDOG; see Watchdog) and SIGKILLs the command once it sent
  nothing for the heartbeat's timeout. The thread feeds the pipe with
  recovery in place (KERASDIST_RECOVER_IN_PLACE=1, `kerasdist run
  --recover-in-place`), where a frozen rank (SIGSTOP, a hung process) must
  die for Open MPI to tell the survivors, who go on without it, and in a
  job of one rank, which no other rank's heartbeat watches: there a frozen
  rank must die for the launcher to end (or restart) the job;
- sets KERASDIST_HOSTNAME to the name of the host the rank runs on (as
  Horovod's launcher sets HOROVOD_HOSTNAME), so every rank can tell which
  host it is on without asking MPI;
- with `--huge-pages`, adds glibc.malloc.hugetlb=1 to GLIBC_TUNABLES (see
  with_huge_pages), so that the large buffers malloc hands TensorFlow sit
  on 2 MiB transparent huge pages as numpy's already do;
- with `--bind`, restricts the command to this rank's share of the CPUs it
  may run on (see cpu_share), so that the ranks of one machine do not chase
  each other across cores and each TensorFlow sizes its thread pools by its
  own share.

The command inherits the wrapper's environment and every inheritable file
descriptor, so PMI_FD (hydra's PMI socket) stays usable, exactly as if mpiexec
had started the command itself.

This file uses only the standard library and imports nothing from kerasdist:
the launcher runs it by path (`python -I -S .../_rank.py`), so it works on a
rank whatever the rank's sys.path is. `python -m kerasdist.run._rank` works too.

Usage: _rank.py [--no-prefix] [--bind] [--report-bind] [--huge-pages]
                -- command [args...]

Over 500 lines: the launcher runs it by path on every rank (`python -I -S
_rank.py`), so it may import nothing of its own package: output relay, signal
forwarding and exit markers live in this one file.
"""

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

# Shared with the launcher (kerasdist/run/job.py imports these names).
MARKER = b"\x1ekerasdist-rank-exit "
# The launcher's random token for the job's markers: the wrapper takes it
# out of the environment before the command starts, so that a rank's own
# output (a log it prints, a nested job's) can never pass for a marker.
MARKER_TOKEN_ENV = "KERASDIST_MARKER_TOKEN"
# The host's name, for every rank (see docs/launcher.md).
HOSTNAME_ENV = "KERASDIST_HOSTNAME"
# Seconds between forwarding an ending signal and SIGKILL.
KILL_GRACE_S = 5.0
# The exit code of a rank whose heartbeat lost a peer (ops/core/control/
# liveness.cc, kerasdist/rendezvous/protocol.py: this file imports neither).
PEER_LOST_EXIT_CODE = 75
# Seconds a wrapper stays after the marker of a command that died of a
# signal or lost a peer. The process manager ends every rank once one
# exits badly, and a host's ranks die together (a host's processes killed,
# the out-of-memory killer); the rank that survived them ends at once. This
# moment lets the others' wrappers, a little slower, write their markers
# before the process manager ends them, so the launcher names them all.
REPORT_GRACE_S = 0.5

# Elastic jobs (kerasdist/run/resize.py). The rank side keeps its own copy
# of these (kerasdist/_core/resize.py: it may not import the launcher); a unit
# test holds the two equal.
ELASTIC_ENV = "KERASDIST_ELASTIC"
# Set by `kerasdist run --recover-in-place` (kerasdist/run/mpi_command.py).
RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"
# "<fd>:<wrapper's pid>": the pipe the command's heartbeat thread feeds
# (ops/core/control/liveness.h, LivenessOptions::watchdog_fd).
WATCHDOG_ENV = "KERASDIST_WATCHDOG"
# A rank the job's ranks started to grow in place (kerasdist/run/grow.py):
# its rank in the grown job (its MPI_COMM_WORLD rank is that of the
# processes started with it).
GROWN_RANK_ENV = "KERASDIST_GROWN_RANK"
# A process that joins a running TCP job (kerasdist/rendezvous/joining.py)
JOIN_ENV = "KERASDIST_JOIN"
# The exit code of a rank that stopped at a checkpoint for a resize.
RESIZE_EXIT_CODE = 76
# The line a rank writes on stderr once it checks for resize requests.
RESIZABLE_MARKER = b"\x1ekerasdist-resizable"
# In that line: the rank grows in place under --recover-in-place
# (hvd.elastic.run); without it (the Trainer) a grow relaunches.
GROWS_IN_PLACE_WORD = b" grows=in-place"
# ... and that it shrinks in place (hvd.elastic.run, and the Trainer with
# its commits in memory); without it a shrink relaunches.
SHRINKS_IN_PLACE_WORD = b" shrinks=in-place"
# The line a rank writes on stderr each time it saved progress the next
# attempt resumes from (a Trainer checkpoint, an elastic commit): a failure
# after it is restarted without the backoff, and its error is not compared
# with the next attempt's (see kerasdist/run/attempt_loop.py's Attempts).
PROGRESS_MARKER = b"\x1ekerasdist-progress"
# Set for the command ("1"): the launcher reads the rank's markers.
MARKERS_READ_ENV = "KERASDIST_MARKERS_READ"
# The launcher's random token for the two markers above, which the rank
# writes (kerasdist/_core/resize.py), as `token=...` at the end of the line: a
# line the program prints cannot pass for one. Another token than the exit
# marker's, which the command never sees.
RANK_MARKER_TOKEN_ENV = "KERASDIST_RANK_MARKER_TOKEN"
# Where `hvd.elastic` states are committed for the job's next attempt
# (kerasdist/elastic.py keeps its own copy).
ELASTIC_DIR_ENV = "KERASDIST_ELASTIC_DIR"

# glibc's (2.35+) tunable: 1 = madvise(MADV_HUGEPAGE) on the memory malloc
# gets from the kernel. Older glibc ignores names it does not know.
TUNABLES_ENV = "GLIBC_TUNABLES"
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"

_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
_ENDING = ("SIGINT", "SIGTERM", "SIGHUP")
_PR_SET_PDEATHSIG = 1


def rank_from_env(environ):
    """Returns this process's rank as a string, from the MPI launcher's env
    (or torchrun's RANK, which node mode sets)."""
    for name in (GROWN_RANK_ENV, "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                 "PMIX_RANK", "RANK"):
        if environ.get(name, "") != "":
            return environ[name]
    if environ.get(JOIN_ENV, "").strip() == "1":
        # It joins a running job (kerasdist run --join), which numbers
        # it: "+0", "+1", ... by its local rank until then.
        return "+" + environ.get("LOCAL_RANK", "0")
    return "?"


def local_rank_from_env(environ):
    """Returns (local rank, ranks on this host) from MPI's env (or
    torchrun's, which node mode sets), or None."""
    for rank_name, size_name in (
            ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH hydra
            ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
            ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):  # node mode, torchrun
        try:
            local_rank = int(environ[rank_name])
            local_size = int(environ[size_name])
        except (KeyError, ValueError):
            continue
        if 0 <= local_rank < local_size:
            return local_rank, local_size
    return None


def physical_core_of(cpu):
    """Returns a key shared by the hardware threads of one core, from sysfs."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            package = f.read().strip()
        with open(base + "core_id") as f:
            core = f.read().strip()
    except OSError:
        return ("cpu", cpu)  # unknown: every CPU its own core
    return (package, core)


def cpu_share(cpus, local_rank, local_size, core_of=physical_core_of):
    """Returns the CPUs of `cpus` for one of `local_size` ranks, or None.

    The physical cores among `cpus` are split into `local_size` contiguous
    blocks whose sizes differ by at most one (the first ranks get the larger
    ones); a rank gets every hardware thread of its block's cores, so two
    ranks never share a core. With fewer cores than ranks the hardware
    threads are split the same way instead; with fewer CPUs than ranks
    there is no share to give (None: leave the rank unbound).
    """
    cpus = sorted(cpus)
    if local_size < 1 or len(cpus) < local_size:
        return None
    cores = {}
    for cpu in cpus:
        cores.setdefault(core_of(cpu), []).append(cpu)
    groups = sorted(cores.values())
    if len(groups) < local_size:
        groups = [[cpu] for cpu in cpus]
    per, extra = divmod(len(groups), local_size)
    start = local_rank * per + min(local_rank, extra)
    count = per + (1 if local_rank < extra else 0)
    return {cpu for group in groups[start:start + count] for cpu in group}


def _bind(rank, report):
    """Binds this process (and so the command) to its share of the CPUs."""
    where = local_rank_from_env(os.environ)
    if where is None or not hasattr(os, "sched_setaffinity"):
        message = "not bound (the MPI launcher gave no local rank)"
    else:
        allowed = os.sched_getaffinity(0)
        share = cpu_share(allowed, *where)
        if share is None:
            message = (f"not bound: {where[1]} ranks on this host and only "
                       f"{len(allowed)} CPU(s) to share")
        else:
            try:
                os.sched_setaffinity(0, share)
                message = f"bound to CPU(s) {_cpu_list(share)}"
            except OSError as e:  # e.g. a cpuset that changed under us
                message = f"not bound: {e.strerror or e}"
    if report:
        _write_all(2, f"kerasdist: rank {rank}: {message}\n".encode())


def _cpu_list(cpus):
    """{0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(_span(run))
        run = [cpu]
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run):
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


_PR_SET_PDEATHSIG = 1
_prctl = None


def prepare_parent_death():
    """Loads prctl (Linux) in this process, before a fork whose child calls
    die_with_parent(): the child then only calls it."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        import ctypes
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl


def die_with_parent(signum, parent):
    """Asks the kernel to send this process `signum` when its parent (the
    launcher, the process manager) ends, even by SIGKILL; `parent`: the
    parent's pid, to catch a parent that ended before the call."""
    if prepare_parent_death():
        _prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def format_marker(rank, host, status, token=""):
    """Returns the marker line for a rank whose command ended with `status`.

    `status` follows Popen.returncode: a negative value is a signal number.
    """
    host = host.replace(" ", "_") or "?"
    return MARKER + (f"rank={rank} host={host} status={status} "
                     f"token={token}\n").encode()


def parse_marker(line, token=None):
    """Returns (rank, host, status) from a marker line, or None (also when
    `token` is given and the line does not carry it)."""
    start = line.find(MARKER)
    if start < 0:
        return None
    fields = {}
    for item in line[start + len(MARKER):].decode(errors="replace").split():
        key, _, value = item.partition("=")
        fields[key] = value
    if token is not None and fields.get("token") != token:
        return None
    try:
        return fields["rank"], fields["host"], int(fields["status"])
    except (KeyError, ValueError):
        return None


def is_rank_marker(line, marker, token=None):
    """Whether `line` holds the rank's `marker` (RESIZABLE_MARKER or
    PROGRESS_MARKER) with `token` (any token when None) as its last
    word."""
    start = line.find(marker)
    if start < 0:
        return False
    words = line[start + len(marker):].split()
    return token is None or (bool(words) and
                             words[-1] == b"token=" + token.encode())


def _stat(pid):
    """(ppid, pgid, sid, start time) of a live process from /proc, or None.

    None for a process that is gone or a zombie (nothing left to kill).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the
    # fields that follow start after its last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    # state ppid pgrp session ... starttime (field 22, index 19 here)
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def _process_table():
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def job_processes(roots=(), sessions=(), known=None):
    """The live processes of a job, read from /proc.

    Args:
        roots: pids whose whole trees belong to the job (live processes this
            caller has not reaped, so their pids cannot have been reused).
        sessions: session ids whose every process belongs to the job (a
            session id stays taken while any process is in the session).
        known: {pid: start time} from an earlier call; those still running
            (same pid, same start time) belong to the job.

    Returns:
        {pid: (ppid, pgid, sid, start time)} of `roots`, the processes of
        `sessions` and of `known`, every descendant of those, and every
        process of a session one of them leads; the caller excluded.
    """
    table = _process_table()
    children = {}
    for pid, (ppid, _, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    sessions = set(sessions)
    todo = [p for p in roots if p in table]
    todo += [p for p, st in table.items() if st[2] in sessions]
    todo += [p for p, start in (known or {}).items()
             if p in table and table[p][3] == start]
    found = set()
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo += children.get(pid, [])
        sid = table[pid][2]
        if sid == pid and sid not in sessions:  # a session leader
            sessions.add(sid)
            todo += [p for p, st in table.items() if st[2] == sid]
    found.discard(os.getpid())
    return {pid: table[pid] for pid in found}


def kill_job(roots=(), sessions=(), known=None):
    """SIGKILLs every process of a job (see job_processes) and its group.

    The processes are stopped (SIGSTOP) and the tree read again before the
    kill, so that none forks or leaves its parent unseen while they are
    killed one by one; this repeats until no process of the job is left.
    Process groups are killed as well: a process that left its parent's
    tree by setpgid() but kept its group still goes. The caller's own
    process group is spared.

    Returns:
        The pids killed.
    """
    own_group = os.getpgid(0)
    killed = set()
    for _ in range(10):
        procs = job_processes(roots, sessions, known)
        if not procs:
            break
        for pid in procs:
            _send(pid, signal.SIGSTOP)
        procs.update(job_processes(roots, sessions, known))
        for pgid in {st[1] for st in procs.values()} - {own_group}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        for pid in procs:
            _send(pid, signal.SIGKILL)
        killed.update(procs)
    return killed


def _send(pid, signum):
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _libc_prctl():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError, ImportError):
        return None


def _write_all(fd, data):
    while data:
        try:
            written = os.write(fd, data)
        except BrokenPipeError:
            return
        except InterruptedError:
            continue
        data = data[written:]


class Units:
    """Cuts an output stream into the pieces that are written whole: lines
    (ending in "\n") and redraws of a line in place (ending in "\r").

    A progress bar such as Keras' draws each update as backspaces, "\r" and
    the new text, with no line end until the bar is done. Once a line has
    been redrawn that way, its text is passed on as soon as it arrives, as a
    redraw ("text\r"), so the bar is shown live; other partial text waits
    for its line end, so a line written in pieces (`print` under `python
    -u`) is still passed on whole. Backspaces in redrawn lines are dropped:
    they would walk back over the rank prefix.
    """

    _MAX = 1 << 16  # a partial line this long is passed on as it is

    def __init__(self):
        self.buf = b""
        self.in_place = False  # the current line is being redrawn
        self.shown = None  # its text as last passed on

    def feed(self, data):
        """The whole pieces that `data` completes, in order."""
        self.buf += data
        out = []
        while True:
            cr, nl = self.buf.find(b"\r"), self.buf.find(b"\n")
            if cr < 0 and nl < 0:
                break
            if nl >= 0 and (cr < 0 or nl < cr or nl == cr + 1):
                seg, self.buf = self.buf[:nl], self.buf[nl + 1:]
                if self.in_place or seg.endswith(b"\r"):
                    # The redrawn line's last text, then its end alone: the
                    # launcher tells a bare "\n" from another rank's line.
                    seg = seg.rstrip(b"\r").replace(b"\b", b"")
                    if seg and seg != self.shown:
                        out.append(seg + b"\r")
                    out.append(b"\n")
                else:
                    out.append(seg + b"\n")
                self.in_place, self.shown = False, None
                continue
            seg, self.buf = self.buf[:cr].replace(b"\b", b""), \
                self.buf[cr + 1:]
            self.in_place = True
            if seg and seg != self.shown:
                out.append(seg + b"\r")
            self.shown = None
        if self.in_place and self.buf:
            text = self.buf.replace(b"\b", b"")
            if text and text != self.shown:
                out.append(text + b"\r")
                self.shown = text
        elif len(self.buf) >= self._MAX:
            out.append(self.buf + b"\n")
            self.buf = b""
        return out

    def close(self):
        """What is left when the stream ends, ended as a line."""
        if self.in_place:
            return self.feed(b"\n")
        rest, self.buf = self.buf, b""
        return [rest + b"\n"] if rest else []


def chunks(fd):
    """What `fd` gives until its end, each read as it arrives."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except InterruptedError:
            continue
        if not data:
            return
        yield data


def prefixed(pieces, prefix, state):
    """`pieces` (from Units) with `prefix` on each, except the bare "\n"
    that ends a redrawn line (the launcher's Log ends the bar with it). A
    blank line of the rank's own is a bare "\n" too, but not after a
    redraw: it gets its prefix. `state`: a dict kept between calls."""
    for piece in pieces:
        bare = piece == b"\n" and state.get("redrawing", False)
        state["redrawing"] = piece.endswith(b"\r")
        yield piece if bare else prefix + piece


def _pump(pipe, fd, prefix):
    """Copies `pipe` to `fd`, one write() per prefixed piece (see Units)."""
    units, state = Units(), {}
    for data in chunks(pipe.fileno()):
        for piece in prefixed(units.feed(data), prefix, state):
            _write_all(fd, piece)
    for piece in prefixed(units.close(), prefix, state):
        _write_all(fd, piece)
    pipe.close()


def command_problem(program):
    """One line saying why `program`, a file here, cannot be run as a
    command (a script given without its interpreter: `kerasdist run -np 2
    train.py`), or None."""
    if not os.path.isfile(program):
        return None
    script = program.endswith(".py")
    if os.sep not in program:
        import shutil
        if shutil.which(program) is not None:
            return None
        fix = (f"to run a Python script write `python {program}`" if script
               else f"to run it from this directory write `./{program}`")
        return f"{program!r} is a file here but not a command on PATH: {fix}"
    if not os.access(program, os.X_OK):
        fix = (f"write `python {program}`" if script else
               f"put its interpreter before it or make it executable "
               f"(chmod +x {program})")
        return f"{program!r} is not executable: {fix}"
    return None


class Watchdog:
    """Kills a command whose heartbeat thread went silent (recovery in
    place, or a job of one rank).

    The thread writes "arm <timeout seconds>" as it starts, "beat" every
    interval and "off" as it ends (each a line, one write). While armed,
    `feed` keeps the time of the last line and `overdue` says when nothing
    came for the timeout: the process is frozen (SIGSTOP) or hung, and the
    other ranks' heartbeat finds it lost at about the same time. Open MPI
    tells the survivors of a lost rank only once its process dies, so the
    wrapper then kills it, and the survivors re-form without it instead of
    waiting for it until their deadline. A rank alone in its job has no
    other rank to find it lost: killed, it ends the job, which the launcher
    restarts (--max-restarts) instead of waiting for ever.
    """

    def __init__(self):
        self.timeout = None  # armed while not None
        self.last = 0.0
        self.buf = b""

    def feed(self, data, now):
        """Takes the lines in `data` (bytes read from the pipe)."""
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            words = line.split()
            if words[:1] == [b"arm"] and len(words) == 2:
                try:
                    self.timeout, self.last = float(words[1]), now
                except ValueError:
                    pass
            elif words == [b"beat"]:
                self.last = now
            elif words == [b"off"]:
                self.timeout = None

    def wait_s(self, now):
        """How long to wait for the next line (None: for ever)."""
        if self.timeout is None:
            return None
        return max(0.0, self.last + self.timeout - now) + 0.05

    def overdue(self, now):
        return self.timeout is not None and now - self.last > self.timeout


class _Wrapper:
    def __init__(self, command, prefix):
        self.command = command
        self.prefix = prefix
        self.proc = None
        self.pending = []
        self.kill_timer = None
        self.watch_fd = None  # the watchdog pipe's reading end

    def _open_watchdog(self):
        """The pipe for the command's heartbeat thread (its writing end
        inherited, named in WATCHDOG_ENV); the thread decides whether to
        feed it (liveness.h, watchdog_fd)."""
        self.watch_fd, write_fd = os.pipe()
        os.set_inheritable(write_fd, True)
        os.environ[WATCHDOG_ENV] = f"{write_fd}:{os.getpid()}"
        return write_fd

    def _watch(self, rank):
        """Kills the command once its heartbeat is overdue (Watchdog)."""
        dog = Watchdog()
        while self.proc.returncode is None:
            ready, _, _ = select.select([self.watch_fd], [], [],
                                        dog.wait_s(time.monotonic()))
            now = time.monotonic()
            if ready:
                data = os.read(self.watch_fd, 4096)
                if not data:
                    return  # the command (and what it started) closed it
                dog.feed(data, now)
            elif dog.overdue(now) and self.proc.returncode is None:
                why = ("so that the other ranks go on without it (recovery "
                       "in place)" if os.environ.get(RECOVER_ENV) == "1"
                       else "so that the job ends: no other rank can find "
                       "it lost")
                _write_all(2, (
                    f"kerasdist: rank {rank}: its heartbeat sent nothing "
                    f"for {dog.timeout:g} s (the process is frozen or "
                    f"hung); killing it, {why}.\n").encode())
                kill_job(roots=(self.proc.pid,))
                return

    def _on_signal(self, signum, frame):
        if self.proc is None:
            self.pending.append(signum)
            return
        self._forward(signum)

    def _forward(self, signum):
        if self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            return
        ending = {getattr(signal, n) for n in _ENDING if hasattr(signal, n)}
        if signum in ending and self.kill_timer is None:
            self.kill_timer = threading.Timer(KILL_GRACE_S, self._kill)
            self.kill_timer.daemon = True
            self.kill_timer.start()

    def _kill(self):
        # The command's whole tree: children it moved to process groups of
        # their own would outlive a kill of its group alone.
        if self.proc.returncode is None:
            kill_job(roots=(self.proc.pid,))

    def run(self, rank, elastic=False):
        prctl = _libc_prctl()
        parent = os.getpid()

        def child_setup():
            # Dies with the wrapper, e.g. when the wrapper is SIGKILLed.
            if prctl is not None:
                prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(137)

        if prctl is not None:
            # The wrapper ends (forwarding to the command) if its parent, the
            # MPI process manager, dies without telling it.
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        for name in _FORWARDED:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._on_signal)

        if elastic:
            # An ignored signal stays ignored across exec: the command
            # starts with SIGUSR1 ignored until it installs a handler.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        pipe = subprocess.PIPE
        watch_write = self._open_watchdog()
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=pipe,
                stderr=pipe,
                close_fds=False,
                # Its own process group: hydra signals the wrapper's group,
                # and the command must get each signal once (from us).
                process_group=0,
                preexec_fn=child_setup,
            )
        except OSError as e:
            if elastic:
                signal.signal(signal.SIGUSR1, self._on_signal)
            problem = command_problem(self.command[0])
            sys.stderr.write(
                f"kerasdist: rank {rank}: cannot run {self.command[0]!r}: "
                f"{e.strerror or e}"
                f"{'; ' + problem if problem else ''}\n"
            )
            sys.stderr.flush()
            return 127 if isinstance(e, FileNotFoundError) else 126
        finally:
            if watch_write is not None:
                os.close(watch_write)
        if elastic:
            signal.signal(signal.SIGUSR1, self._on_signal)
        if self.watch_fd is not None:
            threading.Thread(target=self._watch, args=(rank,),
                             daemon=True).start()
        for signum in self.pending:
            self._forward(signum)

        pumps = []
        for pipe_, fd, stream in (
            (self.proc.stdout, 1, "stdout"),
            (self.proc.stderr, 2, "stderr"),
        ):
            tag = f"[{rank}]<{stream}>:".encode() if self.prefix else b""
            t = threading.Thread(target=_pump, args=(pipe_, fd, tag))
            t.daemon = True
            t.start()
            pumps.append(t)
        status = self.proc.wait()
        for t in pumps:
            # A background grandchild may keep a pipe open; don't wait for it.
            t.join(timeout=2.0)
        return status


def with_huge_pages(value):
    """GLIBC_TUNABLES `value` (None: unset) with glibc.malloc.hugetlb=1
    added, unless it sets that tunable already: a user's own choice, e.g.
    glibc.malloc.hugetlb=0, stands.

    Why: TensorFlow's CPU allocator is malloc, whose large blocks sit on
    4 KiB pages, where numpy madvises its large arrays onto 2 MiB ones. The
    single-node allreduce reads and writes the other rank's tensors in place
    (process_vm_readv/writev), which walks and pins them page by page, so
    large tensors on huge pages reduce faster (docs/benchmarks.md). It
    takes effect where the kernel's
    transparent huge pages are `madvise` or `always` (see `kerasdist
    doctor`), and only for a process started with it, hence here.
    """
    parts = [p for p in (value or "").split(":") if p]
    if any(p.split("=", 1)[0] == HUGE_PAGES_TUNABLE for p in parts):
        return value
    return ":".join(parts + [HUGE_PAGES_TUNABLE + "=1"])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    prefix, bind, report, huge = True, False, False, False
    while argv and argv[0] in ("--no-prefix", "--bind", "--report-bind",
                               "--huge-pages"):
        flag = argv.pop(0)
        prefix = prefix and flag != "--no-prefix"
        bind = bind or flag == "--bind"
        report = report or flag == "--report-bind"
        huge = huge or flag == "--huge-pages"
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.stderr.write("kerasdist: _rank: no command given\n")
        return 2
    rank = rank_from_env(os.environ)
    # A process manager that is killed takes its ranks with it: the wrapper
    # gets SIGTERM and ends its command as for any ending signal.
    die_with_parent(signal.SIGTERM, os.getppid())
    token = os.environ.pop(MARKER_TOKEN_ENV, "")
    os.environ[HOSTNAME_ENV] = socket.gethostname()
    os.environ[MARKERS_READ_ENV] = "1"
    if huge:
        os.environ[TUNABLES_ENV] = with_huge_pages(os.environ.get(TUNABLES_ENV))
    if bind:
        _bind(rank, report)
    elastic = os.environ.get(ELASTIC_ENV) == "1"
    status = _Wrapper(argv, prefix).run(rank, elastic)
    sys.stdout.flush()
    sys.stderr.flush()
    _write_all(2, format_marker(rank, socket.gethostname(), status, token))
    if elastic and status == RESIZE_EXIT_CODE:
        return 0  # the launcher has the marker; hydra must not clean up
    recovering = os.environ.get(RECOVER_ENV) == "1"
    if status < 0 and recovering:
        # Recovery in place (Open MPI's ULFM): its process manager tells
        # the survivors of a rank lost only when the rank's process dies
        # of a signal, so this one dies of the command's.
        _die_of(-status)
    if not recovering and (status < 0 or status == PEER_LOST_EXIT_CODE):
        time.sleep(REPORT_GRACE_S)
    # A command killed by signal N is reported to mpiexec as exit 128+N;
    # the launcher, not hydra, decides what to do about a failed rank.
    return 128 - status if status < 0 else status


def _die_of(signum):
    """Ends this process by signal `signum`, its default action restored."""
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL, SIGSTOP: their action cannot be changed
    os.kill(os.getpid(), signum)
    signal.pause()


if __name__ == "__main__":
    sys.exit(main())
