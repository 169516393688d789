"""kerasdist: fast synchronous data-parallel training for Keras 3 on TensorFlow.

    import kerasdist as kd
    kd.init()
    ...
    optimizer = kd.DistributedOptimizer(optimizer)

Attributes are imported on first use, so `python -m kerasdist.run` (the
launcher) starts without importing TensorFlow. The Keras layer
(DistributedOptimizer, callbacks, data, Trainer) runs on the Keras backend
that KERAS_BACKEND selects (tensorflow, jax or torch), and so do the
collectives here (`kerasdist.allreduce`...): they take that backend's
tensors. `kerasdist.jax` and `kerasdist.torch` offer the same collectives
without Keras, and never import TensorFlow.
"""

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "init": "basics", "shutdown": "basics", "is_initialized": "basics",
    "rank": "basics", "size": "basics", "local_rank": "basics",
    "local_size": "basics", "cross_rank": "basics", "cross_size": "basics",
    "mpi_built": "basics", "nccl_built": "basics", "build_info": "basics",
    "current_settings": "basics",
    "Average": "basics", "Sum": "basics", "Min": "basics", "Max": "basics",
    "Product": "basics",
    "allreduce": "collectives", "grouped_allreduce": "collectives",
    "allgather": "collectives", "broadcast": "collectives",
    "broadcast_variables": "collectives", "alltoall": "collectives",
    "reducescatter": "collectives", "barrier": "collectives",
    "DistributedOptimizer": "optimizer", "Compression": "compression",
    "DistributedGradientTape": "tape", "Trainer": "trainer",
    "start_timeline": "timeline", "stop_timeline": "timeline",
    "start_autotune": "autotune", "stop_autotune": "autotune",
}

# Submodules reachable as attributes after `import kerasdist`.
_SUBMODULES = ("callbacks", "schedules", "data", "timeline", "autotune")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS and _EXPORTS[name] == "collectives":
        # Chosen by the Keras backend (kerasdist/_keras_backend.py).
        backend = importlib.import_module("kerasdist._keras_backend")
        value = backend.collective(name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"kerasdist.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kerasdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kerasdist.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
