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
                              ccl_built, cross_rank, cross_size, cuda_built,
                              ddl_built,
                              gloo_built, gloo_enabled, init, is_homogeneous,
                              is_initialized, local_rank, local_size,
                              mpi_built, mpi_enabled, mpi_threads_supported,
                              nccl_built, rank, rocm_built, shutdown, size)
from kerasdist.collectives import bound
from kerasdist.process_sets import (ProcessSet, add_process_set,
                                    global_process_set, remove_process_set)
from kerasdist.objects import (allgather_object, broadcast_object,
                               broadcast_object_fn)
from kerasdist.tensorflow.tape import (DistributedGradientTape,
                                      PartialDistributedGradientTape)

_api = bound("tensorflow")
allgather = _api.allgather
allreduce = _api.allreduce
alltoall = _api.alltoall
barrier = _api.barrier
broadcast = _api.broadcast
broadcast_ = _api.broadcast_
broadcast_global_variables = _api.broadcast_global_variables
broadcast_variables = _api.broadcast_variables
grouped_allgather = _api.grouped_allgather
grouped_allreduce = _api.grouped_allreduce
grouped_reducescatter = _api.grouped_reducescatter
join = _api.join
local_rank_op = _api.local_rank_op
local_size_op = _api.local_size_op
rank_op = _api.rank_op
reducescatter = _api.reducescatter
size_op = _api.size_op
process_set_included_op = _api.process_set_included_op

__all__ = ["Adasum", "Average", "DistributedGradientTape", "Max", "Min",
           "ProcessSet", "add_process_set", "global_process_set",
           "process_set_included_op", "remove_process_set",
           "PartialDistributedGradientTape", "Product", "Sum", "allgather",
           "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
           "broadcast_", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "ccl_built",
           "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
           "gloo_enabled", "grouped_allgather", "grouped_allreduce",
           "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
           "join",
           "local_rank", "local_rank_op", "local_size", "local_size_op",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
           "rank", "rank_op", "reducescatter", "rocm_built", "shutdown",
           "size", "size_op"]


def __getattr__(name):
    # Horovod's `horovod.tensorflow.elastic` (TensorFlowState, run...).
    if name == "elastic":
        import kerasdist.elastic
        return kerasdist.elastic
    raise AttributeError(f"module 'kerasdist.tensorflow' has no attribute "
                         f"{name!r}")
