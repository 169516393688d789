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

# Imports nothing itself: its __all__ names the collectives.
from kerasdist import collectives as _collectives

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "init": "basics", "shutdown": "basics", "is_initialized": "basics",
    "rank": "basics", "size": "basics", "local_rank": "basics",
    "local_size": "basics", "cross_rank": "basics", "cross_size": "basics",
    "current_settings": "basics",
    # What the library was built with, and Horovod's build probes.
    "build_info": "build_probes", "mpi_built": "build_probes",
    "nccl_built": "build_probes", "ccl_built": "build_probes",
    "cuda_built": "build_probes", "ddl_built": "build_probes",
    "gloo_built": "build_probes", "rocm_built": "build_probes",
    # Horovod's job probes.
    "gloo_enabled": "basics", "is_homogeneous": "basics",
    "mpi_enabled": "basics", "mpi_threads_supported": "basics",
    "Average": "basics", "Sum": "basics", "Min": "basics", "Max": "basics",
    "Product": "basics", "Adasum": "basics",
    "_executing_eagerly": "util",
    # The collectives of the framework the Keras backend runs on.
    **dict.fromkeys(_collectives.__all__, "collectives"),
    # Python objects, the same on every framework.
    "broadcast_object": "objects", "broadcast_object_fn": "objects",
    "allgather_object": "objects",
    "DistributedOptimizer": "optimizer", "Compression": "compression",
    "DistributedGradientTape": "tensorflow.tape", "Trainer": "trainer",
    "PartialDistributedOptimizer": "optimizer",
    "PartialDistributedGradientTape": "tensorflow.tape",
    "load_model": "saving", "save_model": "saving",
    "start_timeline": "timeline", "stop_timeline": "timeline",
    "start_autotune": "autotune", "stop_autotune": "autotune",
    "SyncBatchNormalization": "sync_batch_norm",
    "ProcessSet": "process_sets", "global_process_set": "process_sets",
    "add_process_set": "process_sets", "remove_process_set": "process_sets",
}

# Submodules reachable as attributes after `import kerasdist`. `run`, the
# launcher's package, is also callable: `kerasdist.run(fn, np=2)`, Horovod's
# `horovod.run` (kerasdist/run/function.py).
_SUBMODULES = ("callbacks", "collectives", "schedules", "data", "timeline",
               "autotune", "util", "elastic", "run")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name):
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


importlib.import_module("kerasdist._build_check").warn()
