"""SyncBatchNormalization: Keras' BatchNormalization with training-mode
moments over the global batch (every rank's batch together), on every
Keras backend kerasdist runs on.

In training mode each call reduces one small vector per layer over the
ranks, in one allreduce: this rank's per-channel sums of x and x**2 and its
element count (the sum of the mask's weights under a mask). The global mean
and variance follow from the totals, weighted by the counts, so ranks with
batches of different sizes get the moments of the concatenated batch. The
allreduce is a Sum, which is differentiable on every framework (its
gradient is the Sum of the incoming gradients), so the backward pass is
that of BatchNormalization on the concatenated batch. Inference uses the
moving statistics and communicates nothing.
"""

import keras
from keras import ops

from kerasdist import basics
from kerasdist.keras import framework as _framework

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="kerasdist")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training-mode statistics are computed over
    all ranks' batches.

    A drop-in for `keras.layers.BatchNormalization` (it is a subclass) and
    for Horovod's `hvd.SyncBatchNormalization`. In training mode
    (`model.fit`, `training=True`) the mean and variance normalising the
    batch, and the ones the moving statistics are updated with, are those
    of the global batch: the concatenation of every rank's batch. Ranks may
    have batches of different sizes; each one counts by its number of
    elements. The gradients are those of BatchNormalization on the global
    batch. Inference (`training=False`, `predict`, `evaluate`) normalises
    with the moving statistics, exactly as BatchNormalization does, and
    communicates nothing. With one rank, or `synchronized=False`, it is
    plain BatchNormalization and communicates nothing.

    Cost: one allreduce of `2 * channels + 1` numbers (`3 * channels`
    under a mask) per layer per training-mode call, in the forward pass,
    and one of the same size in the backward pass.

    Every rank must call the layer in training mode the same number of
    times per step, in the same order as its other collectives, since the
    ranks wait for each other there. Collectives are named after the
    layer's path (`model/sync_batch_normalization`), made unique within a
    `tf.function` or jitted JAX step: build the same model on every rank.

    Backends: TensorFlow (the TF ops, eagerly and in `tf.function`; under
    XLA they compile as the other collectives do, untested there), JAX
    (XLA custom calls inside the jitted train step), PyTorch (custom ops
    with autograd).

    Args:
        axis, momentum, epsilon, center, scale, beta_initializer,
        gamma_initializer, moving_mean_initializer,
        moving_variance_initializer, beta_regularizer, gamma_regularizer,
        beta_constraint, gamma_constraint, renorm, renorm_clipping,
        renorm_momentum: as for `keras.layers.BatchNormalization`
            (`renorm` applies its corrections to the global moments).
        synchronized: True (default): the moments are computed over all
            kerasdist ranks. False: over this rank's batch only (plain
            BatchNormalization). This is not Keras' `synchronized=True`,
            which reduces over the replicas of a `tf.distribute` strategy
            inside one process and exists only on TensorFlow; this layer
            never uses `tf.distribute` and synchronises the processes of a
            kerasdist job on every backend.
        fused: accepted for Horovod compatibility. Keras 3 has no fused
            kernel to choose: False or None (default) only; True raises a
            ValueError, as Horovod's does.
        **kwargs: the base layer's keyword arguments (`name`, `dtype`...).

    Loading a saved model: the class is registered with Keras as
    `kerasdist>SyncBatchNormalization` when kerasdist's module is imported,
    so access `kerasdist.SyncBatchNormalization` (or pass it in
    `custom_objects`) before `keras.models.load_model`.

    Example:
    >>> import kerasdist as kd
    >>> kd.init()
    >>> model = keras.Sequential([keras.Input((28, 28, 1)),
    ...     keras.layers.Conv2D(32, 3),
    ...     kd.SyncBatchNormalization(),
    ...     keras.layers.ReLU()])
    """

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True,
                 scale=True, synchronized=True, fused=None, **kwargs):
        if fused:
            raise ValueError(
                "SyncBatchNormalization does not support fused=True (Keras "
                "3 has no fused batch normalization); pass fused=False or "
                "leave it out.")
        if not isinstance(synchronized, bool):
            raise ValueError(
                "SyncBatchNormalization: synchronized must be True (moments "
                "over all ranks) or False (this rank's batch only), got "
                f"{synchronized!r}.")
        # Keras' own `synchronized` means tf.distribute replicas: off.
        super().__init__(axis=axis, momentum=momentum, epsilon=epsilon,
                         center=center, scale=scale, synchronized=False,
                         **kwargs)
        self.synchronized = synchronized

    def _moments(self, inputs, mask):
        if not self.synchronized:
            return self._local_moments(inputs, mask)
        if not basics.is_initialized():
            raise RuntimeError(
                "SyncBatchNormalization in training mode needs kerasdist: "
                "call kerasdist.init() first (or pass synchronized=False "
                "for this rank's statistics only).")
        if basics.size() == 1:
            return self._local_moments(inputs, mask)
        return self._global_moments(inputs, mask)

    def _local_moments(self, inputs, mask):
        if mask is None:
            # Keras' own path, without its tf.distribute synchronisation.
            return ops.moments(inputs, axes=self._reduction_axes)
        return super()._moments(inputs, mask)

    def _global_moments(self, inputs, mask):
        axes = self._reduction_axes
        dtype = inputs.dtype
        channels = inputs.shape[self.axis]
        if mask is None:
            kept = inputs
            shape = ops.shape(inputs)
            count = 1
            for a in axes:
                count = count * shape[a]
            count = ops.reshape(ops.cast(count, dtype), (1,))
        else:
            # As BatchNormalization weighs a mask: where it is False the
            # element counts for nothing.
            weight = ops.cast(ops.broadcast_to(
                ops.expand_dims(mask, axis=-1), ops.shape(inputs)), "bool")
            kept = ops.where(weight, inputs, 0)
            count = ops.sum(ops.cast(weight, dtype), axes)
        local = ops.concatenate([ops.sum(kept, axes),
                                 ops.sum(ops.square(kept), axes), count])
        total = _framework.get().collectives.allreduce(
            local, basics.Sum, self._collective_name(), 1.0, 1.0)
        s, q = total[:channels], total[channels:2 * channels]
        n = total[2 * channels:]
        if mask is None:
            mean = s / n
            variance = q / n - ops.square(mean)
        else:
            # BatchNormalization's masked moments divide by the weights
            # plus Keras' epsilon: sum(w * (x - mean)**2) / (n + eps).
            n_eps = n + keras.backend.epsilon()
            mean = s / n_eps
            variance = (q - 2.0 * mean * s + ops.square(mean) * n) / n_eps
        # E[x^2] - E[x]^2 can round below zero for a constant channel.
        return mean, ops.maximum(variance, 0.0)

    def _collective_name(self):
        """The name ranks match this call's allreduce by: the layer's path,
        made unique within the TF graph or JAX program being traced (a
        layer may be called more than once in one step)."""
        base = f"SyncBatchNormalization.{self.path or self.name}"
        return _framework.get().unique_name(base)
