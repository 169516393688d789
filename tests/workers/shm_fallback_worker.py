"""Run under a /dev/shm of 40 MiB (see test_core.py).

With the in-place reads off, an allreduce whose shared slots cannot all be
reserved must fall back to MPI on every rank and still be right; smaller ones
before and after must use the slots. With them on (the default), nothing is
staged in /dev/shm, so every size stays on the single-node path.

Reducescatter and allgather use the slots either way: a 48 MiB
reducescatter and an allgather of 24 MiB parts (2 x 24 MiB of slots) must
fall back to MPI on every rank, and 2 MiB ones before and after must not.
"""

import sys

import numpy as np

import kerasdist as kd
from kerasdist._core import capi as _capi
from tests.support.collectives import allgather
from tests.support.collectives import allreduce
from tests.support.collectives import reducescatter


def scatter_and_gather(r, n):
    """Reducescatters and allgathers of 2, 48 (24 a part) and 2 MiB: on the
    slots, on MPI (the slots cannot all be reserved), on the slots."""
    for mib, want_shm in ((2, True), (48, False), (2, True)):
        rows = (mib << 18) + 1  # float32; uneven counts
        before = _capi.backend_runs("shm")
        x = np.arange(rows, dtype=np.float32) % 1000 + r
        got = reducescatter(x, f"shm_fallback.rs.{mib}", op=kd.Sum)
        counts = [rows // n + (k < rows % n) for k in range(n)]
        start = sum(counts[:r])
        want = (np.arange(start, start + counts[r], dtype=np.float32) % 1000
                ) * n + n * (n - 1) / 2
        part = np.arange((mib << 18) // n, dtype=np.float32) + r
        every = allgather(part.reshape(-1, 2), f"shm_fallback.ag.{mib}")
        ok = np.array_equal(got, want) and np.array_equal(
            every.ravel(), np.concatenate([part - r + k for k in range(n)]))
        used = _capi.backend_runs("shm") - before
        if not ok or used != (2 if want_shm else 0):
            print(f"FAIL reducescatter/allgather {mib} MiB: right {ok}, "
                  f"{used} on the slots", flush=True)
            sys.exit(1)
        print(f"OK rs/ag {mib} MiB ({'slots' if used else 'MPI'})",
              flush=True)


for cma in (False, True):
    kd.init(cma_allreduce=cma)
    r, n = kd.rank(), kd.size()
    for mib, want_shm in ((1, True), (48, cma), (2, True)):
        x = np.arange(mib << 18, dtype=np.float32) + r
        before = (_capi.backend_runs("shm"), _capi.backend_runs("cma"))
        out = allreduce(x, f"shm_fallback.{mib}", op=kd.Sum)
        # Single-node allreduces: through the slots (shm) or in place (cma).
        used_cma = _capi.backend_runs("cma") - before[1]
        used = _capi.backend_runs("shm") - before[0] + used_cma
        want = np.arange(mib << 18, dtype=np.float32) * n + n * (n - 1) / 2
        if not np.array_equal(out, want):
            print(f"FAIL {mib} MiB: wrong sum", flush=True)
            sys.exit(1)
        if (used > 0) != want_shm or (used_cma > 0) != (cma and want_shm):
            print(f"FAIL {mib} MiB (in place {cma}): {used} single-node "
                  f"allreduces, {used_cma} in place", flush=True)
            sys.exit(1)
        path = "in place" if used_cma else "slots" if used else "MPI"
        print(f"OK {mib} MiB ({path})", flush=True)
    scatter_and_gather(r, n)
    kd.shutdown()
print("OK fallback", flush=True)
