"""A test cluster on one machine: K hosts made of Linux namespaces.

    from tests.support.cluster import Cluster, unavailable_reason

    with Cluster(2) as c:                   # hosts "kdt0", "kdt1"
        c.run(c.hosts[0], ["hostname"])      # runs inside host kdt0
        c.shape(c.hosts[1], "1gbit")         # tc tbf on both ends of its link
        c.remote_shell                       # a script hydra can use as ssh

Each host is one long-lived "anchor" process started with
`unshare --net --uts --ipc --mount --pid --fork`, so it has its own network
stack, host name, System V IPC, mounts and PIDs, and shares nothing with the
other hosts but the kernel and the machine's files. In its mount namespace it
gets its own `/dev/shm` and `/run` (tmpfs) and its own `/etc/hosts` (a file of
the cluster's, bind-mounted; the machine's file is never edited). Processes
enter a host with `nsenter -t ANCHOR --net --uts --ipc --mount --pid`.

The network: a bridge in the machine's namespace with the address .1 of a
/24 in 198.18.0.0/15 (RFC 2544's range for benchmarking, never routed on the
Internet), and one veth per host (`eth0` inside, address .2, .3, ...). The
hosts have no default route and there is no NAT or forwarding: a host can
reach the other hosts and the bridge address (where the launcher's mpiexec
listens), nothing else.

Everything is named with the prefix `kdt<owner pid>` and removed by close(),
also at interpreter exit; the anchors die with the process that made them
(parent-death signal), and a new Cluster removes what a dead owner left.

Needs root, `unshare`, `nsenter` and `ip`; see unavailable_reason(), and
require() for tests.
Standard library only.
"""

import atexit
import fcntl
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tests.support import host_faults
from tests.support import system
from tests.support.helpers import launch
from tests.support.helpers import worker_env

PREFIX = "kdt"
NET_BASE = (198, 18)  # RFC 2544 benchmarking range: 198.18.0.0/15
ANCHOR_TAG = "kerasdist-test-cluster-anchor"
NSENTER_NS = ("--net", "--uts", "--ipc", "--mount", "--pid")

# Link profiles for shape(): tc tbf rate, burst and queue limit.
PROFILES = {
    "10gbit": ("10gbit", "2mb", "8mb"),
    "1gbit": ("1gbit", "256kb", "2mb"),
}

_PR_SET_PDEATHSIG = 1
_serial = itertools.count()


def unavailable_reason():
    """Why a test cluster cannot be made here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridges, mounts)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (Debian's util-linux)"
    missing = system.reason("iproute2")
    if missing:
        return missing
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--ipc", "--mount", "--pid", "--fork",
         "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot make namespaces (unshare: "
                f"{probe.stderr.strip() or probe.returncode})")
    return None


def require():
    """Skips the calling test where no cluster can be made, with the reason;
    fails it instead when CI=true (CI must run the cluster tests)."""
    import pytest

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the test cluster cannot run here: {reason}",
                    pytrace=False)
    pytest.skip(f"test cluster: {reason}")


def _sh(argv, check=True, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed with code "
                           f"{out.returncode}: {out.stderr.strip()}")
    return out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _links():
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    return re.findall(r"^\d+: ([^:@\s]+)", out, re.M)


def _anchor_pids():
    """{anchor pid: owner pid} of every test-cluster anchor on the machine."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        for arg in args:
            m = re.match(rb"^" + ANCHOR_TAG.encode() + rb"=(\d+)$", arg)
            if m:
                found[int(entry)] = int(m.group(1))
    return found


def remove_leftovers():
    """Removes anchors and links that a test cluster whose owner is dead
    left behind (e.g. a test run that was SIGKILLed). Returns their names."""
    removed = []
    for pid, owner in _anchor_pids().items():
        if not _alive(owner):
            try:
                os.kill(pid, signal.SIGKILL)
                removed.append(f"anchor {pid}")
            except ProcessLookupError:
                pass
    for name in _links():
        m = re.match(rf"^{PREFIX}(\d+)", name)
        if m and not _alive(int(m.group(1))):
            if _sh(["ip", "link", "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


def _free_subnet(owner):
    used = _sh(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    routes = _sh(["ip", "-4", "route", "show"], check=False).stdout
    for k in range(256):
        third = (owner + k) % 256
        net = f"{NET_BASE[0]}.{NET_BASE[1]}.{third}."
        if net not in used and net not in routes:
            return net
    raise RuntimeError("no free /24 in 198.18.0.0/16 for the test bridge")


class Host:
    """One test host.

    Attributes:
        name: its host name (also its name in every host's /etc/hosts).
        address: its IPv4 address on the bridge.
        pid: the anchor's PID (init of its PID namespace), for nsenter.
        link: the machine-side end of its veth (bytes it sends are this
            link's rx_bytes).
    """

    def __init__(self, name, address, link):
        self.name = name
        self.address = address
        self.link = link
        self.pid = None
        self.proc = None

    def nsenter(self):
        """The argv prefix that runs a command inside this host."""
        return ["nsenter", "-t", str(self.pid), *NSENTER_NS, "--"]

    def __repr__(self):
        return f"Host({self.name!r}, {self.address}, pid={self.pid})"


def _anchor_preexec():
    # The anchor (unshare) dies with the process that made it; unshare's
    # --kill-child then takes the PID namespace's init, and with it every
    # process in the host.
    import ctypes
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# PID 1 of a host: reaps orphans (a real init's job) and otherwise sleeps.
_INIT = ("import os, time\n"
         "while True:\n"
         "    try:\n"
         "        os.wait()\n"
         "    except ChildProcessError:\n"
         "        time.sleep(1)\n")


class Cluster:
    """K test hosts on one machine, joined by a bridge.

    Args:
        num_hosts: how many hosts to make.
        names: their host names (default kdt0, kdt1, ...).

    Use as a context manager, or call close(); close() also runs at exit.
    """

    def __init__(self, num_hosts=2, names=None):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot make a test cluster: {reason}")
        self.owner = os.getpid()
        # kdt<pid><letter>: a process may hold several clusters at once, and
        # a link name has at most 15 characters.
        self.tag = f"{PREFIX}{self.owner}{chr(97 + next(_serial) % 26)}"
        self.names = list(names or [f"kdt{i}" for i in range(num_hosts)])
        self.dir = tempfile.mkdtemp(prefix="kerasdist-cluster-")
        self.bridge = f"{self.tag}b"
        self.hosts = []
        self._closed = False
        remove_leftovers()
        atexit.register(self.close)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # -- building -----------------------------------------------------------

    def _start(self):
        # Two test processes may make clusters at once (pytest-xdist): the
        # lock keeps a /24 picked by one from being picked by the other
        # before its bridge holds the address.
        with open(os.path.join(tempfile.gettempdir(),
                               "kerasdist-cluster.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = _free_subnet(self.owner)
            self.address = net + "1"
            _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
            _sh(["ip", "addr", "add", f"{self.address}/24", "dev",
                 self.bridge])
        self.hosts = [Host(name, f"{net}{i + 2}", f"{self.tag}h{i}")
                      for i, name in enumerate(self.names)]
        hosts_file = os.path.join(self.dir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for h in self.hosts:
                f.write(f"{h.address} {h.name}\n")
        os.chmod(hosts_file, 0o644)
        # Names resolve from the hosts file only: no lookup leaves the
        # machine, neither from a host nor from a launcher (launcher_prefix).
        self._nsswitch = os.path.join(self.dir, "nsswitch.conf")
        with open(self._nsswitch, "w") as f:
            f.write("hosts: files\n")
        os.chmod(self._nsswitch, 0o644)
        self._hosts_file = hosts_file
        _sh(["ip", "link", "set", self.bridge, "up"])
        for i, host in enumerate(self.hosts):
            self._start_host(i, host, hosts_file)
        self._write_remote_shell()

    def _start_host(self, i, host, hosts_file):
        setup = " && ".join([
            f"hostname {shlex.quote(host.name)}",
            "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            "mkdir -p /run/sshd",
            f"mount --bind {shlex.quote(hosts_file)} /etc/hosts",
            f"mount --bind {shlex.quote(self._nsswitch)} /etc/nsswitch.conf",
            "ip link set lo up",
            f"exec {shlex.quote(sys.executable)} -c \"$0\" \"$1\"",
        ])
        # The anchor's errors go to a file, not the test's stderr: unshare
        # complains there when its child is killed at close().
        with open(self._log_path(host), "wb") as log:
            host.proc = subprocess.Popen(
                ["unshare", "--net", "--uts", "--ipc", "--mount", "--pid",
                 "--fork", "--mount-proc", "--kill-child",
                 "sh", "-c", setup, _INIT, f"{ANCHOR_TAG}={self.owner}"],
                stdin=subprocess.DEVNULL, stderr=log,
                preexec_fn=_anchor_preexec)
        host.pid = self._wait_for_init(host)
        peer = f"{self.tag}p{i}"
        _sh(["ip", "link", "add", host.link, "type", "veth", "peer", "name",
             peer])
        _sh(["ip", "link", "set", peer, "netns", str(host.pid)])
        _sh(["ip", "link", "set", host.link, "master", self.bridge])
        _sh(["ip", "link", "set", host.link, "up"])
        self.run(host, ["sh", "-c", " && ".join([
            f"ip link set {peer} name eth0",
            f"ip addr add {host.address}/24 dev eth0",
            "ip link set eth0 up",
        ])])

    def _log_path(self, host):
        return os.path.join(self.dir, f"{host.name}.log")

    def _wait_for_init(self, host, timeout=20.0):
        """The PID of the host's init, once its setup has exec'd it."""
        deadline = time.monotonic() + timeout
        tag = f"{ANCHOR_TAG}={self.owner}".encode()
        while time.monotonic() < deadline:
            if host.proc.poll() is not None:
                with open(self._log_path(host)) as f:
                    log = f.read().strip()
                raise RuntimeError(f"host {host.name}: unshare exited with "
                                   f"code {host.proc.returncode}: {log}")
            try:
                with open(f"/proc/{host.proc.pid}/task/{host.proc.pid}/"
                          "children") as f:
                    kids = [int(p) for p in f.read().split()]
                for kid in kids:
                    with open(f"/proc/{kid}/cmdline", "rb") as f:
                        args = f.read().split(b"\0")
                    if tag in args and not args[0].endswith(b"sh"):
                        return kid
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"host {host.name}: not up after {timeout:g} s")

    def _write_remote_shell(self):
        cases = "".join(f"  {h.name}|{h.address}) pid={h.pid} ;;\n"
                        for h in self.hosts)
        self.remote_shell = os.path.join(self.dir, "nsenter-shell")
        with open(self.remote_shell, "w") as f:
            f.write(_REMOTE_SHELL.format(cases=cases, ns=" ".join(NSENTER_NS)))
        os.chmod(self.remote_shell, 0o755)

    # -- using --------------------------------------------------------------

    def add_aliases(self, host, *names):
        """Makes `names` resolve to `host`'s address on every host (as a
        platform's DNS names its pods): every host's /etc/hosts is one
        file, appended to in place."""
        with open(self._hosts_file, "a") as f:
            f.write(f"{host.address} {' '.join(names)}\n")

    def host(self, name):
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no test host {name!r}; the hosts are {self.names}")

    def launcher_prefix(self):
        """The argv prefix that runs a command on the machine (where the
        launcher's mpiexec runs, reached by the hosts at the bridge address)
        in a mount namespace of its own where the host names resolve to the
        test hosts, from the cluster's hosts file only (no DNS)."""
        mounts = (f"mount --bind {shlex.quote(self._hosts_file)} /etc/hosts"
                  f" && mount --bind {shlex.quote(self._nsswitch)} "
                  "/etc/nsswitch.conf")
        return ["unshare", "--mount", "sh", "-c", mounts + ' && exec "$@"',
                "sh"]

    def run(self, host, argv, check=True, **kw):
        """Runs argv inside `host` and returns its CompletedProcess."""
        return _sh(host.nsenter() + list(argv), check=check, **kw)

    def popen(self, host, argv, **kw):
        """Starts argv inside `host`; returns the Popen (of nsenter)."""
        return subprocess.Popen(host.nsenter() + list(argv), **kw)

    def tx_bytes(self, host):
        """Bytes `host` has sent on its link (its veth's counter)."""
        return self._counter(host, "rx_bytes")

    def rx_bytes(self, host):
        """Bytes `host` has received on its link."""
        return self._counter(host, "tx_bytes")

    def _counter(self, host, name):
        # The machine-side end: what the host sends, it receives.
        with open(f"/sys/class/net/{host.link}/statistics/{name}") as f:
            return int(f.read())

    def shape(self, host, profile):
        """Limits `host`'s link both ways to a PROFILES rate (tc tbf)."""
        if profile not in PROFILES:
            raise ValueError(f"link profile must be one of "
                             f"{sorted(PROFILES)}, got {profile!r}")
        rate, burst, limit = PROFILES[profile]
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "limit", limit]
        self.run(host, ["tc", "qdisc", "replace", "dev", "eth0", *tbf])
        _sh(["tc", "qdisc", "replace", "dev", host.link, *tbf])

    def unshape(self, host):
        self.run(host, ["tc", "qdisc", "del", "dev", "eth0", "root"],
                 check=False)
        _sh(["tc", "qdisc", "del", "dev", host.link, "root"], check=False)

    def drop(self, host):
        """Makes `host` silently drop every packet on its link (nftables)."""
        system.require("nftables")
        self.run(host, ["nft", "-f", "-"], input=host_faults.NFT_DROP)

    def undrop(self, host):
        self.run(host, ["nft", "delete", "table", "inet", "kdt_drop"],
                 check=False)

    def cut(self, host):
        """Takes `host`'s link down."""
        self.run(host, host_faults.LINK_DOWN)

    def restore(self, host):
        self.run(host, ["ip", "link", "set", "eth0", "up"])

    # -- tearing down -------------------------------------------------------

    def close(self):
        """Kills every process in the hosts and removes what was made."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            if host.pid is not None:
                try:
                    os.kill(host.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if host.proc is not None:
                # unshare reaps its child (the init) and then exits itself.
                try:
                    host.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    host.proc.kill()
                    host.proc.wait()
        # A veth goes with its namespace; the bridge does not.
        for name in _links():
            if name.startswith(self.tag):
                _sh(["ip", "link", "del", name], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_on(cluster, np_, hosts, command, timeout=240, ssh_command=None,
           env=None, launcher_args=(), root=None):
    """Runs `kerasdist run -np NP -H HOSTS COMMAND` from the machine, where
    the host names resolve to the test hosts (with the kerasdist package
    under `root`, another build of it, where given; no -H where `hosts` is
    None: a discovery script in `launcher_args` lists them)."""
    args = ["--ssh-command", ssh_command or cluster.remote_shell,
            "--network-interface", cluster.bridge,
            *(["-H", hosts] if hosts is not None else []), *launcher_args]
    return launch(np_, command, timeout=timeout, env=env or worker_env(),
                  launcher_args=args, prefix=cluster.launcher_prefix(),
                  root=root)


def start_sshd(cluster, host, keys):
    """Starts an OpenSSH server on `host` (its address, port 22) with the
    host key and authorized keys in the directory `keys`."""
    config = os.path.join(keys, f"sshd_config.{host.name}")
    with open(config, "w") as f:
        f.write(f"ListenAddress {host.address}:22\n"
                f"HostKey {keys}/host_key\n"
                f"AuthorizedKeysFile {keys}/authorized_keys\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\n"
                "PidFile /run/sshd.pid\n")
    # sshd forks into the background once it listens.
    cluster.run(host, [shutil.which("sshd") or "/usr/sbin/sshd", "-f",
                       config])


class openssh:
    """An OpenSSH server in each host of `cluster`, with a key pair of its
    own in `directory`: `with openssh(cluster, d) as ssh:` gives the
    --ssh-command that reaches them (no host key checks, no password);
    the servers stop on leaving."""

    def __init__(self, cluster, directory):
        self.cluster, self.dir = cluster, str(directory)

    def __enter__(self):
        system.require("openssh-server", "openssh-client")
        keys = self.dir
        os.makedirs(keys, exist_ok=True)
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "",
                            "-f", os.path.join(keys, name)], check=True)
        shutil.copy(os.path.join(keys, "client_key.pub"),
                    os.path.join(keys, "authorized_keys"))
        try:
            for host in self.cluster.hosts:
                start_sshd(self.cluster, host, keys)
        except BaseException:
            self.__exit__()
            raise
        return (f"ssh -i {keys}/client_key -o StrictHostKeyChecking=no "
                "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR")

    def __exit__(self, *exc):
        for host in self.cluster.hosts:
            self.cluster.run(host, ["sh", "-c", "[ -f /run/sshd.pid ] && "
                                    "kill $(cat /run/sshd.pid); true"])
        return False


def processes_in(cluster, host, settle=5.0):
    """The processes (state and command line) alive in `host` but its init
    and this probe, after waiting up to `settle` s for exiting ones (a rank
    ends a moment after the launcher has its exit status)."""
    code = ("import os\n"
            "for p in os.listdir('/proc'):\n"
            "    if not p.isdigit() or int(p) in (1, os.getpid()):\n"
            "        continue\n"
            "    try:\n"
            "        stat = open(f'/proc/{p}/stat').read()\n"
            "        cmd = open(f'/proc/{p}/cmdline').read()\n"
            "    except OSError:\n"
            "        continue\n"
            "    state = stat.rsplit(')', 1)[1].split()[0]\n"
            "    if state != 'Z':\n"
            "        print(state, cmd.replace('\\0', ' '))")
    deadline = time.monotonic() + settle
    while True:
        alive = cluster.run(host, [sys.executable, "-c", code]
                            ).stdout.splitlines()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.25)


# Used as ssh by hydra (`-launcher-exec`): [ssh options] HOST COMMAND...
# runs COMMAND in HOST's namespaces the way sshd would: `sh -c "$*"`.
_REMOTE_SHELL = """\
#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-l|-p|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
# ssh starts the command in a fresh environment: an MPI launcher's own
# variables (Open MPI's prterun sets PMIX_* for itself) must not reach it.
for v in $(env | grep -E '^(PMIX|PRTE|OMPI|OPAL)_\\w*=' | cut -d= -f1); do
  unset "$v"
done
# Open MPI's daemons (and their ranks) keep their session directories in
# TMPDIR, named by PID: the hosts share /tmp and their PIDs repeat, so
# each host's own /dev/shm instead.
case "$*" in
  *prted*|*orted*) export TMPDIR=/dev/shm ;;
esac
case "$host" in
{cases}  *) echo "ssh: Could not resolve hostname $host:" \
          "Name or service not known" >&2
     exit 255 ;;
esac
exec nsenter -t "$pid" {ns} -- sh -c "$*"
"""
