"""Run under a /dev/shm of 40 MiB (see test_core.py).

With the in-place reads off, an allreduce whose shared slots cannot all be
reserved must fall back to MPI on every rank and still be right; smaller ones
before and after must use the slots. With them on (the default), nothing is
staged in /dev/shm, so every size stays on the single-node path.
"""

import sys

import numpy as np

import kerasdist as kd
from kerasdist._core import capi as _capi
from tests.support.collectives import allreduce

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
    kd.shutdown()
print("OK fallback", flush=True)
