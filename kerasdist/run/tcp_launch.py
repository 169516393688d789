"""`kerasdist run -np N [-H hosts]` over the TCP transport: no mpiexec.

With KERASDIST_TRANSPORT=tcp the launcher starts the job itself, as
node mode (node.py) would on every host at once: on each host of -H (or
of --host-discovery-script, or this machine alone) one node process
manager (node.Manager) with that host's ranks, numbered host by host as
mpiexec places them (RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_ADDR and
MASTER_PORT: rank 0's host), this machine's directly, the others' through
the remote shell (`ssh HOST python -I -S .../tcp_launch.py --host`, or
--ssh-command), as Horovod's gloo launcher and hydra do. The ranks meet
at rank 0's rendezvous as in node mode and form the core's TCP meshes.

The attempt's process (in mpiexec's place for job.py: its output, exit
markers, --timeout and signals) is this file's job manager (`--job SPEC`),
standard library only: it starts one host manager per host, each with
the job's environment and its part of the plan written on its standard
input (the job's secret never on a command line), and keeps that pipe as
the host's control line: a signal the launcher sends is forwarded as one
line (`15`), and a host manager whose pipe closes (the launcher's host
gone, or the remote shell's connection) stops its ranks, as a hydra proxy
does. It exits once every host manager has, with the first failure's
code; with --recover-in-place a host whose ranks were all lost (a code
of 128 or more, or the remote shell's 255) stops no other.

Growing in place (--recover-in-place with --host-discovery-script): when
the script lists more slots, the launcher (resize.Watcher, with
`joiner`'s callback) writes a request to the job manager's requests
directory, which starts the new processes on their hosts as `kerasdist
run --join` would (KERASDIST_JOIN=1): they wait at the rendezvous and the
ranks let them in at their next commit (kerasdist/_core/grow.py). No rank
restarts. Shrinking is a relaunch at the new size (MPI's split is what
shrinks in place; kerasdist/_core/shrink.py).

Every host must have this Python and kerasdist at the same paths, and the
launcher's working directory (as under mpiexec).
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

if __package__:
    from kerasdist.run import node
else:  # run by path (the job and host managers): node.py beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import node

# Variables of the launcher's environment that describe its host or its
# session, not the job: a host manager keeps its own.
_HOST_OWN = ("HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TMPDIR", "DISPLAY",
             "XAUTHORITY", "TERM", "HOME", "USER", "LOGNAME", "MAIL")
_HOST_OWN_PREFIXES = ("SSH_", "XDG_")
_REQUEST_PREFIX = "join-"
# The remote shell's keep-alive: a host whose link is cut ends its ssh
# within about 30 s (a lost host, with --recover-in-place).
_SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=10",
                "-o", "ServerAliveCountMax=3")
_SHELL_LOST = 255  # ssh's code when the connection fails
_EOF_GRACE_S = 5.0


# ------------------------------------------------------- launcher side


def layout(np_, hosts):
    """[(host, ranks, first rank), ...]: np_ ranks over `hosts` ([(host,
    slots), ...], None: this machine alone) slot by slot, host by host,
    as mpiexec places them; hosts left without a rank are left out."""
    out, first = [], 0
    for host, slots in hosts or [("localhost", np_)]:
        count = min(slots, np_ - first)
        if count > 0:
            out.append((host, count, first))
            first += count
    return out


def coordinator(groups, is_local, iface=None, default_port=node.DEFAULT_PORT):
    """(MASTER_ADDR, MASTER_PORT) of a job laid out as `groups`: rank 0's
    host as the other hosts reach it. Where rank 0 runs on this machine:
    its loopback address if every rank does, else the address it reaches
    the first other host from (--network-interface's, where given), and a
    free port of this machine; elsewhere that host's name and
    `default_port` (torchrun's 29500)."""
    first = groups[0][0]
    if not is_local(first):
        return first, default_port
    others = [h for h, _, _ in groups if not is_local(h)]
    if not others:
        return "127.0.0.1", node.free_port()
    return _address_towards(others[0], iface), node.free_port()


def _address_towards(host, iface):
    from kerasdist.rendezvous import protocol
    from kerasdist.run import elastic

    if iface:
        return elastic.interface_address(iface)
    try:
        return protocol.address_toward(host)
    except OSError:  # no route: the address of this host's name
        return elastic.launcher_address()


def shell_argv(shell):
    """The remote shell's argv prefix (before the host): ssh gets batch
    mode and its keep-alive."""
    shell = list(shell)
    if os.path.basename(shell[0]) == "ssh":
        shell += _SSH_OPTIONS
    return shell


def group(host, count, first, addr, port, world, nhosts, index, argv, keep,
          shell, is_local, join=False):
    """One host's part of the job, as the job manager starts it."""
    plan = node.Plan(nhosts, index, count, addr, port, world)
    local = is_local(host)
    return {"host": host, "shell": None if local else shell_argv(shell),
            "spec": {"argv": list(argv), "plan": list(plan), "first": first,
                     "port": port, "stdin_rank": -1, "keep_survivors": keep,
                     "join": join}}


def command(config, np_, hosts, argv, shell, workdir, is_local, iface=None):
    """The attempt's job-manager command line: np_ ranks of `argv` (the
    per-rank wrapper and the command) on `hosts`; `workdir` holds the
    requests directory that growing in place writes to (`joiner`)."""
    groups = layout(np_, hosts)
    addr, port = coordinator(groups, is_local, iface)
    keep = bool(config.recover_in_place)
    spec = {"groups": [group(h, n, f, addr, port, np_, len(groups), i, argv,
                             keep, shell, is_local)
                       for i, (h, n, f) in enumerate(groups)],
            "keep": keep, "cwd": os.getcwd(), "python": sys.executable,
            "requests": requests_dir(workdir)}
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "--job",
            json.dumps(spec)], (addr, port)


def requests_dir(workdir):
    return os.path.join(workdir, "joins")


def joiner(requests, argv, shell, coordinator_of, is_local):
    """The resize.Watcher's `grow` over TCP: starts the new ranks of a
    Change that grows as processes that join (a request the job manager
    serves), and returns None; for a shrink, why it is not done in place
    (a relaunch then). `coordinator_of()`: the running attempt's
    (MASTER_ADDR, MASTER_PORT)."""
    from kerasdist.run import grow as grow_lib

    def grow(change, old_hosts):
        if change.new_np < change.old_np:
            return ("over TCP a job shrinks by a relaunch: shrinking in "
                    "place needs Open MPI's ULFM")
        placed = grow_lib.placements(old_hosts, change.hosts,
                                     change.old_np, change.new_np)
        counts = {}
        for _, host, _ in placed:
            counts[host] = counts.get(host, 0) + 1
        addr, port = coordinator_of()
        for host, count in counts.items():
            body = group(host, count, 0, addr, port, count, 1, 0, argv, True,
                         shell, is_local, join=True)
            grow_lib.write_request(
                requests, body, f"{_REQUEST_PREFIX}{time.monotonic_ns()}.json")
        return None

    return grow


# ------------------------------------------------------- job manager


def _job_env():
    return {k: v for k, v in os.environ.items()
            if k not in _HOST_OWN and not k.startswith(_HOST_OWN_PREFIXES)}


class _Job:
    """Starts and watches one host manager per host (the module's doc)."""

    def __init__(self, spec):
        self.spec = spec
        self.keep = spec["keep"]
        self.hosts = []      # [(host name, Popen)], in start order
        self.signals = 0
        self.seen = set()    # request files served

    def start(self, group):
        argv = [self.spec["python"], "-I", "-S", os.path.abspath(__file__),
                "--host"]
        if group["shell"] is not None:
            argv = group["shell"] + [group["host"], shlex.join(argv)]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                    close_fds=True)
        except OSError as e:
            _say(f"cannot start the ranks of host {group['host']}: "
                 f"{argv[0]!r}: {e.strerror or e}")
            return False
        self.hosts.append((group["host"], proc))
        self._send(proc, json.dumps({"spec": group["spec"],
                                     "env": _job_env(),
                                     "cwd": self.spec["cwd"]}))
        return True

    def _send(self, proc, line):
        try:
            proc.stdin.write((line + "\n").encode())
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it is gone: its exit says so

    def _on_signal(self, signum, frame):
        ending = signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        self.signals += ending
        for _, proc in self.hosts:
            if proc.poll() is None:
                self._send(proc, str(int(signum)))

    def _requests(self):
        directory = self.spec.get("requests")
        try:
            names = sorted(n for n in os.listdir(directory)
                           if n.startswith(_REQUEST_PREFIX))
        except (OSError, TypeError):
            return
        for name in names:
            if name in self.seen:
                continue
            self.seen.add(name)
            path = os.path.join(directory, name)
            try:
                with open(path) as f:
                    body = json.load(f)
                os.remove(path)  # a relaunch's manager must not serve it
            except (OSError, ValueError):
                continue
            if not self.signals:
                self.start(body)

    def run(self):
        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
            signal.signal(getattr(signal, name), self._on_signal)
        for group in self.spec["groups"]:
            if self.signals or not self.start(group):
                self._on_signal(signal.SIGTERM, None)
                break
        return self._wait(len(self.spec["groups"]))

    def _wait(self, expected):
        code = failed_at = None
        lost = finished = 0
        done = set()
        while len(done) < len(self.hosts):
            self._requests()
            for host, proc in self.hosts:
                if id(proc) in done or proc.poll() is None:
                    continue
                done.add(id(proc))
                status = proc.returncode
                status = 128 - status if status < 0 else status
                if status == 0:
                    finished += 1
                elif self.keep and status >= 128:
                    lost = lost or status  # its ranks lost: the others go on
                    if status == _SHELL_LOST:
                        _say(f"host {host}: its remote shell ended with code "
                             f"{status} (the host or its link lost); the "
                             f"other hosts go on (recovery in place)")
                elif code is None:
                    code, failed_at = status, time.monotonic()
            if failed_at is not None and not self.signals and \
                    time.monotonic() - failed_at > node.STOP_WAIT_S:
                self._on_signal(signal.SIGTERM, None)  # no launcher did
            time.sleep(0.05)
        if code is None and len(self.hosts) < expected:
            code = 1  # stopped before every host started
        if code is None and lost and not finished:
            code = lost
        return code or 0


def _say(text):
    sys.stderr.write(f"kerasdist: {text}\n")
    sys.stderr.flush()


# ------------------------------------------------------- host manager


def _host():
    """A host's process manager: its part of the plan on the first line of
    standard input, then control lines (signal numbers) until it closes."""
    first = sys.stdin.buffer.readline()
    try:
        body = json.loads(first)
        os.chdir(body["cwd"])
    except (ValueError, KeyError, TypeError) as e:
        _say(f"host manager: no plan on its standard input ({e!r})")
        return 2
    except OSError as e:
        _say(f"cannot start ranks here: the launcher's working directory "
             f"{body['cwd']} is not on this host ({e.strerror or e})")
        return 1
    os.environ.update(body["env"])
    for name in ("SIGUSR1", "SIGUSR2"):  # until the manager handles them
        signal.signal(getattr(signal, name), signal.SIG_IGN)

    def control():
        me = os.getpid()
        for line in sys.stdin.buffer:
            try:
                os.kill(me, int(line))
            except (ValueError, OSError):
                pass
        # The launcher's side is gone: stop the ranks, then kill them.
        os.kill(me, signal.SIGTERM)
        time.sleep(_EOF_GRACE_S)
        os.kill(me, signal.SIGTERM)

    threading.Thread(target=control, daemon=True).start()
    code = node.Manager(body["spec"]).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not through the shutdown: the control thread reads


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--host"]:
        return _host()
    if len(argv) == 2 and argv[0] == "--job":
        return _Job(json.loads(argv[1])).run()
    sys.stderr.write("usage: tcp_launch.py --job SPEC | --host\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
