"""The public collectives, on the running Keras backend's tensors.

`kerasdist.allreduce` and `kerasdist.collectives.allreduce` are the same
function: the TF ops' wrapper when the Keras backend is TensorFlow,
`kerasdist.jax`'s on JAX, `kerasdist.torch`'s on PyTorch.
"""

from kerasdist import _framework

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "broadcast",
           "broadcast_variables", "grouped_allreduce", "reducescatter"]


def __getattr__(name):
    if name in __all__:
        return _framework.collective(name)
    raise AttributeError(
        f"module 'kerasdist.collectives' has no attribute {name!r}")


def __dir__():
    return __all__
