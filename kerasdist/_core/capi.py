"""ctypes binding of libkerasdist_core's C API. Imports no framework (and,
unless asked for `DTYPES`, not numpy either).

Used by `basics` (init, rank, size...), `autotune`, `timeline`, the tools
(`doctor`, `timeline`, `settings_doc`), the launcher (setting names), the
framework-free core tests and the GPU checks that drive the core from cupy
arrays.

The core owns every name and number that crosses the boundary: the settings
(their names, init() keywords, defaults, how values parse), the enum values of
ops/core/types.h and the timeline's event names. This module asks the library
for them (`settings_table()`, `dtype_codes()`, `reduce_ops()`, `op_types()`,
`timeline_phases()`) and keeps no copy.
"""

import collections
import contextlib
import ctypes
import functools
import os
import threading
import types

from kerasdist._core.errors import RANKS_LOST_TEXT  # noqa: F401 (elastic)
from kerasdist._core.errors import KerasdistError  # noqa: F401 (the API)
from kerasdist._core.errors import RanksLostError  # noqa: F401 (the API)
from kerasdist._core.errors import error

_LIB_NAME = "libkerasdist_core.so"
_lib = None
_lock = threading.Lock()


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
        ("process_set", ctypes.c_int32),
    ]


class Result(ctypes.Structure):
    """What kerasdist_enqueue_cb's callback receives (valid during the call)."""
    _fields_ = [
        ("status", ctypes.c_int32),
        ("message", ctypes.c_char_p),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_void_p),
        ("nsplits", ctypes.c_int32),
        ("recv_splits", ctypes.POINTER(ctypes.c_int64)),
    ]


# kerasdist_done_fn: done(arg, result), on the core's background thread.
DONE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(Result))


# The native libraries (the core, the TF and JAX op libraries and the build
# record) sit in the package's root directory.
NATIVE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def library_path():
    return os.path.join(NATIVE_DIR, _LIB_NAME)


def lib():
    """Loads the core library once; raises ImportError saying how to build
    it."""
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
                     "nccl_built", "simd16", "recoveries", "grows",
                     "shrinks"):
            getattr(l, "kerasdist_" + name).restype = i
            getattr(l, "kerasdist_" + name).argtypes = []
        l.kerasdist_init.argtypes = [i, i, s]
        l.kerasdist_init.restype = i
        l.kerasdist_set_tcp_job.argtypes = [s]
        l.kerasdist_set_tcp_job.restype = i
        for name in ("last_error", "transport", "build_info",
                     "config_variables", "current_config", "settings_table",
                     "dtypes",
                     "reduce_ops", "op_types", "timeline_phases"):
            getattr(l, "kerasdist_" + name).restype = s
            getattr(l, "kerasdist_" + name).argtypes = []
        l.kerasdist_resolve_config.argtypes = [s]
        l.kerasdist_resolve_config.restype = s
        l.kerasdist_parse_setting.argtypes = [s, s]
        l.kerasdist_parse_setting.restype = s
        l.kerasdist_convert16.argtypes = [ctypes.c_int32, i, i,
                                          ctypes.c_void_p, ctypes.c_void_p,
                                          i64]
        l.kerasdist_convert16.restype = i
        l.kerasdist_backends.argtypes = []
        l.kerasdist_backends.restype = ctypes.c_char_p
        l.kerasdist_backend_runs.argtypes = [ctypes.c_char_p]
        l.kerasdist_backend_runs.restype = i64
        l.kerasdist_enqueue.argtypes = [ctypes.POINTER(_Request),
                                        ctypes.c_void_p, ctypes.c_void_p]
        l.kerasdist_enqueue.restype = i64
        l.kerasdist_enqueue_into.argtypes = [
            ctypes.POINTER(_Request), ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int32, ctypes.POINTER(i64)]
        l.kerasdist_enqueue_into.restype = i64
        l.kerasdist_enqueue_group.argtypes = [
            ctypes.POINTER(_Request), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
            ctypes.POINTER(i64)]
        l.kerasdist_enqueue_group.restype = i
        l.kerasdist_enqueue_cb.argtypes = [
            ctypes.POINTER(_Request), ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, DONE_FN, ctypes.c_void_p]
        l.kerasdist_enqueue_cb.restype = i
        pi64, pd, pi = (ctypes.POINTER(i64), ctypes.POINTER(d),
                        ctypes.POINTER(i))
        c32 = ctypes.c_int32
        pi32 = ctypes.POINTER(c32)
        for name, restype, argtypes in (
                ("wait", i, [i64, d]),
                ("handle_status", i, [i64]),
                ("handle_message", s, [i64]),
                ("handle_output", ctypes.c_void_p, [i64, pi32, pi64]),
                ("handle_recv_splits", i, [i64, pi64]),
                ("start_timeline", i, [s, i]),
                ("stop_timeline", i, []),
                ("label_tensor", i, [s, s]),
                ("stats", i, [pi64, pi64, pd]),
                ("set_tunables", i, [i64, d, i]),
                ("get_tunables", i, [pi64, pd, pi]),
                ("release", None, [i64]),
                ("add_process_set", i, [pi32, c32]),
                ("remove_process_set", i, [c32]),
                ("process_set_ids", i, [pi32, c32]),
                ("process_set_ranks", i, [c32, pi32, c32]),
                ("process_set_rank", i, [c32])):
            fn = getattr(l, "kerasdist_" + name)
            fn.restype, fn.argtypes = restype, argtypes
        _lib = l
        return l


_labelled = {}


def label_tensors(pairs):
    """Names timeline rows: each (tensor name, label) pair, e.g. a grouped
    gradient member `DistributedOptimizer.group0of1.3` and its variable's
    path. A pair already set is skipped, so calling this at every step
    costs a dict lookup per tensor."""
    for name, label in pairs:
        if _labelled.get(name) != label:
            lib().kerasdist_label_tensor(name.encode(), label.encode())
            _labelled[name] = label


def last_error():
    return lib().kerasdist_last_error().decode()


def text(fn_name):
    return getattr(lib(), "kerasdist_" + fn_name)().decode()


def backend_runs(name):
    """How many batches the data path's backend `name` ("mpi", "shm",
    "cma", "hier", "nccl", ...: ops/core/backends/backends.cc's list) ran
    since init; 0 for a backend not in this job's list, -1 before init."""
    return lib().kerasdist_backend_runs(name.encode())


def backends():
    """The data path's backends in the order a batch tries them."""
    return text("backends").split(",") if text("backends") else []


def _pairs(fn_name):
    """The "name=value" lines a C API function returns, as an ordered dict."""
    return dict(line.split("=", 1) for line in text(fn_name).splitlines()
                if "=" in line)


# ---- settings (ops/core/config.cc's table) ----------------------------------

Setting = collections.namedtuple("Setting", "name key in_init default doc")
Setting.__doc__ = """One runtime setting: its environment variable, its
short name `key`, whether init() takes `key` as a keyword argument, its
default as `current_settings()` prints it, and a doc line."""


@functools.lru_cache(maxsize=None)
def settings_table():
    """Every setting the runtime understands, as a tuple of `Setting`."""
    rows = []
    for line in text("settings_table").splitlines():
        name, key, in_init, default, doc = line.split("\t", 4)
        rows.append(Setting(name, key, in_init == "1", default, doc))
    return tuple(rows)


def setting_name(key):
    """The environment variable of the setting `key` (`"autotune"` ->
    `"KERASDIST_AUTOTUNE"`).

    Raises:
        KeyError: no setting has that key.
    """
    for s in settings_table():
        if s.key == key:
            return s.name
    known = sorted(s.key for s in settings_table())
    raise KeyError(f"no kerasdist setting has the key {key!r}; expected "
                   f"one of {known}.")


def current_settings():
    """The running runtime's settings (name -> value); {} before init."""
    return _pairs("current_config")


def resolve_settings(overrides=""):
    """The settings init() would run with, given the environment and
    `overrides` ("NAME=value" lines); starts nothing.

    Raises:
        ValueError: a value is malformed or a name unknown (the core's text).
    """
    out = lib().kerasdist_resolve_config(overrides.encode())
    if out is None:
        raise ValueError(last_error())
    return dict(line.split("=", 1) for line in out.decode().splitlines()
                if "=" in line)


def parse_setting(name, value):
    """`value` of setting `name` as the runtime holds it, printed as
    `current_settings()` does (booleans as "1" or "0").

    Raises:
        ValueError: the value is malformed or the name unknown.
    """
    out = lib().kerasdist_parse_setting(name.encode(), str(value).encode())
    if out is None:
        raise ValueError(last_error())
    return out.decode()


# ---- enums (ops/core/types.h) and timeline names (ops/core/timeline.h) ------

def _frozen(mapping):
    """A read-only view: the cached tables are shared by every caller."""
    return types.MappingProxyType(mapping)


@functools.lru_cache(maxsize=None)
def dtype_codes():
    """dtype name ("float32", "bfloat16"...) -> the core's DataType value."""
    return _frozen({k: int(v) for k, v in _pairs("dtypes").items()})


@functools.lru_cache(maxsize=None)
def reduce_ops():
    """Reduction name ("Average", "Sum", "Min", "Max", "Product") -> value."""
    return _frozen({k: int(v) for k, v in _pairs("reduce_ops").items()})


@functools.lru_cache(maxsize=None)
def op_types():
    """Collective name ("allreduce"...) -> the core's OpType value."""
    return _frozen({k: int(v) for k, v in _pairs("op_types").items()})


@functools.lru_cache(maxsize=None)
def timeline_phases():
    """Timeline event name -> role (negotiate, queue, copy_in, collective,
    copy_out, marker), in the order a tensor meets the phases."""
    return _frozen(_pairs("timeline_phases"))


def _numpy_dtypes():
    import numpy as np  # only the handle API's users need it

    out = {}
    for name, code in dtype_codes().items():
        try:
            out[np.dtype(name)] = code
        except TypeError:
            pass  # bfloat16: no numpy dtype (BFLOAT16 holds its code)
    return out


def __getattr__(name):
    """Constants of the handle API, from the library on first use:
    DTYPES (numpy dtype -> code), BFLOAT16 and OP_ALLREDUCE & co."""
    if name == "DTYPES":
        value = _numpy_dtypes()
    elif name == "BFLOAT16":
        value = dtype_codes()["bfloat16"]
    elif name.startswith("OP_") and name[3:].lower() in op_types():
        value = op_types()[name[3:].lower()]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _i64_array(values):
    values = list(values)
    return (ctypes.c_int64 * max(len(values), 1))(*values)


_scope = threading.local()


@contextlib.contextmanager
def process_set_scope(process_set_id):
    """Collectives this thread enqueues inside run on process set
    `process_set_id` (the public collectives' `process_set=` argument on
    JAX and PyTorch, whose ops reach the core through `Handle`)."""
    old = getattr(_scope, "id", 0)
    _scope.id = int(process_set_id)
    try:
        yield
    finally:
        _scope.id = old


def current_process_set():
    """The process set id of the innermost `process_set_scope` (0)."""
    return getattr(_scope, "id", 0)


def add_process_set(ranks):
    """Collective over every rank: the new set's id."""
    ranks = [int(r) for r in ranks]
    arr = (ctypes.c_int32 * max(len(ranks), 1))(*ranks)
    got = lib().kerasdist_add_process_set(arr, len(ranks))
    if got < 0:
        raise ValueError(last_error())
    return got


def remove_process_set(process_set_id):
    if lib().kerasdist_remove_process_set(int(process_set_id)) != 0:
        raise ValueError(last_error())


def process_set_ids():
    cap = 1024
    arr = (ctypes.c_int32 * cap)()
    n = lib().kerasdist_process_set_ids(arr, cap)
    return [arr[i] for i in range(min(max(n, 0), cap))]


def process_set_ranks(process_set_id):
    """The job ranks of a set; None for an unknown id."""
    cap = 1 << 16
    arr = (ctypes.c_int32 * cap)()
    n = lib().kerasdist_process_set_ranks(int(process_set_id), arr, cap)
    if n < 0:
        return None
    return [arr[i] for i in range(min(n, cap))]


def process_set_rank(process_set_id):
    return lib().kerasdist_process_set_rank(int(process_set_id))


def _fill_request(req, op, name, dtype_code, shape, reduce_op=None,
                  root_rank=0, prescale=1.0, postscale=1.0, splits=None,
                  group=None, group_size=0, device=-1, process_set=None):
    """Fills a `_Request`; returns the arrays it points into (keep them
    alive until it is enqueued)."""
    if process_set is None:
        process_set = current_process_set()
    if reduce_op is None:
        reduce_op = reduce_ops()["Sum"]
    shape_array, split_array = _i64_array(shape), _i64_array(splits or [])
    req.name = name.encode()
    req.op, req.reduce_op, req.dtype = op, int(reduce_op), dtype_code
    req.ndim, req.shape = len(shape), shape_array
    req.root_rank = int(root_rank)
    req.prescale, req.postscale = float(prescale), float(postscale)
    req.nsplits, req.splits = len(splits or []), split_array
    req.group, req.group_size = (group or "").encode(), int(group_size)
    req.device, req.process_set = int(device), int(process_set)
    return shape_array, split_array


def start_group(op, name, members, **kwargs):
    """Enqueues the members of the group `name` (named `<name>.<i>`) with
    one call into the core, which sees the group whole, as the TF op and
    the JAX handler enqueue theirs. `members`: (dtype code, shape, input
    pointer, output pointer or None, device: -1 for host memory) each;
    `kwargs` as `Handle`'s. Returns a `Handle` per member; KerasdistError
    when not all were queued."""
    n = len(members)
    requests = (_Request * max(n, 1))()
    inputs = (ctypes.c_void_p * max(n, 1))()
    outputs = (ctypes.c_void_p * max(n, 1))()
    ids = (ctypes.c_int64 * max(n, 1))()
    keep = []
    for i, (dtype_code, shape, input_ptr, output_ptr,
            device) in enumerate(members):
        keep.append(_fill_request(
            requests[i], op, f"{name}.{i}", dtype_code, shape, group=name,
            group_size=n, device=device, **kwargs))
        inputs[i], outputs[i] = input_ptr, output_ptr
    code = lib().kerasdist_enqueue_group(requests, inputs, outputs, n, ids)
    # Handles of the members queued, even on failure: they are released
    # (not freed while the core holds them) when these go.
    handles = [Handle.of(ids[i]) for i in range(n) if ids[i]]
    if code != 0:
        raise error(last_error(), 1)
    return handles


class Handle:
    """An enqueued collective (host or device pointers); `wait()` finishes
    it."""

    def __init__(self, op, name, dtype_code, shape, input_ptr, output_ptr,
                 into_shape=None, **kwargs):
        """`into_shape`: `output_ptr` holds a result of that shape, which
        negotiation sizes (kerasdist_enqueue_into): the core writes there
        only if the result has it; `output()` gives the shape it had."""
        req = _Request()
        keep = _fill_request(req, op, name, dtype_code, shape, **kwargs)
        if into_shape is None:
            self.handle = lib().kerasdist_enqueue(ctypes.byref(req),
                                                  input_ptr, output_ptr)
        else:
            dims = (ctypes.c_int64 * max(1, len(into_shape)))(*into_shape)
            self.handle = lib().kerasdist_enqueue_into(
                ctypes.byref(req), input_ptr, output_ptr, len(into_shape),
                dims)
        del keep
        if self.handle == 0:
            raise error(last_error(), 1)

    @classmethod
    def of(cls, handle_id):
        """The Handle of an id the core gave (kerasdist_enqueue_group)."""
        h = cls.__new__(cls)
        h.handle = handle_id
        return h

    def wait(self, timeout=None):
        """Blocks until done; raises KerasdistError if the collective failed."""
        l = lib()
        t = -1.0 if timeout is None else float(timeout)
        if not l.kerasdist_wait(self.handle, t):
            raise TimeoutError(f"collective not finished after {timeout} s")
        code = l.kerasdist_handle_status(self.handle)
        if code != 0:
            raise error(l.kerasdist_handle_message(self.handle).decode(),
                        code)

    def output(self):
        """(pointer, shape) of a result the handle owns (allgather...)."""
        ndim = ctypes.c_int32(0)
        shape = (ctypes.c_int64 * 32)()
        ptr = lib().kerasdist_handle_output(self.handle, ctypes.byref(ndim),
                                            shape)
        return ptr, tuple(shape[i] for i in range(ndim.value))

    def recv_splits(self, n):
        out = (ctypes.c_int64 * max(n, 1))()
        k = lib().kerasdist_handle_recv_splits(self.handle, out)
        return [out[i] for i in range(k)]

    def __del__(self):
        if getattr(self, "handle", 0) and _lib is not None:
            _lib.kerasdist_release(self.handle)
