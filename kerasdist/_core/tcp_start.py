"""kd.init()'s TCP transport (KERASDIST_TRANSPORT=tcp): the glue between
init (kerasdist/basics.py), the rendezvous (kerasdist/rendezvous/tcp_job.py)
and the core (ops/core/transport/tcp_job.h).

The ranks meet at the coordinator as for MPI (a platform's launch or
`kerasdist run --nnodes`), exchange their listeners' addresses through
the rendezvous's server, and the core forms its TCP meshes instead of
starting MPI. No MPI runs in such a job: process sets other than the
global one stay MPI's and say so.

With recovery in place (KERASDIST_RECOVER_IN_PLACE=1) each rank keeps its
connection to the server, and every later init() of the process (after a
lost rank: kerasdist.elastic.recover_in_place) forms the job's next
generation among the ranks still there (rendezvous/reform.py); after
the ranks agreed to grow (kerasdist/_core/grow.py), with the processes
that wait to join too. Such a process (KERASDIST_JOIN=1) meets the
running job through rendezvous/joining.py instead of the start's hello.
"""

import os
import sys

from kerasdist.rendezvous import client
from kerasdist.rendezvous import environment
from kerasdist.rendezvous import joining
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import tcp_job

RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"
_HEARTBEAT_ENV = "KERASDIST_HEARTBEAT_TIMEOUT_SECONDS"
_state = {"exchange": None, "generation": 0, "grow": False,
          "rank": 0, "standby": None, "standby_proc": None}


def generation():
    """How many times this process's TCP job re-formed (0: never)."""
    return _state["generation"]


def _recovering(environ):
    return environ.get(RECOVER_ENV) == "1"


def check(launch, joined, environ=None):
    """Whether this init runs over TCP; raises RuntimeError (init's
    message) where it cannot: KERASDIST_TRANSPORT malformed, no
    coordinator to meet at, or a second init of a process whose TCP job
    ended (without recovery in place its rendezvous ends once the job
    formed)."""
    environ = os.environ if environ is None else environ
    try:
        tcp = tcp_job.wanted(environ)
    except ValueError as e:
        raise RuntimeError(f"kerasdist.init() failed: {e}") from None
    if not tcp:
        return False
    if launch.coordinator is None:
        raise RuntimeError(
            f"kerasdist.init() failed: {tcp_job.TRANSPORT_ENV}=tcp needs "
            f"ranks that meet at a coordinator (`kerasdist run --nnodes N "
            f"--nproc-per-node M`, torchrun, or a platform's RANK, "
            f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT); this process was "
            f"started as {launch.convention!r}. Under mpirun use the MPI "
            f"transport (unset {tcp_job.TRANSPORT_ENV}).")
    if joined is not None and _state["exchange"] is None:
        raise RuntimeError(
            f"kerasdist.init(): this process's TCP job ended with "
            f"shutdown(), and its rendezvous with it; a process joins one "
            f"TCP job (with {RECOVER_ENV}=1 its init() after shutdown() "
            f"forms the job again). Start a new process for the next one.")
    return True


def joins(environ=None):
    """Whether this process joins a running TCP job (KERASDIST_JOIN=1)
    and has not yet."""
    environ = os.environ if environ is None else environ
    return joining.wanted(environ) and _state["exchange"] is None


def join(environ=None):
    """A joining process's kd.init(): waits to be let into the running
    job (rendezvous/joining.py); returns (its Launch, the variables
    `prepare` takes). Raises RuntimeError (init's message) where it
    cannot: no TCP with recovery in place, no coordinator, or the job did
    not let it in."""
    environ = os.environ if environ is None else environ
    try:
        tcp = tcp_job.wanted(environ)
    except ValueError as e:
        raise RuntimeError(f"kerasdist.init() failed: {e}") from None
    if not tcp or not _recovering(environ):
        raise RuntimeError(
            f"kerasdist.init() failed: {joining.JOIN_ENV}=1 joins a running "
            f"job over the TCP transport with recovery in place; set "
            f"{tcp_job.TRANSPORT_ENV}=tcp and {RECOVER_ENV}=1, as the job's "
            f"ranks have them.")
    try:
        host = environ.get("MASTER_ADDR", "").strip()
        port = environment.port_number(environ.get("MASTER_PORT", ""),
                                       "MASTER_PORT")
        if not host:
            raise ValueError("MASTER_ADDR is not set: give the address of "
                             "the job's coordinator (its rank 0's host).")
        variables = joining.join_running(
            (host, port), protocol.timeout_from(environ), environ)
    except (ValueError, protocol.RendezvousError) as e:
        raise RuntimeError(f"kerasdist.init() failed: {e}") from None
    local = [environ.get(n, "").strip() for n in ("LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE")]
    local_rank, local_size = (int(local[0]), int(local[1])) \
        if all(x.isdigit() for x in local) else (None, None)
    launch = environment.Launch("join", variables["rank"],
                                variables["size"], local_rank, local_size,
                                (host, port))
    return launch, variables


def join_launch(joined, environ=None):
    """init()'s meeting for a joining process (KERASDIST_JOIN=1): its
    first init waits to be let in (`join`); a later one (a re-form) meets
    nothing new. None for any other process."""
    if joined is not None:
        return (joined, {}) if joined.convention == "join" else None
    return join(environ) if joins(environ) else None


def joiners():
    """How many processes wait to join this process's TCP job (0 where it
    is none that re-forms, or the server does not answer)."""
    ex = _state["exchange"]
    if ex is None:
        return 0
    try:
        return ex.joiners()
    except (OSError, ValueError, protocol.RendezvousError):
        return 0


def re_forms():
    """Whether this process's TCP job re-forms in place (it keeps its
    connection to the rendezvous)."""
    return _state["exchange"] is not None


def grow_next():
    """The next re-form lets the waiting processes in (the ranks agreed
    to grow: kerasdist/_core/grow.py)."""
    _state["grow"] = True


class _Started:
    """What init() ends once the core has formed the meshes (or failed
    to): the connection to the server, kept for the job's life with
    recovery in place."""

    def __init__(self, exchange):
        self.exchange = exchange

    def done(self, formed=True):
        if _state["exchange"] is not self.exchange:
            self.exchange.done()
        elif formed:
            self.exchange.stay()


def _heartbeat_s(environ):
    try:
        return max(1.0, float(environ.get(_HEARTBEAT_ENV, "") or 30.0))
    except ValueError:
        return 30.0


def _window(environ):
    """How long a re-form waits for a rank that neither asks, goes, nor
    was named lost by the lowest rank that asked (reform.py): four of the
    heartbeat's timeouts, at least 30 s (a survivor finishes its step
    before it asks)."""
    return max(30.0, 4 * _heartbeat_s(environ))


def _lost_ranks(lib):
    """The ranks this process's heartbeat last reported lost."""
    import ctypes
    lib.kerasdist_lost_ranks.argtypes = [ctypes.POINTER(ctypes.c_int32),
                                         ctypes.c_int]
    lib.kerasdist_lost_ranks.restype = ctypes.c_int
    out = (ctypes.c_int32 * 4096)()
    n = lib.kerasdist_lost_ranks(out, len(out))
    return list(out[:min(n, len(out))])


def _exchange(lib, launch, variables, environ):
    """(the Exchange, this rank, the size, the generation) of this init:
    the first (`variables`: client.join's), or the next generation's
    among the ranks still there."""
    timeout = protocol.timeout_from(environ)
    if variables:
        watch_fd = variables.get(protocol.PMI_WATCH_ENV)
        if watch_fd:  # MPI's end of the hello's watch: nothing reads it
            os.close(int(watch_fd))
        ex = tcp_job.Exchange(variables["PMI_PORT"], variables["PMI_ID"],
                              timeout)
        if _recovering(environ):
            _state["exchange"] = ex
        # A joining process comes in at the generation that let it in.
        _state["generation"] = gen = variables.get("generation", 0)
        return ex, launch.rank, launch.size, gen
    ex = _answering(_state["exchange"], environ)
    gen = _state["generation"] + 1
    grow, _state["grow"] = _state["grow"], False
    rank, size = ex.reform(gen, _window(environ), _lost_ranks(lib), grow)
    _state["generation"] = gen
    return ex, rank, size, gen


def _answering(ex, environ):
    """`ex`, where the job's server still answers it (within the
    heartbeat's timeout, at most 10 s); else, where the job has a standby
    (rendezvous/reform.py), an Exchange with it, this rank proven there."""
    standby = _state["standby"]
    if standby is None:
        return ex
    timeout = protocol.timeout_from(environ)
    try:
        ex.sock.settimeout(min(10.0, max(2.0, _heartbeat_s(environ))))
        ex.joiners()
        ex.sock.settimeout(timeout)
        return ex
    except (OSError, ValueError, protocol.RendezvousError) as e:
        why = str(e) or type(e).__name__
    ex.sock.close()
    sys.stderr.write(f"kerasdist: rank {_state['rank']}: the job's "
                     f"rendezvous at {ex.where} does not answer ({why}); "
                     f"re-forming through its standby at {standby}\n")
    sys.stderr.flush()
    new = joining.rejoin(standby, _state["rank"], _state["generation"],
                         timeout, environ)
    _state["exchange"], _state["standby"] = new, None
    return new


def _start_standby(ex, size, generation, environ):
    """This rank was named to run the job's standby server: starts it on
    this rank's address; returns "host:port"."""
    job, key, proven = protocol.identity(environ)
    port, proc = client.start_standby(size, protocol.timeout_from(environ),
                                      job, key, ex.ip, proven, generation)
    at = f"{ex.ip}:{port}"
    _state["standby_proc"] = (at, proc)
    return at


def _name_standby(ex, rank, size, gen, environ):
    """Every rank of a job that re-forms, after its addresses went round:
    the job's standby server for this generation (tcp_job.
    designate_standby). A standby this process ran before that is now
    neither the job's server nor its standby ends."""
    before = _state["standby_proc"]
    _state["rank"] = rank
    _state["standby"] = tcp_job.designate_standby(
        ex, rank, size, gen, lambda: _start_standby(ex, size, gen, environ))
    if before is not None and \
            before[0] not in (ex.where, _state["standby"]):
        before[1].stdin.close()
        if _state["standby_proc"] is before:
            _state["standby_proc"] = None


def prepare(lib, launch, variables, environ=None):
    """After client.join (`variables`, what it returned for MPI_Init; {}
    in a later init): the addresses exchanged and the job described to the
    core, whose next kerasdist_init forms the meshes. Returns what to
    close (`done()`) once init has returned; None where this init runs
    over MPI."""
    environ = os.environ if environ is None else environ
    if not tcp_job.wanted(environ) or not (variables or _state["exchange"]):
        return None
    _, key, _ = protocol.identity(environ)
    try:
        ex, rank, size, gen = _exchange(lib, launch, variables, environ)
        # Forming the meshes: the rendezvous's timeout at the start (the
        # ranks may start minutes apart); a re-form's ranks all run, so a
        # rank lost meanwhile is not waited for as long.
        timeout = protocol.timeout_from(environ)
        if gen:
            timeout = min(timeout, max(10.0, 2 * _heartbeat_s(environ)))
        spec = tcp_job.describe(ex, rank, size, key, timeout, gen)
        if _recovering(environ):
            _name_standby(ex, rank, size, gen, environ)
    except (OSError, protocol.RendezvousError) as e:
        raise RuntimeError(
            f"kerasdist.init() failed: rank {launch.rank} of {launch.size} "
            f"(as started) could not exchange its TCP addresses: {e}"
        ) from None
    started = _Started(ex)
    if lib.kerasdist_set_tcp_job(spec.encode()) != 0:
        started.done(formed=False)
        raise RuntimeError(f"kerasdist.init() failed: "
                           f"{lib.kerasdist_last_error().decode()}")
    return started
