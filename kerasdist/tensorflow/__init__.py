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

from kerasdist import _process_api
from kerasdist import collectives as _collectives
from kerasdist.tensorflow.tape import DistributedGradientTape
from kerasdist.tensorflow.tape import PartialDistributedGradientTape

# The process API and the public collectives on TF tensors (each name of
# `kerasdist.collectives.__all__`, bound to this framework).
globals().update(_process_api.namespace("tensorflow"))

__all__ = (["DistributedGradientTape", "PartialDistributedGradientTape"]
           + _process_api.__all__ + _collectives.__all__)


def __getattr__(name):
    # Horovod's `horovod.tensorflow.elastic` (TensorFlowState, run...).
    if name == "elastic":
        import kerasdist.elastic
        return kerasdist.elastic
    raise AttributeError(f"module 'kerasdist.tensorflow' has no attribute "
                         f"{name!r}")
