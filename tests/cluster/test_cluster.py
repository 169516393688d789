"""The test cluster itself: hosts that share nothing but the kernel, a link
whose counters see the traffic, shaping, silent drop, cut and restore, and
nothing left behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import system
from tests.support.cluster import Cluster
from tests.support.cluster import _anchor_pids
from tests.support.cluster import _links
from tests.support.cluster import remove_leftovers
from tests.support.cluster import require

pytestmark = pytest.mark.cluster

NAMESPACES = ("net", "uts", "ipc", "mnt", "pid")


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        yield c


def _py(cluster, host, code, **kw):
    return cluster.run(host, [sys.executable, "-c", code], **kw)


def test_hosts_share_no_namespace_and_have_their_own_files(cluster):
    h0, h1 = cluster.hosts
    ns = {}
    for who, prefix in (("machine", []), ("kdt0", h0.nsenter()),
                        ("kdt1", h1.nsenter())):
        out = subprocess.run(
            prefix + ["sh", "-c", " ".join(
                f"readlink /proc/self/ns/{n};" for n in NAMESPACES)],
            capture_output=True, text=True, check=True).stdout.split()
        ns[who] = dict(zip(NAMESPACES, out))
    for n in NAMESPACES:
        values = {who: ns[who][n] for who in ns}
        assert len(set(values.values())) == 3, f"{n} shared: {values}"

    assert cluster.run(h0, ["hostname"]).stdout.strip() == "kdt0"
    assert cluster.run(h1, ["hostname"]).stdout.strip() == "kdt1"
    hosts = cluster.run(h0, ["cat", "/etc/hosts"]).stdout
    assert f"{h1.address} kdt1" in hosts and f"{h0.address} kdt0" in hosts
    with open("/etc/hosts") as f:
        assert "kdt1" not in f.read()  # the machine's file is untouched
    # /dev/shm is each host's own.
    name = f"kdt-shm-probe-{os.getpid()}"
    cluster.run(h0, ["sh", "-c", f"echo x > /dev/shm/{name}"])
    assert not os.path.exists(f"/dev/shm/{name}")
    assert cluster.run(h1, ["test", "-e", f"/dev/shm/{name}"],
                       check=False).returncode == 1
    # Nothing routes out: the bridge's /24 only.
    routes = cluster.run(h0, ["ip", "-4", "route"]).stdout.splitlines()
    assert len(routes) == 1 and routes[0].startswith(
        cluster.address.rsplit(".", 1)[0]), routes


def _serve(cluster, host, port, nbytes):
    code = ("import socket\n"
            "s = socket.socket(); s.bind(('0.0.0.0', %d)); s.listen()\n"
            "print('ready', flush=True)\n"
            "c, _ = s.accept(); got = 0\n"
            "while got < %d:\n"
            "    b = c.recv(1 << 20)\n"
            "    if not b: break\n"
            "    got += len(b)\n"
            "print(got, flush=True)\n" % (port, nbytes))
    proc = cluster.popen(host, [sys.executable, "-c", code],
                         stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _send(cluster, host, to, port, nbytes, timeout=10.0):
    code = ("import socket\n"
            "s = socket.create_connection(('%s', %d), timeout=%g)\n"
            "s.sendall(b'x' * %d); s.close()\n" % (to, port, timeout, nbytes))
    return _py(cluster, host, code, check=False, timeout=timeout + 20)


def test_data_between_hosts_crosses_the_veth(cluster):
    h0, h1 = cluster.hosts
    payload = 8 << 20
    server = _serve(cluster, h1, 5001, payload)
    sent0, got1 = cluster.tx_bytes(h0), cluster.rx_bytes(h1)
    assert _send(cluster, h0, "kdt1", 5001, payload).returncode == 0
    assert int(server.stdout.readline()) == payload
    server.wait(timeout=10)
    assert cluster.tx_bytes(h0) - sent0 >= payload
    assert cluster.rx_bytes(h1) - got1 >= payload


def test_shape_puts_a_rate_limit_on_both_ends(cluster):
    h0 = cluster.hosts[0]
    for profile, shown in (("1gbit", "1Gbit"), ("10gbit", "10Gbit")):
        cluster.shape(h0, profile)
        inside = cluster.run(h0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        outside = subprocess.run(["tc", "qdisc", "show", "dev", h0.link],
                                 capture_output=True, text=True).stdout
        for where in (inside, outside):
            assert "tbf" in where and f"rate {shown}" in where, where
    cluster.unshape(h0)
    assert "tbf" not in cluster.run(h0, ["tc", "qdisc", "show", "dev",
                                         "eth0"]).stdout
    with pytest.raises(ValueError, match="one of"):
        cluster.shape(h0, "56k")


def _connects(cluster, host, to, port, timeout):
    code = ("import socket, sys\n"
            "try:\n"
            "    socket.create_connection(('%s', %d), timeout=%g)\n"
            "except socket.timeout:\n"
            "    sys.exit('timeout')\n"
            "except OSError as e:\n"
            "    sys.exit(type(e).__name__)\n" % (to, port, timeout))
    out = _py(cluster, host, code, check=False, timeout=timeout + 20)
    return "ok" if out.returncode == 0 else out.stderr.strip()


def test_drop_is_silent_and_cut_is_restored(cluster):
    system.require("nftables")
    h0, h1 = cluster.hosts
    # The server listens until its stdin closes, so that the test ends it
    # and waits for it (nsenter waits for its child) rather than leaving a
    # SIGKILLed process still exiting when the test ends.
    server = cluster.popen(h1, [sys.executable, "-c",
                                "import socket, sys\n"
                                "s = socket.socket()\n"
                                "s.bind(('0.0.0.0', 5002)); s.listen(16)\n"
                                "sys.stdin.read()"],
                           stdin=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(lambda: _connects(cluster, h0, "kdt1", 5002, 2) == "ok")
        cluster.drop(h1)
        # Silent: no reset, no ICMP; the connection attempt just times out.
        assert _connects(cluster, h0, "kdt1", 5002, 1.5) == "timeout"
        cluster.undrop(h1)
        assert _connects(cluster, h0, "kdt1", 5002, 2) == "ok"
        cluster.cut(h0)
        assert _connects(cluster, h0, "kdt1", 5002, 2) != "ok"
        cluster.restore(h0)
        _wait_for(lambda: _connects(cluster, h0, "kdt1", 5002, 2) == "ok")
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            # nsenter forks the server into the host's PID namespace: end
            # the group (nsenter and the server), not nsenter alone.
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _gone(pid):
    """No such process, or only its zombie (under a subreaper such as the
    test session, an orphan that died stays a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


_OWNER = """
import sys, time
sys.path.insert(0, %r)
from tests.support.cluster import Cluster
c = Cluster(2)
print(c.tag, c.hosts[0].pid, c.hosts[1].pid, flush=True)
time.sleep(120)
"""


def test_a_killed_owner_leaves_nothing_that_the_next_cluster_keeps():
    require()
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    owner = subprocess.Popen([sys.executable, "-c", _OWNER % root],
                             stdout=subprocess.PIPE, text=True)
    try:
        tag, *anchors = owner.stdout.readline().split()
        assert any(name.startswith(tag) for name in _links())
        owner.send_signal(signal.SIGKILL)  # no finally, no atexit
        owner.wait(timeout=10)
        # The hosts die with their owner (parent-death signal)...
        _wait_for(lambda: all(_gone(p) for p in anchors))
        # ...and the bridge it left is removed by the next cluster.
        assert any(name.startswith(tag) for name in _links())
        removed = remove_leftovers()
        assert f"{tag}b" in removed, removed
        assert not any(name.startswith(tag) for name in _links())
        assert not [p for p, o in _anchor_pids().items() if o == owner.pid]
    finally:
        owner.kill()
        owner.wait()


def test_close_removes_hosts_links_and_files():
    require()
    c = Cluster(2)
    made = [c.bridge] + [h.link for h in c.hosts]
    pids = [h.pid for h in c.hosts]
    sleeper = c.popen(c.hosts[0], ["sleep", "60"])
    c.close()
    sleeper.wait(timeout=10)
    assert not set(made) & set(_links())
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)
    assert not os.path.exists(c.dir)
    assert not set(pids) & set(_anchor_pids())
