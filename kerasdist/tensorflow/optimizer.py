"""DistributedOptimizer's TensorFlow-only parts: gradient accumulation in
TF variables, and XLA (the TF ops have no XLA kernel). Imported only when
the Keras backend is TensorFlow."""

import warnings

import tensorflow as tf

from kerasdist import basics
from kerasdist.collectives import bound
from kerasdist.tensorflow import gradients as _tf_gradients

XLA_MESSAGE = (
    "kerasdist.DistributedOptimizer cannot run inside an XLA-compiled "
    "function: its collectives have no XLA kernel. Drop `jit_compile=True` "
    "from the tf.function around a custom train step, or compile the model "
    "with `model.compile(..., jit_compile=False)` (model.fit and "
    "train_on_batch turn XLA off by themselves, with a warning).")


def check_not_xla():
    """Raises RuntimeError while tracing an XLA-compiled function."""
    if _tf_gradients.in_xla_context():
        raise RuntimeError(XLA_MESSAGE)


class Accumulators:
    """Local gradient sums for backward_passes_per_step > 1.

    Plain `tf.Variable`s held outside Keras tracking: they are not in
    `optimizer.variables`, so a saved model's optimizer state has the same
    layout as the unwrapped optimizer's and loads without kerasdist. The
    price: a partial accumulation is not checkpointed.
    """

    def __init__(self, variables):
        with tf.init_scope():
            self.grads = [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                            name="kerasdist_accum")
                for v in variables]
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="kerasdist_accum_count")


def build(optimizer, variables):
    """Builds `optimizer` on `variables` as Keras' `apply` would."""
    with tf.name_scope(optimizer.name):
        optimizer.build(variables)
    optimizer.built = True


def accumulate(slots, count, grads, k, average, reduce, apply):
    """Adds `grads` to their `slots`; every k-th call reduces the sums
    (divided by k if `average`) with `reduce` and hands them to `apply`.

    Returns a boolean tensor: True when the update ran.
    """
    for g, slot in zip(grads, slots):
        if g is not None:
            slot.assign_add(tf.cast(tf.convert_to_tensor(g), slot.dtype))
    count = count.assign_add(1)

    def communicate():
        summed = [None if g is None else tf.identity(slot)
                  for g, slot in zip(grads, slots)]
        if average:
            summed = [None if s is None else s / k for s in summed]
        apply(reduce(summed))
        for slot in slots:
            slot.assign(tf.zeros_like(slot))
        return tf.constant(True)

    # Every rank counts the same calls, so all take the same branch and the
    # collectives inside stay matched.
    return tf.cond(tf.equal(count % k, 0), communicate,
                   lambda: tf.constant(False))


def agree_finite(finite, prefix):
    """Min over ranks of a LossScaleOptimizer's finiteness flag."""
    check_not_xla()
    name = f"{prefix}.loss_scale_finite"
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        name = graph.unique_name(name, mark_as_used=True)
    agreed = bound("tensorflow").allreduce(tf.cast(finite, tf.int32),
                                           op=basics.Min, name=name)
    return tf.greater(agreed, 0)


# ---- XLA: turn it off for the train function, with one warning --------------

_XLA_WARNING = (
    "kerasdist: XLA was turned off for the train step of model {name!r} "
    "(model.jit_compile is now False): kerasdist's collectives have no XLA "
    "kernel. Compile the model with jit_compile=False to silence this "
    "warning.")


def _turn_off_xla(model, is_distributed):
    """Before Keras builds a train function: no XLA with kerasdist inside."""
    if model.run_eagerly or not is_distributed(model.optimizer):
        return
    if not model.jit_compile:  # resolves "auto"
        return
    model.jit_compile = False
    model.train_function = None  # rebuilt without XLA
    if not getattr(model, "_kerasdist_xla_warned", False):
        model._kerasdist_xla_warned = True
        warnings.warn(_XLA_WARNING.format(name=model.name), UserWarning,
                      stacklevel=3)


def install_train_function_hook(is_distributed):
    """Wraps Keras's `make_train_function` (once per process).

    `fit` and `train_on_batch` call it before the first step is traced, so
    this is the last moment `jit_compile` can still be changed. Without the
    private class (a Keras change), the clear error in `apply` remains.
    """
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # pragma: no cover
        return
    original = TensorFlowTrainer.make_train_function
    if getattr(original, "_kerasdist_hook", False):
        return

    def make_train_function(self, force=False):
        _turn_off_xla(self, is_distributed)
        return original(self, force=force)

    make_train_function._kerasdist_hook = True
    make_train_function.__doc__ = original.__doc__
    TensorFlowTrainer.make_train_function = make_train_function
