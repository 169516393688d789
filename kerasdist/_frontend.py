"""Framework-free pieces the JAX and PyTorch front ends share: collective
names for eager calls, the row split of a reducescatter, and small eager
collectives on sizes (what an allgather or alltoall must know before it can
shape its result).

The ranks match collectives by name, so an unnamed one needs a name that is
the same on every rank for the same logical tensor. Eagerly, unnamed calls
are numbered in call order per kind (every rank makes them in the same
order, as with TF's eager ops).
"""

import ctypes
import itertools
import threading

import numpy as np

from kerasdist import _capi, basics

_counters = {}
_lock = threading.Lock()


def eager_name(kind, name):
    """`name`, or `<kind>.noname.<k>` for the k-th unnamed call of `kind`."""
    if name is not None:
        return str(name)
    with _lock:
        counter = _counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"


def scatter_rows(rows, n):
    """Rows each rank keeps in a reducescatter of `rows` rows over `n` ranks:
    earlier ranks get one more when it does not divide (as the core does)."""
    return tuple(rows // n + (k < rows % n) for k in range(n))


def host_int64(op, values, name):
    """Runs a small allgather (`_capi.OP_ALLGATHER`) or one-value-per-rank
    alltoall (`_capi.OP_ALLTOALL`) of int64 `values` through the core and
    returns the result as a tuple of ints."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    kwargs = {"splits": [1] * basics.size()} if op == _capi.OP_ALLTOALL else {}
    h = _capi.Handle(op, name, _capi.DTYPES[np.dtype(np.int64)], values.shape,
                     values.ctypes.data_as(ctypes.c_void_p), None, **kwargs)
    h.wait()
    ptr, shape = h.output()
    out = np.empty(shape, np.int64)
    if out.size:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
    return tuple(int(v) for v in out)
