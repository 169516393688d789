"""Forms one MPI job from processes that someone else started.

A platform (torchrun, Kubernetes, Keras' distribution variables) starts N
processes and tells each its rank, N and a coordinator's host:port
(kerasdist/run/conventions.py). MPI cannot join such processes by itself:
started without a launcher, each would be a job of one. What a launcher
gives MPICH is a PMI server; MPICH's client speaks the simple PMI-1 wire
protocol to it (one line per command) when it finds `PMI_PORT=host:port`
and `PMI_ID` in its environment at `MPI_Init`: it learns its rank and size,
publishes its address ("business card") with `put`, meets the others at
`barrier_in`, reads their cards with `get`, and at `MPI_Finalize` meets
them once more. The data itself then moves over MPI's own transports
(shared memory within a host, its network module across hosts); the PMI
server only relays those few small key-value pairs.

So rank 0 starts that server, here, as a small process of its own
(`python rendezvous.py serve ...`, standard library only, nothing else of
kerasdist imported): it listens on the coordinator's port, and serves until
every rank's MPI has finalized or gone (or, after rank 0 itself has gone,
for a short grace). Before MPI starts, every rank (rank 0 too) says hello
to it: the hello is a barrier with a deadline, so a coordinator that never
answers, a rank that never arrives, a duplicate rank or a size that
differs between ranks is one clear error instead of a hang in `MPI_Init`.
The others wait for the coordinator (retrying the connection) until that
same deadline, so it may start late.

The hello also names the rank's node (`node_identity`: the host name and
what shared memory needs in common, so that two containers given one host
name are two nodes), and the server answers MPICH's PMI_process_mapping
from them (`process_mapping`): MPICH shares memory only within a node.
Each rank's hello connection stays open: through it the server ends every
rank with one line when the job cannot start. One such case is a rank
whose MPI's PMI connection closes without MPI_Finalize before every rank
has said that its kd.init() finished (`started`): past MPI_Init's PMI
exchange the others would wait for it for ever, and the heartbeat that
reports a lost rank later (ops/core/control/liveness.cc) starts only in
init, after MPI_Init.

A platform that restarts a failed job (a Kubernetes Job's pods, torchrun's
`--max-restarts`) may start the next run while the previous run's server
is still ending on the same port (it ends once that run's processes are
gone, or 30 s after its rank 0 went): rank 0 then waits for the port, and
a hello that reaches the old server (whose job formed already) is answered
as such and retried, both within the same deadline.

`join(launch, timeout)` does the client side and returns the variables to
put in the environment before `MPI_Init`.

Over 500 lines: the launcher runs it by path as a standalone server (`python -I
rendezvous.py serve`), so the server and the client speaking its one wire
protocol live in one file that imports nothing of kerasdist.
"""

import errno
import hashlib
import hmac
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

TIMEOUT_ENV = "KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 300.0
# The job's secret (docs/platforms.md, "The control plane's secret"): every
# connection to the rendezvous proves it before anything it says counts.
SECRET_ENV = "KERASDIST_JOB_SECRET"
# The job's name, where the platform gives none of its own (below).
JOB_ID_ENV = "KERASDIST_JOB_ID"
MIN_SECRET_CHARS = 16
# The platforms' own names of a job, first found wins: two jobs on one
# coordinator's port are told apart by it even without a secret.
_JOB_ID_VARIABLES = (JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                     "TRAINING_JOB_NAME", "JOB_NAME")
# After rank 0 has gone: how long the server still serves the other ranks'
# finalize (they are a barrier's reply away from it).
_GRACE_S = 30.0
# A rank's hello closed while its MPI's connection is open: how long the
# server waits for that one to close too (the same death), to say the rank
# died inside MPI_Init rather than before its MPI started.
_HELLO_BEFORE_MPI_S = 2.0
_RETRY_S = 0.25
# The hello's reply code of a server whose job has formed (or failed) already:
# the hello came too late for it, and may be meant for the next one.
_FORMED = 2
# The reply code of a server of another job.
_OTHER_JOB = 3
# Its message's start where the jobs differ in having a secret.
_NEEDS_SECRET, _HAS_NO_SECRET = "needs-secret:", "no-secret:"
# What a hello that got no answer returns (the server closed, or ended).
_NO_ANSWER = "cmd=kd_ready rc=-1"
# The variables MPICH's PMI-1 client reads at MPI_Init.
PMI_VARIABLES = ("PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE")
# For MPI_Init too: the descriptor of this process's connection to the
# server (ops/core/transport/mpi_context.cc).
PMI_WATCH_ENV = "_KERASDIST_PMI_WATCH_FD"
# Bounds on what any connection may send or hold (hostile input): a line
# (MPICH's longest is a put of a 1024-byte value), the seconds a connection
# has to prove the secret, the connections that have not proved it yet (the
# oldest is dropped for a new one), the keys one rank may put.
MAX_LINE = 4096
AUTH_DEADLINE_S = 5.0
MAX_UNPROVEN = 64
MAX_KEYS_PER_RANK = 1024
_KEY_MAX, _VALUE_MAX = 64, 1024
# The exit code of a rank that ends because it lost another (the heartbeat's,
# ops/core/control/liveness.cc): the launcher reads the rank's "lost" line.
EXIT_PEER_LOST = 75
# The key under which MPICH asks its process manager which ranks share a
# node (PMI_process_mapping); the server answers it from the hellos.
PROCESS_MAPPING_KEY = "PMI_process_mapping"
# A node identity's parts in the hello: the host name's first characters,
# and a digest of what a node's shared memory needs in common.
_HOST_CHARS, _NODE_MAX = 64, 96

_server = None  # rank 0's server process, kept for this process's life
_said_unauthenticated = False


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message says who and what to do."""


def timeout_from(environ):
    """Seconds from KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS (default 300)."""
    text = environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a positive number "
                         f"of seconds; set it to e.g. 300.")
    return value


def identity(environ):
    """(job id, key, authenticated) of this process's job.

    The key is what every message's HMAC is made with: the job's secret
    (KERASDIST_JOB_SECRET) where there is one; else one made from the job
    id alone, which keeps jobs apart but proves nothing (anyone can compute
    it). The job id is KERASDIST_JOB_ID or the platform's name of the job
    (torchrun's run id, Slurm's job id, ...); with a secret and no name,
    the secret's fingerprint; else "unnamed".
    """
    secret = environ.get(SECRET_ENV, "")
    if secret and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{SECRET_ENV} has {len(secret)} characters, fewer than "
            f"{MIN_SECRET_CHARS}; set it to a random string, e.g. the "
            f"output of `python -c 'import secrets; "
            f"print(secrets.token_hex(32))'`.")
    job = ""
    for name in _JOB_ID_VARIABLES:
        job = environ.get(name, "").strip()
        if job:
            break
    if secret:
        job = job or "s-" + hashlib.sha256(
            b"kerasdist job id|" + secret.encode()).hexdigest()[:12]
        key = hashlib.sha256(b"kerasdist key|" + secret.encode()).digest()
    else:
        job = job or "unnamed"
        key = hashlib.sha256(b"kerasdist unauthenticated|" +
                             job.encode()).digest()
    # The id travels in protocol lines: no spaces, bounded.
    job = "".join(c if c.isalnum() or c in "-_.:" else "_"
                  for c in job)[:128]
    return job, key, bool(secret)


def _mac(key, *parts):
    return hmac.new(key, "|".join(map(str, parts)).encode(),
                    hashlib.sha256).hexdigest()


def _ns_id(path):
    """"device:inode" of `path` (a namespace's /proc/self/ns entry, a
    directory); "" where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def node_identity():
    """Which node this process is on, as MPI's shared memory needs it:
    "HOST/DIGEST", the host name and a digest of what two processes need
    in common to share memory: one kernel (its boot id), one IPC namespace
    (System V segments), one PID namespace (MPICH's and kerasdist's
    single-copy transfers name a peer by its pid) and one /dev/shm (where
    MPICH's segments are files). Two containers given one host name differ
    in these, so their ranks are different nodes to MPI (which then uses
    its network between them) instead of waiting for each other's shared
    memory. Where /proc is not readable, the host name decides alone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    parts = [boot] + [_ns_id(p) for p in ("/proc/self/ns/ipc",
                                          "/proc/self/ns/pid", "/dev/shm")]
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-_." else "_"
                   for c in socket.gethostname())[:_HOST_CHARS]
    return f"{host or 'unknown'}/{digest}"


# --------------------------------------------------------------- client


def _resolve(host, deadline):
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
            time.sleep(_RETRY_S)


def _connect(address, deadline):
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
        time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


def _start_server(port, size, timeout, job, key, address="",
                  proven=False):
    """Starts rank 0's server on `address`:`port` (port 0: any free one;
    address "": every interface); returns the port once it listens. A port
    in use is waited for, up to `timeout`: after a platform restarted the
    job, the server of its previous run may still be ending there. A port
    that another job's server holds is an error at once."""
    global _server
    env = dict(os.environ, _KERASDIST_RENDEZVOUS_KEY=key.hex(),
               _KERASDIST_RENDEZVOUS_JOB=job,
               _KERASDIST_RENDEZVOUS_SECRET="1" if proven else "0")
    proc = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), "serve",
         str(port), str(size), repr(timeout), address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        close_fds=True, env=env)
    line = proc.stdout.readline().strip()
    if line.startswith("waiting "):
        other = _whose((address or "127.0.0.1", port), job, key)
        if other is not None:
            proc.kill()
            proc.wait()
            raise RendezvousError(_other_job_line(port, other, job))
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
    _server = proc  # its stdin stays open while this process lives
    return int(line.split()[1])


def _other_job_line(port, other, job):
    return (f"the coordinator's port {port} serves another job ({other}), "
            f"not this one ({job}); give each job its own port (e.g. "
            f"MASTER_PORT), or a name ({JOB_ID_ENV}) and secret "
            f"({SECRET_ENV}) of its own")


def _whose(address, job, key):
    """The id of another job whose server holds `address` (or "another
    secret"); None when it is this job's (an earlier run's) or not a
    kerasdist server."""
    try:
        with socket.create_connection(address, timeout=2.0) as sock:
            sock.settimeout(2.0)
            nonce = secrets.token_hex(16)
            sock.sendall(f"cmd=kd_auth job={job} nonce={nonce}\n".encode())
            t = _tokens(_read_line(sock))
    except (OSError, ValueError):
        return None
    if t.get("cmd") != "kd_challenge":
        return None
    if t.get("job") != job:
        return f"job {t.get('job')}"
    if not hmac.compare_digest(
            t.get("proof", ""),
            _mac(key, "server", nonce, t.get("nonce", ""), job)):
        return f"job {job} with another secret"
    return None


def _read_line(sock, limit=MAX_LINE):
    """One line from `sock` (without its newline), at most `limit` bytes;
    "" when it closed first. Reads byte-wise past nothing: what follows the
    line stays in the socket."""
    data = bytearray()
    while len(data) <= limit:
        c = sock.recv(1)
        if not c:
            return ""
        if c == b"\n":
            return data.decode(errors="replace")
        data += c
    raise ValueError("line too long")


def _agent_store(host, port, timeout):
    """torchrun's own key-value store, which its agent serves on
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): there rank 0 cannot
    listen, so it serves on a free port and says which in that store.
    torch is there whenever torchrun is."""
    import datetime

    from torch.distributed import TCPStore
    return TCPStore(host, port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout))


def _address_toward(ip):
    """This host's address on the route to `ip`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


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
    line and ends (_start_watch). Returns {name: value} for the
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
    if not proven and launch.rank == 0 and not _said_unauthenticated:
        _said_unauthenticated = True
        sys.stderr.write(
            f"kerasdist: rank 0: the rendezvous is unauthenticated (no "
            f"{SECRET_ENV}): jobs on one port are kept apart by their name "
            f"({job}; {JOB_ID_ENV} sets one), but any host that reaches "
            f"the coordinator's port could disturb this job; see "
            f"SECURITY.md\n")
        sys.stderr.flush()
    host, port = launch.coordinator
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    ip = _resolve(host, deadline)
    if (launch.convention == "torchrun" and
            environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        entry = (f"kerasdist/pmi/{environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        try:
            store = _agent_store(ip, port, timeout)
            if launch.rank == 0:
                # The ranks reach this server at the address published.
                local = _address_toward(ip)
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
        if reply.startswith(f"cmd=kd_ready rc={_OTHER_JOB} "):
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
        stale = reply.startswith(f"cmd=kd_ready rc={_FORMED} ")
        if not (stale or reply.startswith(_NO_ANSWER)):
            break
        if time.monotonic() >= deadline:
            what = ("still served a job that had formed without this "
                    "process" if stale else "did not answer the hello")
            raise RendezvousError(
                f"rank {launch.rank} of {launch.size}: the coordinator at "
                f"{where} {what} after {timeout:g} s ({TIMEOUT_ENV}): "
                f"{reply.partition(' msg=')[2]}")
        time.sleep(_RETRY_S)
    if not reply.startswith("cmd=kd_ready rc=0 "):
        msg = reply.partition(" msg=")[2]
        raise RendezvousError(f"rank {launch.rank} of {launch.size}: {msg}")
    variables = {}
    if kept and watch:
        _start_watch(*kept[-1], launch)
        # The core learns from this connection's end that the server has
        # gone, and then skips MPI_Finalize (whose PMI barrier would crash
        # MPICH): a copy of its descriptor that nothing here closes.
        variables[PMI_WATCH_ENV] = str(os.dup(kept[-1][0].fileno()))
    for sock, *_ in kept[:-1] if watch else kept:
        sock.close()
    # MPICH's client proves itself to the server with PMI_ID, the one-time
    # number the server gave this rank.
    pmiid = _tokens(reply).get("pmiid", "")
    variables.update({"PMI_PORT": f"{ip}:{port}", "PMI_ID": pmiid,
                      "PMI_RANK": str(launch.rank),
                      "PMI_SIZE": str(launch.size)})
    return variables


_watching = []  # (the hello's connection, its signer), kept for life


def _start_watch(sock, check, sign, launch):
    """Keeps the hello's connection open: if the server ends the job's MPI
    start (a rank missing from MPI's barrier, or a rank's process gone
    while the job starts), it says so here, and this rank prints that one
    line and ends instead of waiting in MPI_Init (MPI's own error says
    nothing of who is missing; inside MPI_Init, past its PMI exchange,
    MPI says nothing at all and waits for ever). The server's line gives
    the exit code where it is not 1: EXIT_PEER_LOST, with the heartbeat's
    line ("kerasdist: rank 0: lost rank 1 ...; ending this rank.")."""
    sock.settimeout(None)
    _watching.append((sock, sign))
    # The server now knows that this connection lasts as long as this
    # process: its end before kd_up is this process's end.
    try:
        sock.sendall((sign("cmd=kd_watch") + "\n").encode())
    except OSError:
        pass

    def watch():
        try:
            line = _read_line(sock)
        except (OSError, ValueError):
            return
        body, _, mac = line.rpartition(" mac=")
        if body.startswith("cmd=kd_fail ") and check(body, mac):
            head, _, msg = body.partition(" msg=")
            code = _tokens(head).get("code", "")
            if code.isdigit() and 0 < int(code) < 256:
                status, who = int(code), f"rank {launch.rank}"
            else:
                status, who = 1, f"rank {launch.rank} of {launch.size}"
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.write(2, f"kerasdist: {who}: {msg}\n".encode(
                errors="replace"))
            os._exit(status)

    threading.Thread(target=watch, daemon=True,
                     name="kerasdist-rendezvous-watch").start()


def started():
    """Tells rank 0's server that this rank's `kd.init()` has finished:
    from here on its heartbeat (which init started, every rank connected)
    reports a rank that ends, so the server stops doing so once every rank
    has said this. Until then a rank whose process ends (its MPI's PMI
    connection closes without MPI_Finalize) ends the others with one line
    naming it: they would wait for it inside MPI_Init, or in init's first
    collectives, for ever. Nothing where this process met no coordinator,
    or the server has gone."""
    for sock, sign in _watching:
        try:
            sock.sendall((sign("cmd=kd_up") + "\n").encode())
        except OSError:
            pass


def _hello(address, where, launch, timeout, deadline, job, key, keep=None,
           proven=None):
    """Connects (retrying until `deadline`), proves the job's secret, says
    hello; returns the server's reply line once its proof is checked. A
    connection whose hello formed the job is left open and added to
    `keep` (a list) as (socket, check of the server's later lines,
    signer of this process's later lines)."""
    sock, error = _connect(address, deadline)
    if sock is None:
        raise RendezvousError(
            f"rank {launch.rank} of {launch.size} found no coordinator at "
            f"{where} within {timeout:g} s ({TIMEOUT_ENV}; last error: "
            f"{error}); check that rank 0 runs, that this host reaches "
            f"{where}, and that every process has the same coordinator.")
    try:
        sock.settimeout(max(1.0, deadline - time.monotonic()) + 10.0)
        nonce = secrets.token_hex(16)
        sock.sendall(f"cmd=kd_auth job={job} nonce={nonce}\n".encode())
        t = _tokens(_read_line(sock))
        if t.get("cmd") != "kd_challenge":
            return (f"{_NO_ANSWER} msg=the coordinator at {where} did not "
                    f"answer as a kerasdist rendezvous")
        # A server that says whether its job has a secret (secret=1/0):
        # where this process differs, that is the error to name.
        theirs_proven = t.get("secret")
        if proven is not None and theirs_proven == str(int(not proven)):
            why = _HAS_NO_SECRET if proven else _NEEDS_SECRET
            return (f"cmd=kd_ready rc={_OTHER_JOB} msg={why}"
                    f"{t.get('job')}")
        if t.get("rc") == str(_OTHER_JOB) or t.get("job") != job:
            return f"cmd=kd_ready rc={_OTHER_JOB} msg=job {t.get('job')}"
        theirs = t.get("nonce", "")
        if not hmac.compare_digest(t.get("proof", ""),
                                   _mac(key, "server", nonce, theirs, job)):
            return (f"cmd=kd_ready rc={_OTHER_JOB} msg=job {job} with "
                    f"another secret ({SECRET_ENV} differs)")
        # The node this process is on (node_identity): the server tells
        # MPI which ranks share one from these.
        node = node_identity()
        proof = _mac(key, "hello", theirs, nonce, launch.rank, launch.size,
                     node)
        sock.sendall(f"cmd=kd_hello rank={launch.rank} size={launch.size} "
                     f"node={node} proof={proof}\n".encode())
        reply = _read_line(sock)
        if not reply:
            return (f"{_NO_ANSWER} msg=the coordinator at {where} closed "
                    f"the connection")
        def check(body, mac):
            return hmac.compare_digest(mac, _mac(key, "ready", nonce, theirs,
                                                 body))

        def sign(line):
            return f"{line} mac={_mac(key, 'up', nonce, theirs, line)}"

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


# --------------------------------------------------------------- server


def _tokens(line):
    """{key: raw value} of one PMI-1 line ("cmd=put key=k value=v")."""
    out, cur, i = {}, [], 0
    parts = []
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):  # escaped (a space, a \)
            cur.append(line[i:i + 2])
            i += 2
            continue
        if c == " ":
            if cur:
                parts.append("".join(cur))
                cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        parts.append("".join(cur))
    for p in parts:
        key, _, value = p.partition("=")
        out[key] = value
    return out


class _Conn:
    """One connection: what it has proved, and which rank it is."""

    def __init__(self, sock):
        self.sock = sock
        self.since = time.monotonic()
        self.nonce = None    # the server's challenge, once asked
        self.theirs = None   # the client's nonce
        self.proven = False  # proved the secret (hello) or a PMI_ID (PMI)
        self.rank = None     # a PMI connection's rank
        self.hello_rank = None
        self.node = ""       # the node its hello named (node_identity)
        self.watching = False  # a hello's, open for its process's life
        self.dropped = False

    def drop(self):
        """Ends the connection; its reading thread sees the end at once
        (close() alone would not wake a thread blocked reading it)."""
        self.dropped = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Bad(Exception):
    """A connection broke the protocol: it is dropped, the job goes on."""


class _Server:
    def __init__(self, size, timeout, job="unnamed", key=b"", secret=False):
        self.size = size
        self.timeout = timeout
        self.job = job
        self.secret = secret
        self.key = key or identity({})[1]
        self.kvsname = f"kerasdist_{os.getpid()}_{int(time.time())}"
        self.cv = threading.Condition()
        self.hello = {}        # rank -> _Conn, until all have come
        self.hello_done = False
        self.tokens = {}       # PMI_ID -> rank, once formed, until used
        self.kvs = {}
        self.keys_of = {}      # rank -> keys it put
        self.barrier = {}      # rank -> _Conn waiting in barrier_in
        self.barrier_since = None
        self.pmi = {}          # rank -> _Conn of its MPI, while open
        self.pmi_seen = set()  # ranks whose MPI ever connected
        self.pmi_done = set()  # ranks whose MPI finalized or went
        self.dead = set()      # ranks whose MPI went without finalizing
        self.watchers = {}     # rank -> its hello's _Conn, once formed
        self.up = set()        # ranks whose kd.init() finished (kd_up)
        self.hello_gone = {}   # rank -> when its hello closed, MPI's open
        self.nodes = []        # rank -> its node's host name, once formed
        self.mapping = None    # PMI_process_mapping, once formed
        self.conns = set()
        self.parent_gone_at = None
        self.started = time.monotonic()
        self.formed_at = None  # when every rank had said hello
        self.failed = False

    # Who may talk: a hello proves the secret first (kd_auth, a challenge,
    # an HMAC); MPICH's client, which cannot, proves the one-time PMI_ID
    # this server gave its rank in the hello's reply.
    def on_auth(self, conn, t):
        job = t.get("job", "")
        # secret=: whether this job has one, so that a rank that differs
        # hears that rather than "another job" (it proves nothing: the
        # proof below does).
        if job != self.job:
            self._send(conn, f"cmd=kd_challenge rc={_OTHER_JOB} "
                       f"job={self.job} secret={int(self.secret)}")
            raise _Bad("another job")
        conn.theirs = t.get("nonce", "")[:64]
        conn.nonce = secrets.token_hex(16)
        proof = _mac(self.key, "server", conn.theirs, conn.nonce, self.job)
        self._send(conn, f"cmd=kd_challenge rc=0 job={self.job} "
                   f"secret={int(self.secret)} nonce={conn.nonce} "
                   f"proof={proof}")

    def _reply(self, conn, line):
        """A hello's reply, with its proof."""
        mac = _mac(self.key, "ready", conn.theirs, conn.nonce, line)
        self._send(conn, f"{line} mac={mac}")

    # The hello: a barrier of all ranks with a deadline.
    def on_hello(self, conn, t):
        if conn.nonce is None or conn.hello_rank is not None:
            raise _Bad("hello before the challenge, or twice")
        try:
            rank, size = int(t.get("rank")), int(t.get("size"))
        except (TypeError, ValueError):
            raise _Bad("malformed hello") from None
        # The rank's node (node_identity), under the proof with rank and
        # size; a hello without one (an older client) proves those alone,
        # and MPI then tells nodes apart by host name.
        node = t.get("node", "")
        if len(node) > _NODE_MAX:
            raise _Bad("a node beyond the bound")
        said = (rank, size, node) if node else (rank, size)
        if not hmac.compare_digest(
                t.get("proof", ""),
                _mac(self.key, "hello", conn.nonce, conn.theirs, *said)):
            raise _Bad("no proof of the secret")
        conn.proven = True
        conn.hello_rank = rank
        conn.node = node
        with self.cv:
            if self.hello_done:
                return self._reply(
                    conn, f"cmd=kd_ready rc={_FORMED} msg=its job of "
                    f"{self.size} formed (or failed) without this rank "
                    f"{rank}; if no earlier run of the job is still ending, "
                    f"give each process its own rank in 0..{self.size - 1}")
            if size != self.size:
                return self._reply(
                    conn, f"cmd=kd_ready rc=1 msg=this process says the job "
                    f"has {size} processes but rank 0 says {self.size}; give "
                    f"every process the same size")
            if not 0 <= rank < self.size or rank in self.hello:
                return self._reply(
                    conn, f"cmd=kd_ready rc=1 msg=rank {rank} came twice; "
                    f"give each process its own rank in 0..{self.size - 1}")
            self.hello[rank] = conn
            if len(self.hello) == self.size:
                self.hello_done = True
                self.formed_at = time.monotonic()
                nodes = [self.hello[r].node for r in range(self.size)]
                self.mapping = process_mapping(nodes)
                self.nodes = [n.partition("/")[0] for n in nodes]
                for r, c in self.hello.items():
                    token = 0
                    while token == 0 or token in self.tokens:
                        token = 1 + secrets.randbelow(2 ** 31 - 2)
                    self.tokens[token] = r
                    self._reply(c, f"cmd=kd_ready rc=0 pmiid={token}")
                self.watchers = dict(self.hello)
                self.hello = {}

    def fail_hello(self):  # with self.cv held
        shown = _first_missing(self.size, self.hello)
        for c in self.hello.values():
            self._reply(c, f"cmd=kd_ready rc=1 msg=ranks {shown} of "
                        f"{self.size} did not reach the coordinator within "
                        f"{self.timeout:g} s ({TIMEOUT_ENV}); check that "
                        f"every process was started and has the same "
                        f"coordinator")
        self.hello_done = True
        self.failed = True

    def _send(self, conn, line):
        try:
            conn.sock.sendall((line + "\n").encode())
        except OSError:
            pass

    def on_initack(self, conn, t):
        try:
            token = int(t.get("pmiid", ""))
        except ValueError:
            raise _Bad("malformed initack") from None
        with self.cv:
            rank = self.tokens.pop(token, None)
            if rank is None:
                raise _Bad("not a rank's PMI_ID")
            conn.proven = True
            conn.rank = rank
            self.pmi[rank] = conn
            self.pmi_seen.add(rank)
        self._send(conn, f"cmd=initack rc=0\ncmd=set size={self.size}\n"
                   f"cmd=set rank={rank}\ncmd=set debug=0")

    # PMI-1, the commands MPICH's client sends, from a proven rank.
    def on_pmi(self, conn, cmd, t):
        send = lambda line: self._send(conn, line)  # noqa: E731
        rank = conn.rank
        if cmd == "init":
            send("cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1")
        elif cmd == "get_maxes":
            send(f"cmd=maxes rc=0 kvsname_max=256 keylen_max={_KEY_MAX} "
                 f"vallen_max={_VALUE_MAX}")
        elif cmd == "get_appnum":
            send("cmd=appnum rc=0 appnum=0")
        elif cmd == "get_my_kvsname":
            send(f"cmd=my_kvsname rc=0 kvsname={self.kvsname}")
        elif cmd == "get_universe_size":
            send(f"cmd=universe_size rc=0 size={self.size}")
        elif cmd == "put":
            key, value = t.get("key", ""), t.get("value", "")
            with self.cv:
                mine = self.keys_of.setdefault(rank, set())
                if (len(key) > _KEY_MAX or len(value) > _VALUE_MAX or
                        (key not in mine and
                         len(mine) >= MAX_KEYS_PER_RANK)):
                    raise _Bad("a put beyond the bounds")
                if key in self.kvs and key not in mine:
                    # One rank's key is never another's to change.
                    send("cmd=put_result rc=1 msg=duplicate_key")
                    return
                mine.add(key)
                self.kvs[key] = value
            send("cmd=put_result rc=0")
        elif cmd == "get":
            # PMI_process_mapping: which ranks share a node, from the nodes
            # the hellos named (process_mapping). Without it (a hello
            # named none) MPICH groups the ranks by host name, which it
            # exchanges here.
            key = t.get("key", "")
            with self.cv:
                value = (self.mapping if key == PROCESS_MAPPING_KEY
                         else self.kvs.get(key))
            send("cmd=get_result rc=1 msg=key_not_found" if value is None
                 else f"cmd=get_result rc=0 value={value}")
        elif cmd == "barrier_in":
            with self.cv:
                if rank in self.barrier:
                    raise _Bad("barrier_in twice")
                if self.dead:
                    self.fail_barrier(
                        f"the MPI of {_ranks(self.dead)} ended without "
                        f"finalizing")
                    return
                if not self.barrier:
                    # MPI_Init's barriers come within seconds of meeting;
                    # they have a deadline. MPI_Finalize's may wait for a
                    # rank's long last work: only a rank's end fails it.
                    now = time.monotonic()
                    self.barrier_since = (
                        now if now < self.formed_at + self.timeout else None)
                self.barrier[rank] = conn
                if len(self.barrier) == self.size:
                    for c in self.barrier.values():
                        self._send(c, "cmd=barrier_out rc=0")
                    self.barrier = {}
                    self.barrier_since = None
        elif cmd == "finalize":
            # The ack goes first: once every rank is done the server ends
            # and drops its connections. This thread reads this rank's
            # next bytes, so its close cannot count as a death before it.
            send("cmd=finalize_ack rc=0")
            with self.cv:
                self.pmi_done.add(rank)
                self.cv.notify_all()
        elif cmd == "abort":
            sys.stderr.write(f"kerasdist rendezvous: rank {rank} aborted: "
                             f"{t.get('message', '')[:200]}\n")
        else:
            send(f"cmd={cmd[:32]} rc=-1 msg=unsupported")

    def fail_barrier(self, why):  # with self.cv held
        """Ends a PMI barrier that cannot complete: one line naming who is
        missing, and every waiting rank's MPI fails instead of waiting."""
        missing = _first_missing(self.size, self.barrier)
        line = (f"kerasdist rendezvous: ranks {missing} of {self.size} did "
                f"not reach MPI's barrier ({why}); ending the job's MPI")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        self.tell_watchers(line.partition(": ")[2])
        for c in self.barrier.values():
            self._send(c, f"cmd=barrier_out rc=1 msg={line.replace(' ', '_')}")
            c.drop()
        self.barrier = {}
        self.barrier_since = None
        self.failed = True

    def tell_watchers(self, line, code=None):  # with self.cv held
        """Every rank whose MPI has not finalized hears `line` on its
        hello's connection, prints it and ends (_start_watch): with exit
        code `code`, else 1."""
        head = "cmd=kd_fail" + (f" code={code}" if code else "")
        for r, c in self.watchers.items():
            if r not in self.pmi_done or r in self.dead:
                self._reply(c, f"{head} msg={line}")

    def fail_start(self, how="its MPI's connection to the rendezvous "
                   "closed without MPI_Finalize"):  # with self.cv held
        """Ends the job when a rank's process ended while it started
        (before every rank's kd.init() had finished, see started()): the
        others wait for it in MPI_Init, past its PMI exchange, or in
        init's first collectives, where MPI waits for ever and the
        heartbeat does not watch yet. Each of them prints the heartbeat's
        kind of line, naming the rank, and ends with EXIT_PEER_LOST. `how`:
        what showed that the process ended."""
        lost = sorted(self.dead)
        hosts = {self.nodes[r] for r in lost if r < len(self.nodes)}
        where = f" on host {hosts.pop()}" if len(hosts) == 1 else ""
        which = (f"rank {lost[0]}{where}: its process" if len(lost) == 1
                 else f"ranks {_ranks(lost)}{where}: their processes")
        self.tell_watchers(
            f"lost {which} ended while the job was starting ({how} "
            f"before every rank's kd.init() had finished, where MPI would "
            f"wait for it for ever); ending this rank.",
            code=EXIT_PEER_LOST)
        self.failed = True

    def on_up(self, conn, line):
        """kd_up on a hello's connection: that rank's kd.init() finished
        (started()). kd_watch: the connection stays open for as long as
        that rank's process lives (_start_watch)."""
        body, _, mac = line.rpartition(" mac=")
        if body not in ("cmd=kd_up", "cmd=kd_watch") or not \
                hmac.compare_digest(mac, _mac(self.key, "up", conn.theirs,
                                              conn.nonce, body)):
            raise _Bad("kd_up or kd_watch without the hello's proof")
        with self.cv:
            if self.watchers.get(conn.hello_rank) is not conn:
                return
            if body == "cmd=kd_up":
                self.up.add(conn.hello_rank)
            else:
                conn.watching = True

    def serve(self, conn):
        try:
            buf = b""
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    if len(buf) > MAX_LINE:
                        raise _Bad("a line beyond the bound")
                    data = conn.sock.recv(65536)
                    if not data:
                        break
                    buf += data
                    continue
                line, buf = buf[:i].decode(errors="replace"), buf[i + 1:]
                if len(line) > MAX_LINE:
                    raise _Bad("a line beyond the bound")
                t = _tokens(line)
                cmd = t.get("cmd", "")
                if conn.rank is not None:
                    self.on_pmi(conn, cmd, t)
                elif (cmd in ("kd_up", "kd_watch")
                      and conn.hello_rank is not None):
                    self.on_up(conn, line)
                elif cmd == "kd_auth" and conn.nonce is None:
                    self.on_auth(conn, t)
                elif cmd == "kd_hello":
                    self.on_hello(conn, t)
                elif cmd == "initack" and conn.nonce is None:
                    self.on_initack(conn, t)
                else:
                    raise _Bad(f"{cmd[:32]!r} from a connection that did "
                               f"not prove itself")
        except (OSError, _Bad):
            pass
        finally:
            with self.cv:
                rank = conn.rank
                if rank is not None and self.pmi.get(rank) is conn:
                    del self.pmi[rank]
                    if rank not in self.pmi_done:
                        self.dead.add(rank)
                        self.pmi_done.add(rank)
                        if self.barrier:
                            # A rank left while others wait for it: they
                            # fail now rather than wait forever.
                            self.barrier.pop(rank, None)
                            self.fail_barrier(
                                f"the MPI of rank {rank} ended without "
                                f"finalizing")
                        elif not self.failed and len(self.up) < self.size:
                            # Its process ended while the job started:
                            # the others wait for it where nothing else
                            # would tell them. Later, the heartbeat does.
                            self.fail_start()
                watched = conn.hello_rank
                if (conn.watching and self.watchers.get(watched) is conn
                        and watched not in self.up
                        and watched not in self.pmi_done
                        and not self.failed):
                    # Its process ended before its kd.init() finished,
                    # perhaps before its MPI ever came: the others would
                    # wait for it in MPI_Init until the deadline.
                    # (A barrier it was missing from fails as the server
                    # ends, which drops every connection.) Where its MPI's
                    # connection is open, the same death closes that one
                    # too, and that is the line to give (its MPI was
                    # inside MPI_Init): check_deadlines waits a moment
                    # for it.
                    if watched in self.pmi:
                        self.hello_gone[watched] = time.monotonic()
                    else:
                        self.hello_lost(watched)
                for r, c in list(self.hello.items()):
                    if c is conn:
                        del self.hello[r]
                self.conns.discard(conn)
                self.cv.notify_all()
            conn.drop()
            conn.sock.close()

    def hello_lost(self, rank):  # with self.cv held
        self.dead.add(rank)
        self.pmi_done.add(rank)
        self.fail_start("its hello's connection to the rendezvous closed")

    def admit(self, conn):
        """Counts a new connection in; drops the oldest that has not proved
        itself when there are too many such."""
        with self.cv:
            self.shed(MAX_UNPROVEN - 1)
            self.conns.add(conn)

    def shed(self, keep):
        """Drops the oldest connections that proved nothing, all but
        `keep`."""
        with self.cv:
            unproven = sorted((c for c in self.conns
                               if not (c.proven or c.dropped)),
                              key=lambda c: c.since)
            for c in unproven[:max(0, len(unproven) - keep)]:
                c.drop()

    def finished(self):
        with self.cv:
            if self.failed:
                return True
            if len(self.pmi_done) >= self.size:
                return True  # every rank's MPI has finalized or gone
            return (self.parent_gone_at is not None and
                    (not self.pmi or
                     time.monotonic() - self.parent_gone_at > _GRACE_S))

    def check_deadlines(self, now):
        with self.cv:
            for c in self.conns:
                if (not (c.proven or c.dropped) and
                        now > c.since + AUTH_DEADLINE_S):
                    c.drop()
            for rank, when in list(self.hello_gone.items()):
                if rank in self.pmi_done or self.failed:
                    del self.hello_gone[rank]
                elif now > when + _HELLO_BEFORE_MPI_S:
                    del self.hello_gone[rank]
                    self.hello_lost(rank)
            if self.failed:
                return
            if not self.hello_done and now > self.started + self.timeout:
                self.fail_hello()
            elif (self.formed_at is not None and
                  len(self.pmi_seen) < self.size and
                  now > self.formed_at + self.timeout):
                # A rank met the others but its MPI never came: the others
                # would wait in MPI_Init forever. Ending makes it fail.
                missing = _first_missing(self.size, self.pmi_seen)
                line = (f"the MPI of ranks {missing} of {self.size} did "
                        f"not start within {self.timeout:g} s of meeting "
                        f"({TIMEOUT_ENV}); ending the job's MPI start")
                sys.stderr.write(f"kerasdist rendezvous: {line}\n")
                self.tell_watchers(line)
                self.failed = True
            elif (self.barrier_since is not None and self.barrier and
                  now > self.barrier_since + self.timeout):
                self.fail_barrier(f"not within {self.timeout:g} s")


def _ranks(ranks):
    return ", ".join(map(str, sorted(ranks)[:16])) + (
        ", ..." if len(ranks) > 16 else "")


def _first_missing(size, present):
    """"0, 3, 5" : the first 16 ranks of `size` not in `present`, built
    without anything the size of the job (a size of 10**9 would take
    gigabytes)."""
    missing = []
    for r in range(size):
        if r not in present:
            missing.append(r)
            if len(missing) > 16:
                break
    return ", ".join(map(str, missing[:16])) + (
        ", ..." if len(missing) > 16 else "")


def node_ids(nodes):
    """Each rank's node number from the node identities of the ranks, in
    rank order (node_identity()): 0 for rank 0's node, then 1, 2, ... in
    the order of each node's first rank."""
    number = {}
    return [number.setdefault(n, len(number)) for n in nodes]


def process_mapping(nodes):
    """PMI_process_mapping (MPICH's "(vector,(node,nodes,ranks),...)")
    for ranks whose node identities are `nodes`, in rank order: which ranks
    MPI takes to share memory. Consecutive ranks on one node are one
    block; blocks of consecutive nodes with as many ranks each are one
    triple: 2 hosts of 4 ranks each are "(vector,(0,2,4))". None (MPICH
    then groups by host name) where a rank named no node, or where the
    mapping would not fit in one PMI value (ranks spread over nodes in no
    order that triples say briefly)."""
    if not nodes or not all(nodes):
        return None
    runs = []  # [node, ranks], consecutive ranks
    for n in node_ids(nodes):
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    triples = []  # [first node, nodes, ranks each]
    for n, count in runs:
        last = triples[-1] if triples else None
        if last and last[2] == count and last[0] + last[1] == n:
            last[1] += 1
        else:
            triples.append([n, 1, count])
    text = "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in triples) \
        + ")"
    return text if len(text) < _VALUE_MAX else None


def _watch_parent(server):
    sys.stdin.read()  # EOF: rank 0 has gone
    with server.cv:
        server.parent_gone_at = time.monotonic()
        server.cv.notify_all()


def _listen(port, size, timeout, address=""):
    """The listening socket on `address`:`port` ("": every interface);
    while the port is in use (the server of an earlier run still ending),
    says "waiting" once and retries until `timeout`."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
            listener.listen(min(max(size, 128), 4096))
            return listener
        except OSError as e:
            listener.close()
            if (e.errno != errno.EADDRINUSE or port == 0 or
                    time.monotonic() >= deadline):
                raise
        if not said:
            print(f"waiting {port}", flush=True)
            said = True
        time.sleep(_RETRY_S)


def _serve(port, size, timeout, address=""):
    job = os.environ.get("_KERASDIST_RENDEZVOUS_JOB", "unnamed")
    key = bytes.fromhex(os.environ.get("_KERASDIST_RENDEZVOUS_KEY", ""))
    try:
        listener = _listen(port, size, timeout, address)
    except OSError as e:
        print(f"{e.strerror or e} (the coordinator's port must be free on "
              f"rank 0's host)", flush=True)
        return 1
    server = _Server(size, timeout, job, key,
                     os.environ.get("_KERASDIST_RENDEZVOUS_SECRET") == "1")
    threading.Thread(target=_watch_parent, args=(server,),
                     daemon=True).start()

    def accept():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                               errno.ENOMEM, errno.ECONNABORTED,
                               errno.EPROTO, errno.EPERM):
                    # Out of descriptors (a flood): shed the older half of
                    # the connections that proved nothing, and go on.
                    server.shed(MAX_UNPROVEN // 2)
                    time.sleep(0.01)
                    continue
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            server.admit(conn)
            try:
                threading.Thread(target=server.serve, args=(conn,),
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had
                with server.cv:
                    server.conns.discard(conn)
                sock.close()

    threading.Thread(target=accept, daemon=True).start()
    print(f"ready {listener.getsockname()[1]}", flush=True)
    while not server.finished():
        server.check_deadlines(time.monotonic())
        with server.cv:
            server.cv.wait(0.5)
    with server.cv:
        for c in list(server.conns):
            c.drop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "serve":
        sys.exit(_serve(int(sys.argv[2]), int(sys.argv[3]),
                        float(sys.argv[4]), *sys.argv[5:]))
    sys.exit("usage: rendezvous.py serve PORT SIZE TIMEOUT_SECONDS "
             "[ADDRESS]")
