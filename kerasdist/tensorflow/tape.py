"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged
over all ranks, for custom training loops."""

import tensorflow as tf

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist._core import capi as _capi
from kerasdist._core import gradients as _gradients
from kerasdist.keras import buckets as _buckets
from kerasdist.keras import local_variables as _local_variables
from kerasdist.keras import reduced as _reduced
from kerasdist.keras import reduction as _reduction
from kerasdist.keras.compression import Compression
from kerasdist.tensorflow import _keras_layer

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


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
        op: `kerasdist.Average` (None, the default), `kerasdist.Sum` or
            `kerasdist.Adasum` (not divided by `size()`).
        sparse_as_dense: allreduce `tf.IndexedSlices` gradients as dense
            tensors instead of allgathering them.
        gradient_predivide_factor: scale by 1/f before the sum and f/size
            after it (op=Average only).
        num_groups: 0 (default): all dense gradients in one grouped
            allreduce; n > 0: n groups of nearly equal count, in order (as
            `DistributedOptimizer`'s `num_groups`). Same result either way.
        name: prefix of the collective names (default
            "DistributedGradientTape").
        scale_local_gradients: divide the gradients of local sources
            (`register_local_source`) by `size()`, as Horovod does
            (default True).
        average: Horovod's deprecated form of `op`: True is Average,
            False Sum (a DeprecationWarning); ValueError with `op`.
        overlap: with `num_groups=0` inside a `tf.function`, reduce the
            gradients in buckets of up to `bucket_bytes`, in backprop
            order, one grouped allreduce each, which TF runs while it
            computes the other gradients (as `DistributedOptimizer`'s
            `overlap`). None (default): `KERASDIST_OVERLAP` (default 1).
        bucket_bytes: the most bytes in a bucket. None:
            `KERASDIST_BUCKET_BYTES` (default 25 MiB).

    `tape.register_local_source(variable)` keeps that source's gradient on
    its rank (not reduced), as Horovod's; every rank must register the
    same sources.

    With a sharded optimizer (`DistributedOptimizer(opt, shard=...)`),
    hand its `apply` the gradients this tape returned, as they are: they
    are identical on every rank, so the optimizer takes its shard of each
    by slicing it, with no second reduction, and allgathers the updated
    weights (an allreduce and an allgather a step, as PyTorch's
    `ZeroRedundancyOptimizer` behind DDP). The tape remembers the tensors
    it returned (by identity, while they live), so:

    - a gradient changed on the way (scaled, clipped, summed: a new
      tensor), and a local source's, is reduce-scattered by the optimizer
      as usual: correct, at the cost of a second reduction;
    - the tape's `op` decides the reduction (Sum gives summed gradients,
      as the replicated optimizer would after it); an optimizer with
      `op=Sum` refuses them with a ValueError (it would sum them again);
      the optimizer's compression and predivide factor do not apply to
      them (nothing goes on the wire);
    - over another `process_set` than the optimizer's, they are
      reduce-scattered again, with a warning: give both the same set.

    A plain `tf.GradientTape`'s gradients cost the sharded optimizer less
    still: its reduce-scatter moves half an allreduce's bytes.

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
                 name=None, num_groups=0, scale_local_gradients=True,
                 average=None, process_set=None, overlap=None,
                 bucket_bytes=None):
        if isinstance(tape, DistributedGradientTape):
            raise ValueError("DistributedGradientTape got a tape that is "
                             "already distributed; wrap the plain tape once.")
        if not isinstance(tape, tf.GradientTape):
            raise TypeError("DistributedGradientTape expects a "
                            f"tf.GradientTape; got {type(tape).__name__}.")
        op = _gradients.resolve_op(op, average)
        _reduction.check_args(op, compression, gradient_predivide_factor,
                              num_groups, "DistributedGradientTape")
        overlap, bucket_bytes = _buckets.resolve_settings(
            overlap, bucket_bytes, "DistributedGradientTape")
        self._num_groups = num_groups
        self._bucket_bytes = (bucket_bytes if overlap and num_groups == 0
                              else None)
        self._tape = tape
        self._compression = compression
        self._op = op
        self._sparse_as_dense = sparse_as_dense
        self._predivide = gradient_predivide_factor
        self._prefix = name or "DistributedGradientTape"
        self._scale_local = bool(scale_local_gradients)
        self._local = _local_variables.LocalVariables()
        # As Horovod: reduced over `process_set` (a kerasdist.ProcessSet)
        # only; a rank outside it keeps its own gradients.
        self._process_set = _process_sets.resolve(process_set)

    def register_local_source(self, source):
        """Keeps `source`'s gradient on this rank: it is not reduced
        (divided by `size()` unless `scale_local_gradients=False`).

        Raises:
            TypeError: if `source` is not a variable.
        """
        self._local.add_variable(source, "register_local_source")

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
        if _keras_layer.in_xla_context():
            why = _keras_layer.xla_unsupported()
            if why:
                raise RuntimeError(
                    "DistributedGradientTape cannot reduce gradients inside "
                    "an XLA-compiled function here (the collectives have no "
                    f"XLA kernel {why}); drop jit_compile=True from the "
                    "enclosing tf.function.")
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)

        def reduce(grads, sources):
            reduced = _reduction.reduce_gradients(
                grads, sources, self._prefix, _keras_layer.FRAMEWORK,
                compression=self._compression, op=self._op,
                sparse_as_dense=self._sparse_as_dense,
                gradient_predivide_factor=self._predivide,
                num_groups=self._num_groups,
                bucket_bytes=self._bucket_bytes)
            # Identical on every rank of the set: a sharded optimizer
            # handed exactly these slices them (no second reduction).
            _reduced.note(reduced, self._process_set)
            return reduced

        if self._process_set and _capi.process_set_rank(self._process_set) < 0:
            return grads
        with _capi.process_set_scope(self._process_set):
            reduced = self._local.reduce(flat_grads, flat_sources, reduce,
                                         self._scale_local)
        return tf.nest.pack_sequence_as(sources, reduced)


def PartialDistributedGradientTape(gradtape, compression=Compression.none,
                                   sparse_as_dense=False, op=basics.Average,
                                   gradient_predivide_factor=1.0,
                                   num_groups=0, local_layers=None,
                                   scale_local_gradients=True):
    """A `DistributedGradientTape` whose `local_layers` keep their
    gradients on each rank, as Horovod's: their trainable weights are not
    reduced (their gradients are divided by `size()` unless
    `scale_local_gradients=False`).

    Args:
        gradtape: the `tf.GradientTape` to wrap.
        local_layers: a `keras.layers.Layer` or a list of them (default
            none: the same as `DistributedGradientTape`), read when
            `gradient()` runs. Every rank must pass the same layers.
        scale_local_gradients: divide the local gradients by `size()`.
        The other arguments are `DistributedGradientTape`'s.

    Returns:
        The distributed tape (`register_local_source` adds more).

    Raises:
        ValueError: if an element of `local_layers` is not a Keras layer.
        TypeError: if `gradtape` is not a `tf.GradientTape`.

    Example:
    >>> tape = kerasdist.PartialDistributedGradientTape(
    ...     tape, local_layers=[model.layers[-1]])
    """
    layers = _local_variables.local_layers(local_layers,
                                          "PartialDistributedGradientTape")
    tape = DistributedGradientTape(
        gradtape, compression=compression, op=op,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, scale_local_gradients=scale_local_gradients)
    tape._local.add_layers(layers)
    return tape
