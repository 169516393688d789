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

from kerasdist.basics import (Average, Max, Min, Product, Sum, cross_rank,
                              cross_size, init, is_initialized, local_rank,
                              local_size, rank, shutdown, size)
from kerasdist.collectives import bound
from kerasdist.tensorflow.tape import DistributedGradientTape

_api = bound("tensorflow")
allgather = _api.allgather
allreduce = _api.allreduce
alltoall = _api.alltoall
barrier = _api.barrier
broadcast = _api.broadcast
broadcast_variables = _api.broadcast_variables
grouped_allreduce = _api.grouped_allreduce
reducescatter = _api.reducescatter

__all__ = ["Average", "DistributedGradientTape", "Max", "Min", "Product",
           "Sum", "allgather", "allreduce", "alltoall", "barrier",
           "broadcast", "broadcast_variables", "cross_rank", "cross_size",
           "grouped_allreduce", "init", "is_initialized", "local_rank",
           "local_size", "rank", "reducescatter", "shutdown", "size"]
