"""Horovod's `horovod.tensorflow.util` names that its users' code calls:
`hvd._executing_eagerly()` and `hvd.util._executing_eagerly()`."""


def _executing_eagerly():
    """True when TensorFlow runs eagerly (outside a `tf.function` or a TF1
    graph), as Horovod's; True on the JAX and PyTorch backends, which have
    no graphs of their own. Imports TensorFlow only when it is installed
    and the Keras backend is TensorFlow."""
    from kerasdist.keras import framework as _framework
    return _framework.get().executing_eagerly()
