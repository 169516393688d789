"""How kerasdist.jax's collectives run: the FFI targets of ops/jax/ffi.cc
(inside `jax.jit` and any other trace) or the core directly (eager calls on
concrete arrays), and the names ranks match them by."""

import ctypes
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import host as _host

_LIB_NAME = "_kerasdist_jax.so"
# FFI target -> symbol in the handler library.
_TARGETS = {
    "allreduce": "KerasdistAllreduce",
    "grouped_allreduce": "KerasdistGroupedAllreduce",
    "allgather": "KerasdistAllgather",
    "broadcast": "KerasdistBroadcast",
    "alltoall": "KerasdistAlltoall",
    "reducescatter": "KerasdistReducescatter",
    "barrier": "KerasdistBarrier",
}
# Targets with a CUDA handler too (ops/jax/ffi_cuda.cc): their result has
# the input's shape. The others run on GPU arrays only eagerly (through the
# host).
CUDA_TARGETS = frozenset(("allreduce", "grouped_allreduce", "broadcast",
                          "barrier"))
_lock = threading.Lock()
_registered = False
# Per-trace counters of unnamed collectives, keyed by the outermost jit trace.
_trace_counters = weakref.WeakKeyDictionary()


def library_path():
    return os.path.join(_capi.NATIVE_DIR, _LIB_NAME)


def _register():
    """Loads the handler library once and registers its FFI targets."""
    global _registered
    with _lock:
        if _registered:
            return
        path = library_path()
        if not os.path.exists(path):
            raise ImportError(
                f"kerasdist's JAX op library is missing ({path}): kerasdist "
                "was built without jax. Rebuild it now that jax is "
                "installed: `pip install --no-build-isolation -e .` from "
                "the kerasdist source tree (or `make -C ops JAX=1`).")
        _capi.lib()  # the core first, so the handlers resolve against it
        lib = ctypes.CDLL(path)
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(
                f"kerasdist_{target}", jax.ffi.pycapsule(getattr(lib, symbol)),
                platform="cpu")
            # A library built with the core's GPU backend also has handlers
            # on device memory for the shape-keeping collectives.
            if target in CUDA_TARGETS:
                symbol += "Cuda"
                if hasattr(lib, symbol):
                    jax.ffi.register_ffi_target(
                        f"kerasdist_{target}",
                        jax.ffi.pycapsule(getattr(lib, symbol)),
                        platform="CUDA")
        _registered = True


def program_trace():
    """The outermost `jax.jit` trace being built, or None when eager (also
    under an eager `jax.grad`, whose linearize trace stages nothing)."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe
    stack = core.unsafe_get_trace_stack(core.unsafe_get_current_trace())
    for trace in stack:  # outermost first
        if isinstance(trace, pe.DynamicJaxprTrace):
            return trace
    return None


def auto_name(kind, name):
    """The name ranks negotiate by; identical on every rank.

    Explicit names win. Eagerly, unnamed calls are numbered in call order.
    Inside `jax.jit` they are numbered per trace, prefixed with the traced
    function's name, like the unique names of a TF graph. Calls on a process
    set are counted apart (`<kind>.set<id>`), as eagerly: only its members
    make them, and the numbering of the others' calls must not shift.
    """
    if name is not None:
        return str(name)
    trace = program_trace()
    if trace is None:
        return _host.eager_name(kind, None)
    ps = _capi.current_process_set()
    if ps:
        kind = f"{kind}.set{ps}"
    with _lock:
        counters = _trace_counters.setdefault(trace, {})
        k = counters.get(kind, 0)
        counters[kind] = k + 1
    info = getattr(getattr(trace, "frame", None), "debug_info", None)
    func = getattr(info, "func_name", None) or "jit"
    return f"{kind}.{func}.{k}"


# The targets whose result has its input's shape, written in place inside
# jax.jit (the core's allreduce reads each element before it writes it).
_IN_PLACE = frozenset(("allreduce", "grouped_allreduce"))

# target -> (core op, result allocated by the core)
_HOST_OPS = {
    "allreduce": (_capi.OP_ALLREDUCE, False),
    "grouped_allreduce": (_capi.OP_ALLREDUCE, False),
    "allgather": (_capi.OP_ALLGATHER, True),
    "broadcast": (_capi.OP_BROADCAST, False),
    "alltoall": (_capi.OP_ALLTOALL, True),
    "reducescatter": (_capi.OP_REDUCESCATTER, True),
}


def call(target, out_types, *args, **attrs):
    """Runs a collective: as a custom call when traced, else at once.

    Concrete arrays (eager calls, and the forward and backward passes of an
    eager `jax.grad`) go to the core directly: an eager custom call would
    compile a program for every new name.
    """
    if any(isinstance(a, jax.core.Tracer) for a in args) or (
            program_trace() is not None):
        # has_side_effect: XLA must never drop a collective whose result is
        # unused on one rank (a broadcast's gradient off the root): the
        # others would wait for it forever.
        _register()
        if target not in CUDA_TARGETS and jax.default_backend() == "gpu":
            raise NotImplementedError(
                f"kerasdist.jax {target} inside jax.jit runs on the CPU "
                "only: its result's size depends on the other ranks. Call "
                "it outside jax.jit (eagerly, through host memory).")
        # An allreduce's result takes its input's buffer (the core reduces
        # in place): XLA copies the input first only where it is still
        # used after, so a step's gradients are not held twice.
        aliases = ({i: i for i in range(len(args))}
                   if target in _IN_PLACE and jax.default_backend() == "cpu"
                   else None)
        # The set is fixed at trace time: the program keeps the set its
        # collectives were traced on.
        return jax.ffi.ffi_call(f"kerasdist_{target}", out_types,
                                has_side_effect=True,
                                input_output_aliases=aliases)(
            *args, process_set=np.int32(_capi.current_process_set()),
            **attrs)
    return _run_eager(target, out_types, args, attrs)


def _run_eager(target, out_types, args, attrs):
    name = attrs.pop("tensor_name")
    if target == "barrier":
        _capi.Handle(_capi.OP_BARRIER, name, _capi.DTYPES[np.dtype(np.uint8)],
                     (), None, None).wait()
        return jnp.zeros((), jnp.int32)
    op, owned = _HOST_OPS[target]
    kwargs = {"reduce_op": int(attrs.get("reduce_op", basics.Sum)),
              "prescale": float(attrs.get("prescale_factor", 1.0)),
              "postscale": float(attrs.get("postscale_factor", 1.0)),
              "root_rank": int(attrs.get("root_rank", 0))}
    if "splits" in attrs:
        kwargs["splits"] = [int(s) for s in attrs["splits"]]
    many = isinstance(out_types, (list, tuple))
    shapes = [t.shape for t in (out_types if many else [out_types])]
    outs = _host.run_host(op, name, [np.asarray(a) for a in args], shapes,
                              group=target == "grouped_allreduce",
                              owned=owned, **kwargs)
    outs = [jnp.asarray(o) for o in outs]
    return outs if many else outs[0]
