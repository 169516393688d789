"""kerasdist for PyTorch: the collectives on torch tensors (custom ops with
autograd), plus the process API. Imports no TensorFlow.

    import kerasdist.torch as kd
    kd.init()
    grads = kd.grouped_allreduce([p.grad for p in model.parameters()])
"""

from kerasdist.basics import (Average, Max, Min, Product, Sum, cross_rank,
                              cross_size, init, is_initialized, local_rank,
                              local_size, rank, shutdown, size)
from kerasdist.collectives import bound

_api = bound("torch")
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
