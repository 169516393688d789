"""A job that breaks on purpose, for the fault tests (tests/cluster/
test_faults.py): the ranks run the core's collectives on numpy (no
TensorFlow, so a case takes seconds), and one rank brings about a fault at a
chosen moment, from inside its own host (the test hosts' processes run as
root in their namespaces, so a rank can take its own host's link down).

argv: WHERE FAULT RANK [STATE_DIR]
  WHERE  "broadcast": the fault comes before the first collective (a
         broadcast from rank 0, as at the start of training), so the others
         are inside it; "allreduce": after a few steps of allreduces, the
         others are inside the next one; "mpi4py": the others are inside an
         mpi4py barrier, not a kerasdist collective.
  FAULT  kill (SIGKILL this rank), kill_host (SIGKILL every rank of this
         host), freeze (SIGSTOP), exception (an uncaught exception),
         link_down (`ip link set eth0 down` on this host), drop (nftables
         drops every packet on this host's link, silently).
  RANK   the rank that brings the fault about.
Every rank appends "<rank> <host> <pid>" to STATE_DIR/ranks when it starts,
and the rank that breaks things writes STATE_DIR/fault with the time.
"""

import os
import signal
import socket
import sys
import time

import numpy as np

import kerasdist as kd
from tests.support import host_faults
from tests.support.collectives import allreduce
from tests.support.collectives import broadcast

WHERE, FAULT, FAULT_RANK = sys.argv[1], sys.argv[2], int(sys.argv[3])
STATE = sys.argv[4] if len(sys.argv) > 4 else None
STEPS_BEFORE = 5


def _note(name, text):
    if STATE:
        with open(os.path.join(STATE, name), "a") as f:
            f.write(text + "\n")


def _workers_here():
    """Pids of this host's ranks (python running this file)."""
    me = os.path.abspath(__file__)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and os.path.abspath(argv[1].decode()) == me:
            pids.append(int(entry))
    return pids


def inject():
    _note("fault", f"{time.time()} {FAULT} {socket.gethostname()}")
    sys.stdout.flush()
    if FAULT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif FAULT == "kill_host":
        for pid in _workers_here():
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif FAULT == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif FAULT == "exception":
        raise RuntimeError(f"an injected error on rank {kd.rank()}")
    elif FAULT == "link_down":
        host_faults.take_this_hosts_link_down()
    elif FAULT == "drop":
        host_faults.drop_this_hosts_packets()
    else:
        raise ValueError(f"unknown fault {FAULT!r}")


def main():
    kd.init()
    rank = kd.rank()
    _note("ranks", f"{rank} {socket.gethostname()} {os.getpid()}")
    x = np.ones(1024, np.float32)
    if WHERE == "broadcast":
        if rank == FAULT_RANK:
            inject()
        broadcast(x, 0, name="initial_state")
    elif WHERE == "allreduce":
        for step in range(10**6):
            if step == STEPS_BEFORE and rank == FAULT_RANK:
                inject()
            allreduce(x, name="grad")
    elif WHERE == "mpi4py":
        from mpi4py import MPI
        allreduce(x, name="grad")
        if rank == FAULT_RANK:
            time.sleep(1)  # the others are in the barrier by then
            inject()
        MPI.COMM_WORLD.Barrier()
    # A fault that does not end this rank (link_down, drop) leaves it in
    # its collectives above until the heartbeat ends it.
    print("finished", rank, flush=True)


if __name__ == "__main__":
    main()
