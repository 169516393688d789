"""A rank's side of the rendezvous: `join(launch, timeout)` meets the other
ranks at the coordinator and returns the variables to put in the
environment before `MPI_Init`.

Rank 0 first starts the server (server.py) as a small process of its own;
then every rank (rank 0 too) says hello to it (`_hello`): the hello is a
barrier with a deadline, so a coordinator that never answers, a rank that
never arrives, a duplicate rank or a size that differs between ranks is
one clear error instead of a hang in `MPI_Init`. The others wait for the
coordinator (retrying the connection) until that same deadline, so it may
start late. The hello's connection then stays open for the server's
report of a rank lost while the job starts (watch.py).

A platform that restarts a failed job (a Kubernetes Job's pods, torchrun's
`--max-restarts`) may start the next run while the previous run's server
is still ending on the same port (it ends once that run's processes are
gone, or 30 s after its rank 0 went): rank 0 then waits for the port, and
a hello that reaches the old server (whose job formed already) is answered
as such and retried, both within the same deadline.
"""

import hmac
import os
import secrets
import socket
import subprocess
import sys
import time

from kerasdist.rendezvous.protocol import FORMED
from kerasdist.rendezvous.protocol import JOB_ID_ENV
from kerasdist.rendezvous.protocol import OTHER_JOB
from kerasdist.rendezvous.protocol import PMI_WATCH_ENV
from kerasdist.rendezvous.protocol import RETRY_S
from kerasdist.rendezvous.protocol import SECRET_ENV
from kerasdist.rendezvous.protocol import TIMEOUT_ENV
from kerasdist.rendezvous.protocol import RendezvousError
from kerasdist.rendezvous.protocol import address_toward
from kerasdist.rendezvous.protocol import identity
from kerasdist.rendezvous.protocol import mac_of
from kerasdist.rendezvous.protocol import node_identity
from kerasdist.rendezvous.protocol import read_line
from kerasdist.rendezvous.protocol import secret_of
from kerasdist.rendezvous.protocol import tokens
from kerasdist.rendezvous.watch import start_watch

# Its message's start where the jobs differ in having a secret.
_NEEDS_SECRET, _HAS_NO_SECRET = "needs-secret:", "no-secret:"
# What a hello that got no answer returns (the server closed, or ended).
_NO_ANSWER = "cmd=kd_ready rc=-1"

# What rank 0 runs as its server: server.py, by path.
_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "server.py")
_server = None  # rank 0's server process, kept for this process's life
_said_unauthenticated = False


def resolve(host, deadline):
    """host's IPv4 address (MPICH's PMI_PORT takes host:port, no IPv6)."""
    while True:
        try:
            return socket.getaddrinfo(host, None, socket.AF_INET,
                                      socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as e:
            # A Kubernetes service's name may resolve only once its pod runs.
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"cannot resolve the coordinator's host {host!r}: {e}")
            time.sleep(RETRY_S)


def connect(address, deadline):
    """(a socket connected to `address`, None), retrying until `deadline`;
    (None, the last error) then."""
    last = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, last
        try:
            return socket.create_connection(address,
                                            timeout=min(left, 5.0)), None
        except OSError as e:
            last = e
        time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))


def start_standby(size, timeout, job, key, address, proven, generation):
    """Starts a standby server of a TCP job at `generation`
    (rendezvous/reform.py) on `address`, any free port; returns (its
    port, its process, which ends once this process closes its stdin, or
    ends, and no rank uses it)."""
    return _start_server(0, size, timeout, job, key, address, proven,
                         standby=generation)


def _start_server(port, size, timeout, job, key, address="",
                  proven=False, standby=None):
    """Starts rank 0's server on `address`:`port` (port 0: any free one;
    address "": every interface); returns the port once it listens. A port
    in use is waited for, up to `timeout`: after a platform restarted the
    job, the server of its previous run may still be ending there. A port
    that another job's server holds is an error at once."""
    global _server
    env = dict(os.environ, _KERASDIST_RENDEZVOUS_KEY=key.hex(),
               _KERASDIST_RENDEZVOUS_JOB=job,
               _KERASDIST_RENDEZVOUS_SECRET="1" if proven else "0")
    if standby is not None:
        env["_KERASDIST_RENDEZVOUS_STANDBY"] = str(standby)
    proc = subprocess.Popen(
        [sys.executable, "-I", _SERVER, "serve",
         str(port), str(size), repr(timeout), address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        close_fds=True, env=env)
    line = proc.stdout.readline().strip()
    if line.startswith("waiting "):
        try:
            _check_holder((address or "127.0.0.1", port), job, key, timeout)
        except RendezvousError:
            proc.kill()
            proc.wait()
            raise
        sys.stderr.write(
            f"kerasdist: rank 0: the coordinator's port {port} is in use; "
            f"waiting up to {timeout:g} s ({TIMEOUT_ENV}) for it to be free "
            f"(the server of an earlier run of this job ends once that "
            f"run's processes have)\n")
        sys.stderr.flush()
        line = proc.stdout.readline().strip()
    if not line.startswith("ready "):
        proc.wait()
        raise RendezvousError(
            f"rank 0 cannot serve the rendezvous on port {port}: "
            f"{line or 'its server ended'}")
    if standby is not None:
        return int(line.split()[1]), proc
    _server = proc  # its stdin stays open while this process lives
    return int(line.split()[1])


def _other_job_line(port, other, job):
    return (f"the coordinator's port {port} serves another job ({other}), "
            f"not this one ({job}); give each job its own port (e.g. "
            f"MASTER_PORT), or a name ({JOB_ID_ENV}) and secret "
            f"({SECRET_ENV}) of its own")


# How long a rank 0 that finds its port held by a live server of its own
# job's id asks again before it calls that a second launch: the rank 0 of
# a run that a platform just restarted may not have ended yet.
_LIVE_GRACE_S = 3.0


def _check_holder(address, job, key, timeout):
    """Rank 0 found its port in use. Returns when the holder is no
    kerasdist server, or an earlier run of this job still ending (the
    caller then waits for the port); raises RendezvousError when it is
    another job's, or another launch of this job (the same id, or none)
    whose rank 0 runs: then that launch is told to end too (kd_conflict),
    and neither forms a job of both."""
    port = address[1]
    until = time.monotonic() + min(_LIVE_GRACE_S, timeout)
    while True:
        other, state = _probe(address, job, key)
        if other is not None:
            raise RendezvousError(_other_job_line(port, other, job))
        if state == "refused":
            raise RendezvousError(_second_launch_line(port, job, True))
        if state != "live":
            return
        if time.monotonic() >= until:
            _probe(address, job, key, conflict=True)
            raise RendezvousError(_second_launch_line(port, job, False))
        time.sleep(RETRY_S)


def _second_launch_line(port, job, refused):
    what = ("refuses two launches of job " + job + " that met there" if
            refused else "serves a running launch of job " + job)
    return (f"rank 0: the coordinator's port {port} {what} (another job "
            f"on this port with the same id, or none): both launches end "
            f"rather than mix; give each job a port of its own "
            f"(MASTER_PORT), or a {JOB_ID_ENV} of its own")


def _other_job_line(port, other, job):
    return (f"the coordinator's port {port} serves another job ({other}), "
            f"not this one ({job}); give each job its own port (e.g. "
            f"MASTER_PORT), or a name ({JOB_ID_ENV}) and secret "
            f"({SECRET_ENV}) of its own")


def _probe(address, job, key, conflict=False):
    """(other, state) of the server that holds `address`: `other`, the id
    of another job (or "job X with another secret"), else None; `state`
    its hello.Hello.state() where it is this job's, else None (also where
    it is no kerasdist server). With `conflict`, tells a server of this
    job that a second launch met it (hello.Hello.on_conflict)."""
    try:
        with socket.create_connection(address, timeout=2.0) as sock:
            sock.settimeout(2.0)
            nonce = secrets.token_hex(16)
            sock.sendall(f"cmd=kd_auth job={job} nonce={nonce}\n".encode())
            t = tokens(read_line(sock))
            if t.get("cmd") != "kd_challenge":
                return None, None
            if t.get("job") != job:
                return f"job {t.get('job')}", None
            if not hmac.compare_digest(
                    t.get("proof", ""),
                    mac_of(key, "server", nonce, t.get("nonce", ""), job)):
                return f"job {job} with another secret", None
            if conflict:
                proof = mac_of(key, "conflict", t.get("nonce", ""), nonce)
                sock.sendall(f"cmd=kd_conflict proof={proof}\n".encode())
                time.sleep(0.2)  # read before the close
            return None, t.get("state")
    except (OSError, ValueError):
        return None, None


def _agent_store(host, port, timeout):
    """torchrun's own key-value store, which its agent serves on
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): there rank 0 cannot
    listen, so it serves on a free port and says which in that store.
    torch is there whenever torchrun is."""
    import datetime

    from torch.distributed import TCPStore
    return TCPStore(host, port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout))


def _is_address(host):
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return host.count(".") == 3


def _can_bind(ip):
    """Whether `ip` is an address of this host (of its network namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def listen_address(launch, host, ip):
    """The address rank 0's server listens on: the one the ranks reach it
    at, so that no other interface of rank 0's host exposes it. `host` is
    the coordinator's host as the platform names it, `ip` what it resolves
    to on rank 0's host.

    A loopback address where every rank is on this host (the coordinator
    is localhost or a loopback literal, or the platform says that all the
    ranks are local); the coordinator's address where it is one of this
    host's; else (a Kubernetes Service's address, a NAT, a host name that
    resolves to loopback here but to the host's address elsewhere) "":
    every interface, as nothing better is known.
    """
    if ip.startswith("127."):
        everyone_here = (launch.local_size is not None and
                         launch.size is not None and
                         launch.local_size >= launch.size)
        if host == "localhost" or _is_address(host) or everyone_here:
            return ip
        return ""
    return ip if _can_bind(ip) else ""


def join(launch, timeout, environ=None, watch=True):
    """Meets the other ranks at `launch.coordinator`.

    Rank 0 first starts the server there (under torchrun's agent store, on
    a free port it publishes in that store). With `watch`, the hello's
    connection stays open for a failure the server reports later (a rank
    missing from MPI_Init's barrier): this process then prints that one
    line and ends (watch.start_watch). Returns {name: value} for the
    environment of MPI_Init (PMI_PORT, PMI_ID, PMI_RANK, PMI_SIZE).

    Raises:
        RendezvousError: the coordinator did not answer, or the ranks did
            not all arrive, within `timeout` seconds; or they disagree.
    """
    environ = os.environ if environ is None else environ
    try:
        job, key, proven = identity(environ)
    except ValueError as e:
        raise RendezvousError(str(e)) from None
    global _said_unauthenticated
    if proven and not environ.get(SECRET_ENV):
        # From KERASDIST_JOB_SECRET_FILE: the core's heartbeat reads it
        # from the environment.
        environ[SECRET_ENV] = secret_of(environ)
    if not proven and launch.rank == 0 and not _said_unauthenticated:
        _said_unauthenticated = True
        sys.stderr.write(
            f"kerasdist: rank 0: the rendezvous is unauthenticated (no "
            f"{SECRET_ENV}): a second job that meets this one on its port "
            f"is refused with it, never merged (job id {job}; "
            f"{JOB_ID_ENV} sets one), but any host that reaches the "
            f"coordinator's port could join or end this job; see "
            f"SECURITY.md\n")
        sys.stderr.flush()
    host, port = launch.coordinator
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    ip = resolve(host, deadline)
    if (launch.convention == "torchrun" and
            environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        entry = (f"kerasdist/pmi/{environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        try:
            store = _agent_store(ip, port, timeout)
            if launch.rank == 0:
                # The ranks reach this server at the address published.
                local = address_toward(ip)
                own = _start_server(0, launch.size, timeout, job, key, local,
                                    proven)
                store.set(entry, f"{local}:{own}")
            ip, _, served = store.get(entry).decode().rpartition(":")
        except RendezvousError:
            raise
        except Exception as e:  # torch's store errors have no common base
            raise RendezvousError(
                f"rank {launch.rank} of {launch.size} could not read rank "
                f"0's address from torchrun's store at {where} within "
                f"{timeout:g} s ({TIMEOUT_ENV}): {e}") from None
        port, where = int(served), f"{ip}:{served}"
    elif launch.rank == 0:
        local = listen_address(launch, host, ip)
        _start_server(port, launch.size, timeout, job, key, local, proven)
    if launch.rank == 0:
        # Its own server, on the address it listens on.
        ip = local or "127.0.0.1"
    kept = []
    while True:
        reply = _hello((ip, port), where, launch, timeout, deadline, job,
                       key, kept, proven)
        if reply.startswith(f"cmd=kd_ready rc={OTHER_JOB} "):
            other = reply.partition(" msg=")[2]
            if other.startswith(_NEEDS_SECRET):
                raise RendezvousError(
                    f"rank {launch.rank} of {launch.size}: the coordinator's "
                    f"port {port} serves job {other[len(_NEEDS_SECRET):]}, "
                    f"which requires the job's secret ({SECRET_ENV}), and "
                    f"this process has none; give every process of the job "
                    f"the same {SECRET_ENV} (a process of another job: give "
                    f"that job a port of its own)")
            if other.startswith(_HAS_NO_SECRET):
                raise RendezvousError(
                    f"rank {launch.rank} of {launch.size}: the coordinator's "
                    f"port {port} serves job {other[len(_HAS_NO_SECRET):]}, "
                    f"which has no secret, and this process has one "
                    f"({SECRET_ENV}); give every process of the job the same "
                    f"{SECRET_ENV} (a process of another job: give that job "
                    f"a port of its own)")
            raise RendezvousError(
                f"rank {launch.rank} of {launch.size}: "
                f"{_other_job_line(port, other, job)}")
        # A server whose job formed without this process, or one that
        # closes without an answer: the previous run of a job that a
        # platform restarted, still ending. Its successor listens once it
        # has gone.
        stale = reply.startswith(f"cmd=kd_ready rc={FORMED} ")
        if not (stale or reply.startswith(_NO_ANSWER)):
            break
        if time.monotonic() >= deadline:
            what = ("still served a job that had formed without this "
                    "process" if stale else "did not answer the hello")
            raise RendezvousError(
                f"rank {launch.rank} of {launch.size}: the coordinator at "
                f"{where} {what} after {timeout:g} s ({TIMEOUT_ENV}): "
                f"{reply.partition(' msg=')[2]}")
        time.sleep(RETRY_S)
    if not reply.startswith("cmd=kd_ready rc=0 "):
        msg = reply.partition(" msg=")[2]
        raise RendezvousError(f"rank {launch.rank} of {launch.size}: {msg}")
    variables = {}
    if kept and watch:
        start_watch(*kept[-1], launch)
        # The core learns from this connection's end that the server has
        # gone, and then skips MPI_Finalize (whose PMI barrier would crash
        # MPICH): a copy of its descriptor that nothing here closes.
        variables[PMI_WATCH_ENV] = str(os.dup(kept[-1][0].fileno()))
    for sock, *_ in kept[:-1] if watch else kept:
        sock.close()
    # MPICH's client proves itself to the server with PMI_ID, the one-time
    # number the server gave this rank.
    pmiid = tokens(reply).get("pmiid", "")
    variables.update({"PMI_PORT": f"{ip}:{port}", "PMI_ID": pmiid,
                      "PMI_RANK": str(launch.rank),
                      "PMI_SIZE": str(launch.size)})
    return variables


def _hello(address, where, launch, timeout, deadline, job, key, keep=None,
           proven=None):
    """Connects (retrying until `deadline`), proves the job's secret, says
    hello; returns the server's reply line once its proof is checked. A
    connection whose hello formed the job is left open and added to
    `keep` (a list) as (socket, check of the server's later lines,
    signer of this process's later lines)."""
    sock, error = connect(address, deadline)
    if sock is None:
        raise RendezvousError(
            f"rank {launch.rank} of {launch.size} found no coordinator at "
            f"{where} within {timeout:g} s ({TIMEOUT_ENV}; last error: "
            f"{error}); check that rank 0 runs, that this host reaches "
            f"{where}, and that every process has the same coordinator.")
    try:
        sock.settimeout(max(1.0, deadline - time.monotonic()) + 10.0)
        nonce, theirs = auth(sock, where, job, key, proven)
        if theirs is None:
            return nonce  # the server's refusal, as a reply line
        # The node this process is on (node_identity): the server tells
        # MPI which ranks share one from these.
        node = node_identity()
        proof = mac_of(key, "hello", theirs, nonce, launch.rank,
                       launch.size, node)
        sock.sendall(f"cmd=kd_hello rank={launch.rank} size={launch.size} "
                     f"node={node} proof={proof}\n".encode())
        reply = read_line(sock)
        if not reply:
            return (f"{_NO_ANSWER} msg=the coordinator at {where} closed "
                    f"the connection")
        def check(body, mac):
            return hmac.compare_digest(mac, mac_of(key, "ready", nonce,
                                                   theirs, body))

        def sign(line):
            return f"{line} mac={mac_of(key, 'up', nonce, theirs, line)}"

        body, _, mac = reply.rpartition(" mac=")
        if not check(body, mac):
            return (f"{_NO_ANSWER} msg=the coordinator at {where} answered "
                    f"without proving the job's secret")
        if keep is not None and body.startswith("cmd=kd_ready rc=0 "):
            keep.append((sock, check, sign))
            sock = None
        return body
    except (OSError, ValueError) as e:
        return (f"{_NO_ANSWER} msg=the coordinator at {where} stopped "
                f"answering ({e})")
    finally:
        if sock is not None:
            sock.close()


def auth(sock, where, job, key, proven):
    """Proves the job's secret to the server on `sock` and checks its
    proof: (this side's nonce, the server's), or (a reply line saying why
    not, None)."""
    nonce = secrets.token_hex(16)
    sock.sendall(f"cmd=kd_auth job={job} nonce={nonce}\n".encode())
    t = tokens(read_line(sock))
    if t.get("cmd") != "kd_challenge":
        return (f"{_NO_ANSWER} msg=the coordinator at {where} did not "
                f"answer as a kerasdist rendezvous"), None
    # A server that says whether its job has a secret (secret=1/0):
    # where this process differs, that is the error to name.
    theirs_proven = t.get("secret")
    if proven is not None and theirs_proven == str(int(not proven)):
        why = _HAS_NO_SECRET if proven else _NEEDS_SECRET
        return f"cmd=kd_ready rc={OTHER_JOB} msg={why}{t.get('job')}", None
    if t.get("rc") == str(OTHER_JOB) or t.get("job") != job:
        return f"cmd=kd_ready rc={OTHER_JOB} msg=job {t.get('job')}", None
    theirs = t.get("nonce", "")
    if not hmac.compare_digest(t.get("proof", ""),
                               mac_of(key, "server", nonce, theirs, job)):
        return (f"cmd=kd_ready rc={OTHER_JOB} msg=job {job} with another "
                f"secret ({SECRET_ENV} differs)"), None
    return nonce, theirs


# --------------------------------------------------------------- server
