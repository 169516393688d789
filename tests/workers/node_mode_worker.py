"""A rank started by `kerasdist run` in node mode (no mpiexec): kd.init()
must form one job of every node's ranks. Checks an allreduce against numpy
and that kerasdist's rank and size are the RANK and WORLD_SIZE node mode
set; prints "node-ok RANK SIZE LOCAL_RANK LOCAL_WORLD_SIZE KD_LOCAL_RANK
KD_LOCAL_SIZE" and "first-collective-at T" (time.time() when the first
allreduce returned).

NODE_WORKER_PIDS=DIR: write the pid to DIR/pid.RANK first.
NODE_WORKER_FAIL=R: rank R raises after the first allreduce; the others
keep reducing (waiting for it) until the job ends them.
NODE_WORKER_SPIN=1: every rank keeps reducing after the first allreduce.
"""

import os
import time

import numpy as np

pids = os.environ.get("NODE_WORKER_PIDS")
if pids:
    with open(os.path.join(pids, f"pid.{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))

import kerasdist as kd  # noqa: E402
from tests.support.collectives import allreduce  # noqa: E402

kd.init()
rank, size = kd.rank(), kd.size()
assert (rank, size) == (int(os.environ["RANK"]),
                        int(os.environ["WORLD_SIZE"])), (rank, size)
for n in (1, 1000, 1 << 18):
    got = allreduce(np.arange(n, dtype=np.float32) + rank, name=f"nm.{n}",
                    op=kd.Sum)
    want = sum(np.arange(n, dtype=np.float32) + r for r in range(size))
    assert np.array_equal(got, want), (n, got[:4], want[:4])
    if n == 1:
        print("first-collective-at", repr(time.time()), flush=True)
print("node-ok", rank, size, os.environ["LOCAL_RANK"],
      os.environ["LOCAL_WORLD_SIZE"], kd.local_rank(), kd.local_size(),
      flush=True)

fail = os.environ.get("NODE_WORKER_FAIL")
if fail is not None and int(fail) == rank:
    raise RuntimeError(f"rank {rank} fails on purpose")
if fail is not None or os.environ.get("NODE_WORKER_SPIN"):
    step = 0
    while True:
        allreduce(np.ones(4, np.float32), name=f"spin.{step}", op=kd.Sum)
        step += 1
        time.sleep(0.05)
