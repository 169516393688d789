"""Run under a /dev/shm of 40 MiB (see test_core.py): an allreduce whose
shared slots cannot all be reserved must fall back to MPI on every rank and
still be right; smaller ones before and after must use shared memory."""

import sys

import numpy as np

import kerasdist as kd
from kerasdist import _capi
from np_collectives import allreduce

kd.init()
r, n = kd.rank(), kd.size()
for mib, want_shm in ((1, True), (48, False), (2, True)):
    x = np.arange(mib << 18, dtype=np.float32) + r
    before = _capi.lib().kerasdist_shm_allreduces()
    out = allreduce(x, f"shm_fallback.{mib}", op=kd.Sum)
    used = _capi.lib().kerasdist_shm_allreduces() - before
    want = np.arange(mib << 18, dtype=np.float32) * n + n * (n - 1) / 2
    if not np.array_equal(out, want):
        print(f"FAIL {mib} MiB: wrong sum", flush=True)
        sys.exit(1)
    if (used > 0) != want_shm:
        print(f"FAIL {mib} MiB: {used} shared-memory allreduces, expected "
              f"{'some' if want_shm else 'none'}", flush=True)
        sys.exit(1)
    print(f"OK {mib} MiB ({'shared memory' if used else 'MPI'})", flush=True)
print("OK fallback", flush=True)
kd.shutdown()
