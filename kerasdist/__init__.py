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

# Neither imports anything itself: their names are the process API and
# the collectives.
from kerasdist import _process_api
from kerasdist import collectives as _collectives

__version__ = "0.1.0"

# public name -> module that defines it: the process API every namespace
# shares (kerasdist/_process_api.py), and the Keras layer's own.
_EXPORTS = {
    **_process_api.PROCESS_API,
    "current_settings": "basics", "build_info": "build_probes",
    "_executing_eagerly": "util",
    # The collectives of the framework the Keras backend runs on.
    **dict.fromkeys(_collectives.__all__, "collectives"),
    "DistributedOptimizer": "optimizer", "Compression": "compression",
    "DistributedGradientTape": "tensorflow.tape", "Trainer": "trainer",
    "PartialDistributedOptimizer": "optimizer",
    "PartialDistributedGradientTape": "tensorflow.tape",
    "load_model": "saving", "save_model": "saving",
    "start_timeline": "timeline", "stop_timeline": "timeline",
    "start_autotune": "autotune", "stop_autotune": "autotune",
    "SyncBatchNormalization": "sync_batch_norm",
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
