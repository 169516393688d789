"""ctypes binding of libkerasdist_core's C API. Imports no framework.

Used by `basics` (init, rank, size...), by the framework-free core tests and
by the GPU checks that drive the core from cupy arrays.
"""

import ctypes
import os
import threading

import numpy as np

_LIB_NAME = "libkerasdist_core.so"
_lib = None
_lock = threading.Lock()

# Values of the core's enums (ops/core/types.h).
DTYPES = {
    np.dtype(np.float16): 0,
    np.dtype(np.float32): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.uint8): 6,
    np.dtype(np.bool_): 7,
}
BFLOAT16 = 1
OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALL = 0, 1, 2, 3
OP_REDUCESCATTER, OP_BARRIER = 4, 5
STATUS_NAMES = {1: "InvalidArgument", 2: "FailedPrecondition", 3: "Mismatch",
                4: "Aborted", 5: "Internal"}


class KerasdistError(RuntimeError):
    """A collective failed; `code` is the core's status code."""

    def __init__(self, message, code=5):
        super().__init__(message)
        self.code = code


class _Request(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("op", ctypes.c_int32),
        ("reduce_op", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("root_rank", ctypes.c_int32),
        ("prescale", ctypes.c_double),
        ("postscale", ctypes.c_double),
        ("nsplits", ctypes.c_int32),
        ("splits", ctypes.POINTER(ctypes.c_int64)),
        ("group", ctypes.c_char_p),
        ("group_size", ctypes.c_int32),
        ("device", ctypes.c_int32),
    ]


def library_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)


def lib():
    """Loads the core library once; raises ImportError saying how to build it."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not os.path.exists(path):
            raise ImportError(
                f"kerasdist's native library is missing ({path}). Build it "
                "with `pip install --no-build-isolation -e .` from the "
                "kerasdist source tree (or `make -C ops`).")
        l = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        i, d, s = ctypes.c_int, ctypes.c_double, ctypes.c_char_p
        i64 = ctypes.c_int64
        for name in ("rank", "size", "local_rank", "local_size", "cross_rank",
                     "cross_size", "is_initialized", "shutdown", "mpi_built",
                     "nccl_built", "simd16"):
            getattr(l, "kerasdist_" + name).restype = i
            getattr(l, "kerasdist_" + name).argtypes = []
        l.kerasdist_init.argtypes = [i, i, s]
        l.kerasdist_init.restype = i
        for name in ("last_error", "build_info", "config_variables",
                     "current_config"):
            getattr(l, "kerasdist_" + name).restype = s
            getattr(l, "kerasdist_" + name).argtypes = []
        l.kerasdist_convert16.argtypes = [ctypes.c_int32, i, i,
                                          ctypes.c_void_p, ctypes.c_void_p,
                                          i64]
        l.kerasdist_convert16.restype = i
        l.kerasdist_shm_allreduces.argtypes = []
        l.kerasdist_shm_allreduces.restype = i64
        l.kerasdist_cma_allreduces.argtypes = []
        l.kerasdist_cma_allreduces.restype = i64
        l.kerasdist_backends.argtypes = []
        l.kerasdist_backends.restype = ctypes.c_char_p
        l.kerasdist_backend_runs.argtypes = [ctypes.c_char_p]
        l.kerasdist_backend_runs.restype = i64
        l.kerasdist_enqueue.argtypes = [ctypes.POINTER(_Request),
                                        ctypes.c_void_p, ctypes.c_void_p]
        l.kerasdist_enqueue.restype = i64
        l.kerasdist_wait.argtypes = [i64, d]
        l.kerasdist_wait.restype = i
        l.kerasdist_handle_status.argtypes = [i64]
        l.kerasdist_handle_status.restype = i
        l.kerasdist_handle_message.argtypes = [i64]
        l.kerasdist_handle_message.restype = s
        l.kerasdist_handle_output.argtypes = [
            i64, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(i64)]
        l.kerasdist_handle_output.restype = ctypes.c_void_p
        l.kerasdist_handle_recv_splits.argtypes = [i64, ctypes.POINTER(i64)]
        l.kerasdist_handle_recv_splits.restype = i
        pi64, pd, pi = (ctypes.POINTER(i64), ctypes.POINTER(d),
                        ctypes.POINTER(i))
        l.kerasdist_start_timeline.argtypes = [s, i]
        l.kerasdist_start_timeline.restype = i
        l.kerasdist_stop_timeline.argtypes = []
        l.kerasdist_stop_timeline.restype = i
        l.kerasdist_stats.argtypes = [pi64, pi64, pd]
        l.kerasdist_stats.restype = i
        l.kerasdist_set_tunables.argtypes = [i64, d, i]
        l.kerasdist_set_tunables.restype = i
        l.kerasdist_get_tunables.argtypes = [pi64, pd, pi]
        l.kerasdist_get_tunables.restype = i
        l.kerasdist_release.argtypes = [i64]
        l.kerasdist_release.restype = None
        _lib = l
        return l


def last_error():
    return lib().kerasdist_last_error().decode()


def text(fn_name):
    return getattr(lib(), "kerasdist_" + fn_name)().decode()


def _i64_array(values):
    values = list(values)
    return (ctypes.c_int64 * max(len(values), 1))(*values)


class Handle:
    """An enqueued collective (host or device pointers); `wait()` finishes it."""

    def __init__(self, op, name, dtype_code, shape, input_ptr, output_ptr,
                 reduce_op=1, root_rank=0, prescale=1.0, postscale=1.0,
                 splits=None, group=None, group_size=0, device=-1):
        self._shape = _i64_array(shape)
        self._splits = _i64_array(splits or [])
        req = _Request(
            name=name.encode(), op=op, reduce_op=int(reduce_op),
            dtype=dtype_code, ndim=len(shape), shape=self._shape,
            root_rank=int(root_rank), prescale=float(prescale),
            postscale=float(postscale), nsplits=len(splits or []),
            splits=self._splits, group=(group or "").encode(),
            group_size=int(group_size), device=int(device))
        self.handle = lib().kerasdist_enqueue(ctypes.byref(req), input_ptr,
                                              output_ptr)
        if self.handle == 0:
            raise KerasdistError(last_error(), code=1)

    def wait(self, timeout=None):
        """Blocks until done; raises KerasdistError if the collective failed."""
        l = lib()
        t = -1.0 if timeout is None else float(timeout)
        if not l.kerasdist_wait(self.handle, t):
            raise TimeoutError(f"collective not finished after {timeout} s")
        code = l.kerasdist_handle_status(self.handle)
        if code != 0:
            raise KerasdistError(l.kerasdist_handle_message(self.handle).decode(),
                                 code)

    def output(self):
        """(pointer, shape) of a result the handle owns (allgather...)."""
        ndim = ctypes.c_int32(0)
        shape = (ctypes.c_int64 * 32)()
        ptr = lib().kerasdist_handle_output(self.handle, ctypes.byref(ndim), shape)
        return ptr, tuple(shape[i] for i in range(ndim.value))

    def recv_splits(self, n):
        out = (ctypes.c_int64 * max(n, 1))()
        k = lib().kerasdist_handle_recv_splits(self.handle, out)
        return [out[i] for i in range(k)]

    def __del__(self):
        if getattr(self, "handle", 0) and _lib is not None:
            _lib.kerasdist_release(self.handle)
