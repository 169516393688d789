"""Loads the TensorFlow op library once, after checking it was built for the
TensorFlow that is running (a mismatch would otherwise surface as an
`undefined symbol` deep inside TensorFlow)."""

import os

import tensorflow as tf

from kerasdist._core import build_check as _build_check
from kerasdist._core import capi as _capi

_ops = None


def _autograph_leaves_kerasdist_alone():
    """Keeps AutoGraph from converting kerasdist's own functions when a
    `tf.function` calls them, as TensorFlow does for Keras and itself.

    kerasdist's code runs as written inside graphs (Keras' train step
    calls it unconverted anyway); converted, its plain-Python helpers
    (the lazy loader below: `os.path.exists`, importlib's finders) made
    AutoGraph print "could not transform" warnings on every rank."""
    from tensorflow.python.autograph.core import config
    rule = config.DoNotConvert("kerasdist")
    if not any(isinstance(r, config.DoNotConvert) and r.matches("kerasdist")
               for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule,) + tuple(config.CONVERSION_RULES)


_autograph_leaves_kerasdist_alone()


def _rebuild_hint():
    return ("Rebuild kerasdist against it: from the kerasdist source tree run "
            "`pip install --no-build-isolation -e .` "
            "(or `make -C ops clean all`).")


def ops():
    """The generated op wrappers (`KerasdistAllreduce` & co)."""
    global _ops
    if _ops is not None:
        return _ops
    here = _capi.NATIVE_DIR
    path = os.path.join(here, "_kerasdist_ops.so")
    if not os.path.exists(path):
        raise ImportError(f"kerasdist's TensorFlow op library is missing "
                          f"({path}). {_rebuild_hint()}")
    mismatch = _build_check.mismatch(
        "tensorflow", _build_check.build_info(
            os.path.join(here, "_build_info.json")).get("tensorflow"),
        tf.__version__, _build_check.installed("tensorflow")[0])
    if mismatch:
        raise ImportError(mismatch)
    _capi.lib()  # the core first, so the op library resolves against it
    try:
        _ops = tf.load_op_library(path)
    except tf.errors.NotFoundError as e:
        raise ImportError(
            f"could not load {path} into TensorFlow {tf.__version__}: {e}. "
            f"{_rebuild_hint()}") from None
    _let_collectives_run_concurrently()
    return _ops


# The collectives (not the barrier) are stateful, so graph optimisations never
# fold, merge or prune them. But tf.function chains every stateful op after the
# previous one ("automatic control dependencies"): the collectives of a step
# would then run one at a time, nothing could be fused, and a grouped allreduce
# would wait for itself. Their order does not matter (the runtime negotiates
# it), so they are declared order-insensitive-but-must-run, like TF's own
# infeeds.
_CONCURRENT_OPS = frozenset((
    "KerasdistAllreduce", "KerasdistGroupedAllreduce", "KerasdistAllgather",
    "KerasdistBroadcast",
    "KerasdistAlltoall", "KerasdistReducescatter"))


def _let_collectives_run_concurrently():
    from tensorflow.python.framework import auto_control_deps as acd
    current = getattr(acd, "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS", None)
    if current is None:
        raise ImportError(
            f"TensorFlow {tf.__version__} lacks auto_control_deps."
            "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS, which kerasdist needs to "
            "run collectives concurrently inside tf.function; use TensorFlow "
            "2.21.")
    acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = frozenset(
        current | _CONCURRENT_OPS)


_xla = None
_xla_gpu = None


def xla_kernels():
    """True when the op library has XLA kernels for the collectives
    (ops/tf/xla_kernels.cc; a build with TF_XLA=0 has none), so that they
    run inside `tf.function(jit_compile=True)` on the CPU."""
    global _xla
    if _xla is None:
        import ctypes
        ops()
        lib = ctypes.CDLL(os.path.join(_capi.NATIVE_DIR, "_kerasdist_ops.so"))
        _xla = hasattr(lib, "kerasdist_tf_xla_kernels")
    return _xla


def xla_gpu_kernels():
    """True when the op library's XLA kernels also serve TensorFlow's XLA
    on a GPU (ops/tf/xla_ffi_cuda.cc, built with the core's GPU backend):
    allreduce, grouped allreduce, broadcast and the barrier."""
    global _xla_gpu
    if _xla_gpu is None:
        import ctypes
        ops()
        lib = ctypes.CDLL(os.path.join(_capi.NATIVE_DIR, "_kerasdist_ops.so"))
        _xla_gpu = hasattr(lib, "kerasdist_tf_xla_gpu_kernels")
    return _xla_gpu
