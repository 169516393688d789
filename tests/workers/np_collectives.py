"""A numpy front end over the core's C API (no TensorFlow), for the core tests.

Each function enqueues one collective and waits for it, like the TF ops do.
"""

import ctypes

import numpy as np

from kerasdist._core import capi as _capi

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None


def _code(dtype):
    dtype = np.dtype(dtype)
    if BF16 is not None and dtype == BF16:
        return _capi.BFLOAT16
    return _capi.DTYPES[dtype]


def _contig(x):
    x = np.asarray(x)  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    return x if x.flags.c_contiguous else x.copy()


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p) if a.size else None


def start_allreduce(x, name, op=0, prescale=1.0, postscale=1.0, group=None,
                    group_size=0):
    x = _contig(x)
    out = np.empty_like(x)
    h = _capi.Handle(_capi.OP_ALLREDUCE, name, _code(x.dtype), x.shape,
                     _ptr(x), _ptr(out), reduce_op=op, prescale=prescale,
                     postscale=postscale, group=group, group_size=group_size)
    return h, x, out


def allreduce(x, name, op=0, prescale=1.0, postscale=1.0):
    h, _, out = start_allreduce(x, name, op, prescale, postscale)
    h.wait(timeout=120)
    return out


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
    h.wait(timeout=120)
    return _owned(h, x.dtype)


def broadcast(x, root, name):
    x = _contig(x)
    out = np.empty_like(x)
    h = _capi.Handle(_capi.OP_BROADCAST, name, _code(x.dtype), x.shape,
                     _ptr(x), _ptr(out), root_rank=root)
    h.wait(timeout=120)
    return out


def alltoall(x, name, splits=None, size=None):
    x = _contig(x)
    h = _capi.Handle(_capi.OP_ALLTOALL, name, _code(x.dtype), x.shape,
                     _ptr(x), None, splits=splits)
    h.wait(timeout=120)
    return _owned(h, x.dtype), h.recv_splits(size or 64)


def reducescatter(x, name, op=0, prescale=1.0, postscale=1.0):
    x = _contig(x)
    h = _capi.Handle(_capi.OP_REDUCESCATTER, name, _code(x.dtype), x.shape,
                     _ptr(x), None, reduce_op=op, prescale=prescale,
                     postscale=postscale)
    h.wait(timeout=120)
    return _owned(h, x.dtype)


def barrier(name="barrier"):
    h = _capi.Handle(_capi.OP_BARRIER, name, _capi.DTYPES[np.dtype(np.uint8)],
                     (), None, None)
    h.wait(timeout=120)
