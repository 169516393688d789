"""Worker for tests/cluster/test_multihost.py: one rank of a job that may
span test hosts.

    kerasdist run -np 4 -H kdt0:2,kdt1:2 python multihost_worker.py [MIB]

Prints one `TOPO` line with where this rank runs as the runtime and the
launcher see it, then allreduces MIB (default 16) MiB of float32 with the
single-node paths (shared-memory slots, in-place reads) allowed for every
size, checks the sum against numpy, and prints how many allreduces took a
single-node path: `PATHS single_node=N in_place=M`.
"""

import os
import socket
import sys

import numpy as np

import kerasdist as kd
from kerasdist._core import capi as _capi
from tests.support.collectives import allreduce
from tests.support.collectives import barrier

MIB = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
kd.init(shm_allreduce_min_bytes=1, cma_min_tensor_bytes=0)
r, n = kd.rank(), kd.size()
print(f"TOPO rank={r} size={n} local_rank={kd.local_rank()} "
      f"local_size={kd.local_size()} cross_rank={kd.cross_rank()} "
      f"cross_size={kd.cross_size()} host={socket.gethostname()} "
      f"env_host={os.environ.get('KERASDIST_HOSTNAME', '-')}", flush=True)

count = int(MIB * (1 << 20)) // 4
x = np.arange(count, dtype=np.float32) % 1000 + r
barrier("before")
got = allreduce(x, "big", op=kd.Sum)
barrier("after")
want = (np.arange(count, dtype=np.float32) % 1000) * n + n * (n - 1) / 2
if not np.array_equal(got, want):
    print(f"FAIL sum of {MIB:g} MiB: {got[:4]} != {want[:4]}", flush=True)
    sys.exit(1)
in_place = _capi.backend_runs("cma")
print(f"PATHS single_node={_capi.backend_runs('shm') + in_place} "
      f"in_place={in_place}", flush=True)
print("OK", flush=True)
kd.shutdown()
