"""kd.init()'s TCP transport (KERASDIST_TRANSPORT=tcp): the glue between
init (kerasdist/basics.py), the rendezvous (kerasdist/rendezvous/tcp_job.py)
and the core (ops/core/transport/tcp_job.h).

The ranks meet at the coordinator as for MPI (a platform's launch or
`kerasdist run --nnodes`), exchange their listeners' addresses through
the rendezvous's server, and the core forms its TCP meshes instead of
starting MPI. No MPI runs in such a job: process sets other than the
global one and recovery in place (which re-forms MPI's communicator) are
MPI's for now, and say so.
"""

import os

from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import tcp_job

RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"


def check(launch, joined, environ=None):
    """Whether this init runs over TCP; raises RuntimeError (init's
    message) where it cannot: KERASDIST_TRANSPORT malformed, no
    coordinator to meet at, recovery in place asked for, or a second
    init of a process whose TCP job ended."""
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
    if environ.get(RECOVER_ENV) == "1":
        raise RuntimeError(
            f"kerasdist.init() failed: recovery in place re-forms MPI's "
            f"communicator; it does not run over {tcp_job.TRANSPORT_ENV}="
            f"tcp yet. Unset one of {RECOVER_ENV} and "
            f"{tcp_job.TRANSPORT_ENV}.")
    if joined is not None:
        raise RuntimeError(
            "kerasdist.init(): this process's TCP job ended with "
            "shutdown(), and its rendezvous with it; a process joins one "
            "TCP job. Start a new process for the next one.")
    return True


def prepare(lib, launch, variables):
    """After client.join (`variables`, what it returned for MPI_Init):
    the addresses exchanged and the job described to the core, whose next
    kerasdist_init forms the meshes. Returns the rendezvous's connection,
    to close (`done()`) once init has returned; None where this init runs
    over MPI."""
    if not variables or not tcp_job.wanted(os.environ):
        return None
    watch_fd = variables.get(protocol.PMI_WATCH_ENV)
    if watch_fd:  # MPI's end of the hello's watch: nothing reads it here
        os.close(int(watch_fd))
    _, key, _ = protocol.identity(os.environ)
    timeout = protocol.timeout_from(os.environ)
    try:
        spec, exchange = tcp_job.describe(variables, launch.rank,
                                          launch.size, key, timeout)
    except (OSError, protocol.RendezvousError) as e:
        raise RuntimeError(
            f"kerasdist.init() failed: rank {launch.rank} of {launch.size} "
            f"could not exchange its TCP addresses: {e}") from None
    if lib.kerasdist_set_tcp_job(spec.encode()) != 0:
        exchange.done()
        raise RuntimeError(f"kerasdist.init() failed: "
                           f"{lib.kerasdist_last_error().decode()}")
    return exchange
