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
from typing import TYPE_CHECKING

# Neither imports anything itself: their names are the process API and
# the collectives.
from kerasdist import collectives as _collectives
from kerasdist._core import process_api as _process_api

__version__ = "0.1.0"

# public name -> module that defines it: the process API every namespace
# shares (kerasdist/_core/process_api.py), and the Keras layer's own.
_EXPORTS = {
    **_process_api.PROCESS_API,
    "current_settings": "basics", "build_info": "build_probes",
    "_executing_eagerly": "util",
    # The collectives of the framework the Keras backend runs on.
    **dict.fromkeys(_collectives.__all__, "collectives"),
    "DistributedOptimizer": "keras.distributed_optimizer",
    "Compression": "keras.compression",
    "DistributedGradientTape": "tensorflow.tape", "Trainer": "trainer",
    "PartialDistributedOptimizer": "keras.distributed_optimizer",
    "PartialDistributedGradientTape": "tensorflow.tape",
    "load_model": "keras.saving", "save_model": "keras.saving",
    "start_timeline": "timeline", "stop_timeline": "timeline",
    "start_autotune": "autotune", "stop_autotune": "autotune",
    "SyncBatchNormalization": "keras.sync_batch_norm",
    "shard_weights": "keras.sharding.weights",
}

# Submodules reachable as attributes after `import kerasdist`. `run`, the
# launcher's package, is also callable: `kerasdist.run(fn, np=2)`, Horovod's
# `horovod.run` (kerasdist/run/function.py).
_SUBMODULES = ("callbacks", "collectives", "schedules", "data", "timeline",
               "autotune", "util", "elastic", "run")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


# For readers and type checkers (at run time `__getattr__` loads each name
# on first use).
# ---- names written by tools/api_names.py from the one list
if TYPE_CHECKING:
    from kerasdist.autotune import start_autotune as start_autotune
    from kerasdist.autotune import stop_autotune as stop_autotune
    from kerasdist.basics import Adasum as Adasum
    from kerasdist.basics import Average as Average
    from kerasdist.basics import Max as Max
    from kerasdist.basics import Min as Min
    from kerasdist.basics import Product as Product
    from kerasdist.basics import Sum as Sum
    from kerasdist.basics import cross_rank as cross_rank
    from kerasdist.basics import cross_size as cross_size
    from kerasdist.basics import current_settings as current_settings
    from kerasdist.basics import gloo_enabled as gloo_enabled
    from kerasdist.basics import init as init
    from kerasdist.basics import is_homogeneous as is_homogeneous
    from kerasdist.basics import is_initialized as is_initialized
    from kerasdist.basics import local_rank as local_rank
    from kerasdist.basics import local_size as local_size
    from kerasdist.basics import mpi_enabled as mpi_enabled
    from kerasdist.basics import mpi_threads_supported as mpi_threads_supported
    from kerasdist.basics import rank as rank
    from kerasdist.basics import shutdown as shutdown
    from kerasdist.basics import size as size
    from kerasdist.build_probes import build_info as build_info
    from kerasdist.build_probes import ccl_built as ccl_built
    from kerasdist.build_probes import cuda_built as cuda_built
    from kerasdist.build_probes import ddl_built as ddl_built
    from kerasdist.build_probes import gloo_built as gloo_built
    from kerasdist.build_probes import mpi_built as mpi_built
    from kerasdist.build_probes import nccl_built as nccl_built
    from kerasdist.build_probes import rocm_built as rocm_built
    from kerasdist.collectives import allgather as allgather
    from kerasdist.collectives import allreduce as allreduce
    from kerasdist.collectives import alltoall as alltoall
    from kerasdist.collectives import barrier as barrier
    from kerasdist.collectives import broadcast as broadcast
    from kerasdist.collectives import broadcast_ as broadcast_
    from kerasdist.collectives import (
        broadcast_global_variables as broadcast_global_variables,
    )
    from kerasdist.collectives import broadcast_variables as broadcast_variables
    from kerasdist.collectives import grouped_allgather as grouped_allgather
    from kerasdist.collectives import grouped_allreduce as grouped_allreduce
    from kerasdist.collectives import (
        grouped_reducescatter as grouped_reducescatter,
    )
    from kerasdist.collectives import join as join
    from kerasdist.collectives import local_rank_op as local_rank_op
    from kerasdist.collectives import local_size_op as local_size_op
    from kerasdist.collectives import (
        process_set_included_op as process_set_included_op,
    )
    from kerasdist.collectives import rank_op as rank_op
    from kerasdist.collectives import reducescatter as reducescatter
    from kerasdist.collectives import size_op as size_op
    from kerasdist.keras.compression import Compression as Compression
    from kerasdist.keras.distributed_optimizer import (
        DistributedOptimizer as DistributedOptimizer,
    )
    from kerasdist.keras.distributed_optimizer import (
        PartialDistributedOptimizer as PartialDistributedOptimizer,
    )
    from kerasdist.keras.saving import load_model as load_model
    from kerasdist.keras.saving import save_model as save_model
    from kerasdist.keras.sharding.weights import shard_weights as shard_weights
    from kerasdist.keras.sync_batch_norm import (
        SyncBatchNormalization as SyncBatchNormalization,
    )
    from kerasdist.objects import allgather_object as allgather_object
    from kerasdist.objects import broadcast_object as broadcast_object
    from kerasdist.objects import broadcast_object_fn as broadcast_object_fn
    from kerasdist.process_sets import ProcessSet as ProcessSet
    from kerasdist.process_sets import add_process_set as add_process_set
    from kerasdist.process_sets import global_process_set as global_process_set
    from kerasdist.process_sets import remove_process_set as remove_process_set
    from kerasdist.tensorflow.tape import (
        DistributedGradientTape as DistributedGradientTape,
    )
    from kerasdist.tensorflow.tape import (
        PartialDistributedGradientTape as PartialDistributedGradientTape,
    )
    from kerasdist.timeline import start_timeline as start_timeline
    from kerasdist.timeline import stop_timeline as stop_timeline
    from kerasdist.trainer import Trainer as Trainer
# ---- end of the names written by tools/api_names.py


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


importlib.import_module("kerasdist._core.build_check").warn()
