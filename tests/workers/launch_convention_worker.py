"""A process started without mpiexec (torchrun's or Keras' variables):
kd.init() must form one MPI job of all of them. Checks allreduce against
numpy for sizes on MPI's path and on the single-node shared-memory paths,
that mpi4py sees the same MPI_COMM_WORLD, that the PMI variables of the
rendezvous are gone from the environment afterwards, and that init() after
shutdown() runs the same job again. Prints
"ok RANK SIZE LOCAL_RANK LOCAL_SIZE".
"""

import os

import numpy as np

import kerasdist as kd
from tests.support.collectives import allreduce

kd.init()
rank, size = kd.rank(), kd.size()
for n in (1, 1000, 1 << 20):
    got = allreduce(np.arange(n, dtype=np.float32) + rank, name=f"lc.{n}",
                    op=kd.Sum)
    want = sum(np.arange(n, dtype=np.float32) + r for r in range(size))
    assert np.array_equal(got, want), (n, got[:4], want[:4])

from mpi4py import MPI  # noqa: E402  (after init: MPI is already started)

world = MPI.COMM_WORLD
assert (world.rank, world.size) == (rank, size), (world.rank, world.size)
assert world.allreduce(rank) == size * (size - 1) // 2
leaked = [k for k in ("PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE")
          if k in os.environ]
assert not leaked, leaked
# init() after shutdown(): the job MPI already runs, met again without a
# second rendezvous (its server may have ended) and without a second line.
kd.shutdown()
kd.init()
assert (kd.rank(), kd.size()) == (rank, size), (kd.rank(), kd.size())
got = allreduce(np.full(4, rank + 1.0, np.float32), name="lc.again",
                op=kd.Sum)
assert np.array_equal(got, np.full(4, size * (size + 1) / 2)), got
# One write: under torchrun both processes share its stdout, unbuffered.
os.write(1, f"ok {rank} {size} {kd.local_rank()} {kd.local_size()}\n".encode())
