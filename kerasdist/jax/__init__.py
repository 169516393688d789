"""kerasdist for JAX: the collectives on JAX arrays, eagerly and inside
`jax.jit`, plus the process API. Imports no TensorFlow.

    import kerasdist.jax as kd
    kd.init()
    grads = kd.grouped_allreduce(grads)          # inside a jitted step too
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
from kerasdist.objects import (allgather_object, broadcast_object,
                               broadcast_object_fn)
from kerasdist.process_sets import (ProcessSet, add_process_set,
                                    global_process_set, remove_process_set)

# The public collectives on JAX arrays: each name of
# `kerasdist.collectives.__all__`, bound to this framework.
_api = _collectives.bound("jax")
globals().update({name: getattr(_api, name)
                  for name in _collectives.__all__})

__all__ = [
    "Adasum", "Average", "Max", "Min", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather_object", "broadcast_object",
    "broadcast_object_fn", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "remove_process_set", "rocm_built", "shutdown",
    "size",
] + _collectives.__all__
