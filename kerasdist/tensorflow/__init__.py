"""kerasdist for TensorFlow: the collectives on TF tensors (eagerly, inside
`tf.function` and under `tf.GradientTape`), `DistributedGradientTape`, plus
the process API.

    import kerasdist.tensorflow as kd
    kd.init()
    total = kd.allreduce(tf.ones([4]), op=kd.Sum)

`import kerasdist as kd` gives the same collectives when the Keras backend
is TensorFlow; this module is for TensorFlow code that does not go through
Keras' backend choice.
"""

from kerasdist.basics import (Adasum, Average, Max, Min, Product, Sum,
                              cross_rank, cross_size, gloo_enabled, init,
                              is_homogeneous, is_initialized, local_rank,
                              local_size, mpi_enabled, mpi_threads_supported,
                              rank, shutdown, size)
from kerasdist.build_probes import (ccl_built, cuda_built, ddl_built,
                                    gloo_built, mpi_built, nccl_built,
                                    rocm_built)
from kerasdist import collectives as _collectives
from kerasdist.process_sets import (ProcessSet, add_process_set,
                                    global_process_set, remove_process_set)
from kerasdist.objects import (allgather_object, broadcast_object,
                               broadcast_object_fn)
from kerasdist.tensorflow.tape import (DistributedGradientTape,
                                      PartialDistributedGradientTape)

# The public collectives on TF tensors: each name of
# `kerasdist.collectives.__all__`, bound to this framework.
_api = _collectives.bound("tensorflow")
globals().update({name: getattr(_api, name)
                  for name in _collectives.__all__})

__all__ = [
    "Adasum", "Average", "DistributedGradientTape", "Max", "Min",
    "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather_object", "broadcast_object",
    "broadcast_object_fn", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "remove_process_set", "rocm_built", "shutdown",
    "size",
] + _collectives.__all__


def __getattr__(name):
    # Horovod's `horovod.tensorflow.elastic` (TensorFlowState, run...).
    if name == "elastic":
        import kerasdist.elastic
        return kerasdist.elastic
    raise AttributeError(f"module 'kerasdist.tensorflow' has no attribute "
                         f"{name!r}")
