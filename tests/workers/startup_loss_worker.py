"""A job whose processes a platform started (torchrun's variables, no
mpiexec) that loses a rank while it starts, or after.

argv: WHEN RANK [COMMANDS]
  WHEN "mpi_init": rank RANK's MPI talks to the rendezvous through a relay
       in this process that ends the process (os._exit(1)) the moment it
       has relayed the answer to MPI's COMMANDS-th PMI command: MPI_Init's
       last, after which the others wait for this rank's shared memory.
       "log": that relay only writes each PMI line ("> " from MPI, "< "
       to it) on stderr, to count MPI_Init's commands.
       "joined": rank RANK ends (os._exit(1)) once it has met the
       others at the coordinator, before its MPI starts.
       "after": rank RANK ends (os._exit(3)) half a second after the
       first allreduce, while the others are inside the second: the
       heartbeat's affair.
Every rank that gets through prints "ok RANK SIZE LOCAL_RANK LOCAL_SIZE"
after an allreduce.
"""

import os
import socket
import sys
import threading
import time

import numpy as np

WHEN, RANK = sys.argv[1], int(sys.argv[2])
COMMANDS = int(sys.argv[3]) if len(sys.argv) > 3 else 0
ME = int(os.environ["RANK"])
_asked = []  # PMI commands MPI sent


def _pump(src, dst, mark):
    buf = b""
    while True:
        data = src.recv(65536)
        if not data:
            dst.shutdown(socket.SHUT_WR)
            return
        # MPI's commands are counted before they go on: the answer to the
        # last must never be relayed before its command was counted.
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if WHEN == "log":
                os.write(2, mark + line + b"\n")
            if mark == b"> ":
                _asked.append(line)
        dst.sendall(data)
        if (WHEN == "mpi_init" and mark == b"< " and not buf and
                len(_asked) >= COMMANDS):
            os._exit(1)


def _relay(listener, server):
    mpi, _ = listener.accept()
    up = socket.create_connection(server)
    threading.Thread(target=_pump, args=(mpi, up, b"> "),
                     daemon=True).start()
    _pump(up, mpi, b"< ")


if ME == RANK and WHEN in ("mpi_init", "log"):
    from kerasdist.rendezvous import client as rendezvous
    _join = rendezvous.join

    def join(*args, **kwargs):
        variables = _join(*args, **kwargs)
        host, _, port = variables["PMI_PORT"].rpartition(":")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        threading.Thread(target=_relay, args=(listener, (host, int(port))),
                         daemon=True).start()
        variables["PMI_PORT"] = f"127.0.0.1:{listener.getsockname()[1]}"
        return variables
    rendezvous.join = join

if ME == RANK and WHEN == "joined":
    from kerasdist.rendezvous import client as rendezvous
    _join_then = rendezvous.join

    def join(*args, **kwargs):
        _join_then(*args, **kwargs)
        os._exit(1)
    rendezvous.join = join

import kerasdist as kd  # noqa: E402
from tests.support.collectives import allreduce  # noqa: E402

kd.init()
rank, size = kd.rank(), kd.size()
got = allreduce(np.arange(1000, dtype=np.float32) + rank, name="sl.a",
                op=kd.Sum)
want = sum(np.arange(1000, dtype=np.float32) + r for r in range(size))
assert np.array_equal(got, want), (got[:4], want[:4])
if WHEN == "after" and rank == RANK:
    time.sleep(0.5)  # every rank's "init finished" has reached the server
    os._exit(3)
if WHEN == "after":
    allreduce(np.ones(4, np.float32), name="sl.b", op=kd.Sum)
os.write(1, f"ok {rank} {size} {kd.local_rank()} {kd.local_size()}\n"
         .encode())
if WHEN == "log":
    # MPI_Finalize while the relay's threads still run (at exit they
    # would not).
    kd.shutdown()
    from kerasdist._core import capi
    capi.lib().MPI_Finalize()
    os._exit(0)
