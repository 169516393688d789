"""kerasdist for JAX: the collectives on JAX arrays, eagerly and inside
`jax.jit`, plus the process API. Imports no TensorFlow.

    import kerasdist.jax as kd
    kd.init()
    grads = kd.grouped_allreduce(grads)          # inside a jitted step too
"""

from kerasdist import _process_api
from kerasdist import collectives as _collectives

# The process API and the public collectives on JAX arrays (each name of
# `kerasdist.collectives.__all__`, bound to this framework).
globals().update(_process_api.namespace("jax"))

__all__ = _process_api.__all__ + _collectives.__all__
