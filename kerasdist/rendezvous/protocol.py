"""What the rendezvous' server and its clients share: the settings, the
job's identity and key, the proofs (HMACs) every line carries, the node a
process is on, and how a PMI-1 line is read and split.

Standard library only and no other kerasdist module: the server imports
it by path (server.py's note), and so do tests in other namespaces.
"""

import hashlib
import hmac
import os
import socket

TIMEOUT_ENV = "KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 300.0
# The job's secret (docs/platforms.md, "The control plane's secret"): every
# connection to the rendezvous proves it before anything it says counts.
SECRET_ENV = "KERASDIST_JOB_SECRET"
# The job's name, where the platform gives none of its own (below).
JOB_ID_ENV = "KERASDIST_JOB_ID"
MIN_SECRET_CHARS = 16
# Kubernetes: the path of a file that holds the secret (a mounted Secret),
# read where KERASDIST_JOB_SECRET itself is not set.
SECRET_FILE_ENV = "KERASDIST_JOB_SECRET_FILE"
_MAX_SECRET_FILE = 4096
# Ids that many jobs share by default (torchrun's run id outside
# --standalone is "none"): no id at all.
_SHARED_IDS = ("none",)
# The platforms' own names of a job, first found wins: two jobs on one
# coordinator's port are told apart by it even without a secret.
_JOB_ID_VARIABLES = (JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                     "TRAINING_JOB_NAME", "JOB_NAME")
RETRY_S = 0.25
# The hello's reply code of a server that refused its job: two processes
# claimed one rank (two jobs on one port); every later hello hears it too.
CONFLICT = 4
# The hello's reply code of a server whose job has formed (or failed) already:
# the hello came too late for it, and may be meant for the next one.
FORMED = 2
# The reply code of a server of another job.
OTHER_JOB = 3
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
# A TCP job's standby server, for generation G: its rank's key and its
# address's in the rendezvous (tcp_job.designate_standby, reform.py).
STANDBY_KEY = "kdsb{generation}.{what}"
# The exit code of a rank that ends because it lost another (the heartbeat's,
# ops/core/control/liveness.cc): the launcher reads the rank's "lost" line.
EXIT_PEER_LOST = 75
# A node identity's parts in the hello: the host name's first characters,
# and a digest of what a node's shared memory needs in common.
_HOST_CHARS, NODE_MAX = 64, 96


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message says who and what to do."""


class BadConnection(Exception):
    """A connection broke the protocol: it is dropped, the job goes on."""


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


def secret_problem(secret):
    """Why `secret` is no job secret (one sentence), or None: the one rule
    every way a job starts checks (kd.init(), `kerasdist run`, node mode,
    Ray): valid UTF-8, at least MIN_SECRET_CHARS characters besides
    surrounding white space."""
    how = ("set it to a random string, e.g. the output of `python -c "
           "'import secrets; print(secrets.token_hex(32))'`")
    try:
        secret.encode("utf-8")
    except UnicodeEncodeError:
        return f"{SECRET_ENV} is not valid UTF-8; {how}"
    if not secret.strip():
        return f"{SECRET_ENV} is blank; {how}"
    if len(secret.strip()) < MIN_SECRET_CHARS:
        return (f"{SECRET_ENV} has {len(secret.strip())} characters, fewer "
                f"than {MIN_SECRET_CHARS}; {how}")
    return None


def secret_of(environ):
    """The job's secret: KERASDIST_JOB_SECRET, else the contents of the
    file KERASDIST_JOB_SECRET_FILE names (a Kubernetes Secret mounted in
    every pod; one trailing newline dropped), else "".

    Raises:
        ValueError: the secret breaks the rule (secret_problem), or the
            file named cannot be read.
    """
    secret = environ.get(SECRET_ENV, "")
    path = environ.get(SECRET_FILE_ENV, "").strip()
    if not secret and path:
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_SECRET_FILE + 1)
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read "
                             f"({e.strerror or e}); mount the job's secret "
                             f"there or unset it") from None
        if len(data) > _MAX_SECRET_FILE:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} holds more than "
                             f"{_MAX_SECRET_FILE} bytes; it must hold the "
                             f"job's secret alone")
        secret = data.decode("utf-8", "surrogateescape")
        secret = secret[:-1] if secret.endswith("\n") else secret
        if not secret:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} is empty")
    if secret:
        problem = secret_problem(secret)
        if problem:
            raise ValueError(problem + (f" (read from {SECRET_FILE_ENV}="
                                        f"{path!r})" if path and not
                                        environ.get(SECRET_ENV) else ""))
    return secret


def identity(environ):
    """(job id, key, authenticated) of this process's job.

    The key is what every message's HMAC is made with: the job's secret
    (KERASDIST_JOB_SECRET, or the file KERASDIST_JOB_SECRET_FILE names)
    where there is one; else one made from the job id alone, which proves
    nothing (anyone can compute it). The job id is KERASDIST_JOB_ID or the
    platform's name of the job (torchrun's run id, Slurm's job id, ...),
    an id many jobs share by default ("none") counting as none; with a
    secret and no name, the secret's fingerprint; else "unnamed". Two
    launches with one id (or none) on one port are refused, not merged
    (hello.py).
    """
    secret = secret_of(environ)
    job = ""
    for name in _JOB_ID_VARIABLES:
        job = environ.get(name, "").strip()
        if job.lower() in _SHARED_IDS:
            job = ""
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


def mac_of(key, *parts):
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



def address_toward(ip):
    """This host's address on the route to `ip`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def read_line(sock, limit=MAX_LINE):
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


def tokens(line):
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


def rank_list(ranks):
    """"0, 3, 5": the first 16 of `ranks`, in order."""
    return ", ".join(map(str, sorted(ranks)[:16])) + (
        ", ..." if len(ranks) > 16 else "")


def first_missing(size, present):
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
