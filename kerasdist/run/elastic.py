"""Which hosts a restart may use: `--min-np` and `--host-discovery-script`.

Before a relaunch the launcher asks every host of the job (or of the
discovery script's list) whether it answers: its remote shell must start a
command there, and that command must open a TCP connection back to this
machine, where mpiexec will wait for the hosts' proxies. A host whose link is
down or silently drops packets fails the second part even when the remote
shell does not need the network. The job then runs on the hosts that answer,
with as many ranks as their slots allow, up to the -np asked for and at
least --min-np. Standard library only.
"""

import fcntl
import os
import selectors
import socket
import struct
import subprocess
import sys
import time

from kerasdist.run import hosts as hosts_lib
from kerasdist.run import remote

_SIOCGIFADDR = 0x8915
PROBE_TIMEOUT_S = 10.0

# Run on each host: connects back to the launcher.
_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_probe.py")


def interface_address(name):
    """The IPv4 address of network interface `name`.

    Raises:
        ValueError: there is no such interface, or it has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ValueError(f"--network-interface {name}: no IPv4 address "
                             f"({e.strerror or e})") from None
    return socket.inet_ntoa(packed[20:24])


def launcher_address(iface=None):
    """The address the hosts reach this machine at (as hydra advertises)."""
    if iface:
        return interface_address(iface)
    return socket.gethostbyname(socket.gethostname())


def answering(hosts, shell, iface=None, timeout=PROBE_TIMEOUT_S):
    """Splits [(host, slots), ...] into those that answer and those that don't.

    Args:
        hosts: the candidate hosts with their slots.
        shell: the remote shell argv, or None when hydra does not use one
            (then every host counts as answering).
        iface: the --network-interface, for this machine's address.
        timeout: seconds for the whole check.

    Returns:
        ([(host, slots), ...] that answer, [(host, reason), ...] that don't),
        both in `hosts` order.
    """
    remote_hosts = [h for h, _ in hosts if not remote.is_local(h)]
    if not remote_hosts or shell is None:
        return list(hosts), []
    address = launcher_address(iface)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        # The probes connect to `address`: no other interface exposes this.
        try:
            listener.bind((address, 0))
        except OSError:  # not this host's (a NAT): every interface
            listener.bind(("0.0.0.0", 0))
        listener.listen(len(remote_hosts))
        command = [sys.executable, "-I", "-S", _PROBE,
                   address, str(listener.getsockname()[1]),
                   str(max(1.0, timeout / 2))]
        failed = dict(remote.check_hosts(remote_hosts, shell, timeout,
                                         command=command))
    return ([(h, s) for h, s in hosts if h not in failed],
            [(h, failed[h]) for h, _ in hosts if h in failed])


def discover(script, timeout=PROBE_TIMEOUT_S):
    """Runs a --host-discovery-script; its output lists the hosts now.

    The script prints hosts in hostfile form (`host:slots` or `host
    slots=N`, one a line) and exits 0, as for Horovod Elastic.

    Raises:
        ValueError: it failed, timed out or printed no valid host list.
    """
    try:
        code, out, err = _run_bounded([script], timeout,
                                      hosts_lib.MAX_HOSTFILE_BYTES)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--host-discovery-script {script}: {e}") from None
    if out is None:
        raise ValueError(f"--host-discovery-script {script} printed more "
                         f"than {hosts_lib.MAX_HOSTFILE_BYTES >> 20} MiB; "
                         f"have it print one 'host:slots' a line")
    if code != 0:
        err = err.decode(errors="replace").strip().splitlines()
        raise ValueError(f"--host-discovery-script {script} exited with code "
                         f"{code}" + (f": {err[-1]}" if err else ""))
    return hosts_lib.parse_hostfile_text(
        out.decode(errors="replace"), f"output of {script}")


def _run_bounded(argv, timeout, most):
    """Runs argv; returns (exit code, stdout, the last `most` bytes of
    stderr), stdout None (the program killed) once it passes `most` bytes.

    Raises:
        OSError: it cannot be started.
        subprocess.TimeoutExpired: it ran past `timeout` (and was killed).
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    end = time.monotonic() + timeout
    with proc, selectors.DefaultSelector() as sel:
        for pipe in got:
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                proc.kill()
                raise subprocess.TimeoutExpired(argv, timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = got[key.fileobj]
                buf += data
                if key.fileobj is proc.stdout and len(buf) > most:
                    proc.kill()
                    return None, None, b""
                del buf[:-most]
        try:
            code = proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return code, bytes(got[proc.stdout]), bytes(got[proc.stderr])


def ranks_for(target_np, min_np, hosts):
    """How many ranks to start on `hosts`: up to target_np, None if fewer
    than min_np fit."""
    np_ = min(target_np, hosts_lib.total_slots(hosts)) if hosts else 0
    return np_ if np_ >= min_np else None
