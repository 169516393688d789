"""A process started without mpiexec (torchrun's variables) whose job's
rendezvous server goes (killed from outside) after the job formed: it must
end with one line saying so, not crash in MPI_Finalize. Rank 0 kills its
own server once both ranks have computed. Prints "done RANK"."""

import os
import time

import numpy as np

import kerasdist as kd
from kerasdist.rendezvous import client as rendezvous
from tests.support.collectives import allreduce

kd.init()
rank = kd.rank()
got = allreduce(np.ones(4, np.float32), name="gone.x", op=kd.Sum)
assert np.array_equal(got, np.full(4, kd.size(), np.float32)), got
# Both ranks have computed: the server may go.
allreduce(np.ones(1, np.float32), name="gone.y", op=kd.Sum)
if rank == 0:
    rendezvous._server.kill()
    rendezvous._server.wait()
time.sleep(0.5)  # rank 1 sees its connection close too
os.write(1, f"done {rank}\n".encode())
