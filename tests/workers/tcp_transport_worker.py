"""A rank of a job over the TCP transport (KERASDIST_TRANSPORT=tcp): every
collective of the core's host path checked against numpy, sizes that take
the TCP communicator's recursive doubling, its ring and its segments.
Prints "transport NAME", "BACKENDS <list>", "sets-refused <line>" (the
error of add_process_set, which needs MPI) and "tcp-ok RANK SIZE".

TCP_WORKER_PID_DIR=DIR: writes DIR/pid.RANK first.
TCP_WORKER_SPIN=1: keeps reducing afterwards until the job ends it.
"""

import os
import time

import numpy as np

import kerasdist as kd
from kerasdist._core import capi
from tests.support.collectives import allgather
from tests.support.collectives import allreduce
from tests.support.collectives import alltoall
from tests.support.collectives import broadcast
from tests.support.collectives import reducescatter

where = os.environ.get("TCP_WORKER_PID_DIR")
if where:
    with open(os.path.join(where, f"pid.{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
kd.init()
rank, size = kd.rank(), kd.size()
print("transport", capi.lib().kerasdist_transport().decode(), flush=True)
for n in (1, 1000, 1 << 16, (3 << 20) + 7):  # up to 12 MiB: 4 MiB segments
    x = np.arange(n, dtype=np.float32) % 1000 + rank
    got = allreduce(x, name=f"tcp.sum.{n}", op=kd.Sum)
    want = sum(np.arange(n, dtype=np.float32) % 1000 + r
               for r in range(size))
    assert np.array_equal(got, want), (n, got[:4], want[:4])
got = allreduce(np.array([rank, -rank], np.int64), name="tcp.max", op=kd.Max)
assert got.tolist() == [size - 1, 0], got
got = allgather(np.full((rank + 1, 3), rank, np.int32), name="tcp.gather")
want = np.concatenate([np.full((r + 1, 3), r, np.int32) for r in range(size)])
assert np.array_equal(got, want), got
got = broadcast(np.arange(1 << 18, dtype=np.float64) * (rank + 1), size - 1,
                name="tcp.bcast")
assert np.array_equal(got, np.arange(1 << 18) * float(size)), got[:4]
splits = [r + 1 for r in range(size)]
got, recv = alltoall(np.full(sum(splits), rank, np.float32), name="tcp.a2a",
                     splits=splits)
assert np.array_equal(got, np.full(size * (rank + 1), 0, np.float32) +
                      np.repeat(np.arange(size), rank + 1)), got
got = reducescatter(np.ones((size * 2, 5), np.float32) * (rank + 1),
                    name="tcp.rs", op=kd.Sum)
assert np.array_equal(got, np.full((2, 5), size * (size + 1) / 2)), got
try:
    kd.add_process_set([0])
    print("sets-refused none", flush=True)
except Exception as e:  # noqa: BLE001 (the line is what the test checks)
    print("sets-refused", str(e).replace("\n", " "), flush=True)
print("BACKENDS", capi.lib().kerasdist_backends().decode(), flush=True)
print("tcp-ok", rank, size, flush=True)
if os.environ.get("TCP_WORKER_SPIN"):
    step = 0
    while True:
        allreduce(np.ones(4, np.float32), name=f"spin.{step}", op=kd.Sum)
        step += 1
        time.sleep(0.05)
