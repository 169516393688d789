"""kerasdist for PyTorch: the collectives on torch tensors (custom ops with
autograd), plus the process API. Imports no TensorFlow.

    import kerasdist.torch as kd
    kd.init()
    grads = kd.grouped_allreduce([p.grad for p in model.parameters()])
"""

from kerasdist import _process_api
from kerasdist import collectives as _collectives

# The process API and the public collectives on torch tensors (each name of
# `kerasdist.collectives.__all__`, bound to this framework).
globals().update(_process_api.namespace("torch"))

__all__ = _process_api.__all__ + _collectives.__all__
