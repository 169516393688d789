"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged
over all ranks, for custom training loops."""

import tensorflow as tf

from kerasdist._core import gradients as _gradients
from kerasdist.tensorflow import gradients as _tf_gradients
from kerasdist.compression import Compression

__all__ = ["DistributedGradientTape"]


class DistributedGradientTape:
    """Wraps a `tf.GradientTape`; `gradient()` returns averaged gradients.

    Wrap a tape after recording, or wrap a fresh tape and record inside it:

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = kerasdist.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

        with kerasdist.DistributedGradientTape(tf.GradientTape()) as tape:
            ...

    Each gradient is reduced under a name derived from its source's path or
    name, so every rank must pass the same sources. Eagerly the allreduces run
    one after another; inside a `tf.function` the runtime fuses them.
    Everything other than `gradient` (watch, stop_recording, jacobian, ...)
    is the wrapped tape's and is not reduced.

    Args:
        tape: the `tf.GradientTape` to wrap.
        compression: `kerasdist.Compression.none` (default) or `.fp16`.
        op: `kerasdist.Average` (None, the default) or `kerasdist.Sum`.
        sparse_as_dense: allreduce `tf.IndexedSlices` gradients as dense
            tensors instead of allgathering them.
        gradient_predivide_factor: scale by 1/f before the sum and f/size
            after it (op=Average only).
        num_groups: 0 (default): all dense gradients in one grouped
            allreduce; n > 0: n groups of nearly equal count, in order (as
            `DistributedOptimizer`'s `num_groups`). Same result either way.
        name: prefix of the collective names (default
            "DistributedGradientTape").
        average: Horovod's deprecated form of `op`: True is Average,
            False Sum (a DeprecationWarning); ValueError with `op`.

    Raises:
        TypeError: if `tape` is not a `tf.GradientTape`.
        ValueError: for bad `op`, `compression`, predivide factor or
            `num_groups`.

    Example:
    >>> with tf.GradientTape() as tape:
    ...     loss = tf.reduce_mean(tf.square(model(x) - y))
    >>> tape = kerasdist.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
    >>> optimizer.apply(grads, model.trainable_variables)
    """

    def __init__(self, tape, compression=Compression.none, op=None,
                 sparse_as_dense=False, gradient_predivide_factor=1.0,
                 name=None, num_groups=0, average=None):
        if isinstance(tape, DistributedGradientTape):
            raise ValueError("DistributedGradientTape got a tape that is "
                             "already distributed; wrap the plain tape once.")
        if not isinstance(tape, tf.GradientTape):
            raise TypeError("DistributedGradientTape expects a "
                            f"tf.GradientTape; got {type(tape).__name__}.")
        op = _gradients.resolve_op(op, average)
        _gradients.check_args(op, compression, gradient_predivide_factor,
                              num_groups, "DistributedGradientTape")
        self._num_groups = num_groups
        self._tape = tape
        self._compression = compression
        self._op = op
        self._sparse_as_dense = sparse_as_dense
        self._predivide = gradient_predivide_factor
        self._prefix = name or "DistributedGradientTape"

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, typ, value, traceback):
        return self._tape.__exit__(typ, value, traceback)

    def __getattr__(self, name):
        # Only called for attributes this class lacks: delegate to the tape.
        return getattr(self.__dict__["_tape"], name)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """Like `tf.GradientTape.gradient`, with gradients reduced over ranks.

        Returns:
            Gradients in the structure of `sources`; `None` stays `None`
            (every rank must agree on which are `None`).
        """
        grads = self._tape.gradient(
            target, sources, output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients)
        if _tf_gradients.in_xla_context():
            raise RuntimeError(
                "DistributedGradientTape cannot reduce gradients inside an "
                "XLA-compiled function (the collectives have no XLA kernel); "
                "drop jit_compile=True from the enclosing tf.function.")
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = _tf_gradients.reduce_gradients(
            flat_grads, flat_sources, self._prefix,
            compression=self._compression, op=self._op,
            sparse_as_dense=self._sparse_as_dense,
            gradient_predivide_factor=self._predivide,
            num_groups=self._num_groups)
        return tf.nest.pack_sequence_as(sources, reduced)
