"""Collectives on host numpy arrays through the core's C API (no TensorFlow),
for the core tests' workers. Each call enqueues one collective and waits for
it, like the TF ops do.

allreduce, broadcast and barrier are kerasdist._core.host.run_host, the
library's own host path. The rest has no library equivalent: allgather with
a first dimension that differs between ranks, alltoall with explicit splits
(and the received splits), reducescatter, and start_allreduce (a collective
left in flight, to test what happens meanwhile).
"""

import ctypes

import numpy as np

from kerasdist._core import capi as _capi
from kerasdist._core import host as _host

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

_WAIT_S = 120  # a collective that does not finish fails the rank


# The library's dtype codes, contiguous copies and data pointers.
_code, _contig, _ptr = _host._code, _host._contiguous, _host._ptr


def start_allreduce(x, name, op=0, prescale=1.0, postscale=1.0, group=None,
                    group_size=0):
    """Enqueues an allreduce and returns (handle, input, output) without
    waiting; the caller keeps the arrays alive until handle.wait()."""
    x = _contig(x)
    out = np.empty_like(x)
    h = _capi.Handle(_capi.OP_ALLREDUCE, name, _code(x.dtype), x.shape,
                     _ptr(x), _ptr(out), reduce_op=op, prescale=prescale,
                     postscale=postscale, group=group, group_size=group_size)
    return h, x, out


def allreduce(x, name, op=0, prescale=1.0, postscale=1.0):
    x = np.asarray(x)
    return _host.run_host(_capi.OP_ALLREDUCE, name, [x], [x.shape],
                          reduce_op=op, prescale=prescale,
                          postscale=postscale)[0]


def broadcast(x, root, name):
    x = np.asarray(x)
    return _host.run_host(_capi.OP_BROADCAST, name, [x], [x.shape],
                          root_rank=root)[0]


def barrier(name="barrier"):
    _host.host_barrier(name)


def _owned(h, dtype):
    ptr, shape = h.output()
    n = int(np.prod(shape)) if shape else 1
    out = np.empty(shape, dtype=dtype)
    if n and ptr:
        ctypes.memmove(out.ctypes.data, ptr, n * out.itemsize)
    return out


def allgather(x, name):
    x = _contig(x)
    h = _capi.Handle(_capi.OP_ALLGATHER, name, _code(x.dtype), x.shape,
                     _ptr(x), None)
    h.wait(timeout=_WAIT_S)
    return _owned(h, x.dtype)


def alltoall(x, name, splits=None, size=None):
    x = _contig(x)
    h = _capi.Handle(_capi.OP_ALLTOALL, name, _code(x.dtype), x.shape,
                     _ptr(x), None, splits=splits)
    h.wait(timeout=_WAIT_S)
    return _owned(h, x.dtype), h.recv_splits(size or 64)


def reducescatter(x, name, op=0, prescale=1.0, postscale=1.0):
    x = _contig(x)
    h = _capi.Handle(_capi.OP_REDUCESCATTER, name, _code(x.dtype), x.shape,
                     _ptr(x), None, reduce_op=op, prescale=prescale,
                     postscale=postscale)
    h.wait(timeout=_WAIT_S)
    return _owned(h, x.dtype)
