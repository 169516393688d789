"""kerasdist for JAX: the collectives on JAX arrays, eagerly and inside
`jax.jit`, plus the process API. Imports no TensorFlow.

    import kerasdist.jax as kd
    kd.init()
    grads = kd.grouped_allreduce(grads)          # inside a jitted step too
"""

from kerasdist.basics import (Average, Max, Min, Product, Sum, cross_rank,
                              cross_size, init, is_initialized, local_rank,
                              local_size, rank, shutdown, size)
from kerasdist.collectives import bound

_api = bound("jax")
allgather = _api.allgather
allreduce = _api.allreduce
alltoall = _api.alltoall
barrier = _api.barrier
broadcast = _api.broadcast
broadcast_variables = _api.broadcast_variables
grouped_allreduce = _api.grouped_allreduce
reducescatter = _api.reducescatter

__all__ = ["Average", "Max", "Min", "Product", "Sum", "allgather",
           "allreduce", "alltoall", "barrier", "broadcast",
           "broadcast_variables", "cross_rank", "cross_size",
           "grouped_allreduce", "init", "is_initialized", "local_rank",
           "local_size", "rank", "reducescatter", "shutdown", "size"]
