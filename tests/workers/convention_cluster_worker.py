"""A process of a job started the way a platform starts it (no mpiexec):
kd.init(), then allreduce (MPI's path and the large single-node one),
allgather and broadcast checked against numpy. Prints
"ok RANK SIZE LOCAL_RANK LOCAL_SIZE CROSS_SIZE" and "BACKENDS <list>".
"""

import numpy as np

import kerasdist as kd
from kerasdist._core import capi
from tests.support.collectives import allgather
from tests.support.collectives import allreduce
from tests.support.collectives import broadcast

kd.init()
rank, size = kd.rank(), kd.size()
for n in (1, 1000, 1 << 20):
    got = allreduce(np.arange(n, dtype=np.float32) + rank, name=f"cc.{n}",
                    op=kd.Sum)
    want = sum(np.arange(n, dtype=np.float32) + r for r in range(size))
    assert np.array_equal(got, want), (n, got[:4], want[:4])
got = allgather(np.full((rank + 1, 2), rank, np.int32), name="cc.gather")
want = np.concatenate([np.full((r + 1, 2), r, np.int32)
                       for r in range(size)])
assert np.array_equal(got, want), got
got = broadcast(np.arange(10, dtype=np.float64) * (rank + 1), 1,
                name="cc.bcast")
assert np.array_equal(got, np.arange(10) * 2.0), got
print("BACKENDS", capi.lib().kerasdist_backends().decode(), flush=True)
print("ok", rank, size, kd.local_rank(), kd.local_size(), kd.cross_size(),
      flush=True)
