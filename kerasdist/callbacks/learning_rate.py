"""Learning-rate schedule and warmup callbacks (Goyal et al., 2017)."""

import keras
import numpy as np

from kerasdist import basics


def _optimizer(model):
    optimizer = model.optimizer
    # LossScaleOptimizer keeps the real hyperparameters on the inner one.
    return getattr(optimizer, "inner_optimizer", optimizer)


def _get_lr(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _momentum_slots(optimizer):
    """The velocity variables of SGD / RMSprop with momentum, else []."""
    momentum = getattr(optimizer, "momentum", 0)
    if not isinstance(momentum, (int, float)) or momentum <= 0:
        return []
    if not optimizer.built:
        return []
    slots = getattr(optimizer, "momentums", None)
    if slots is None:
        slots = getattr(optimizer, "_momentums", None)
    return list(slots or [])


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)`.

    Between `start_epoch` (inclusive) and `end_epoch` (exclusive), the
    learning rate is set at the first batch of each epoch
    (`staircase=True`) or before every batch with a fractional epoch
    `epoch + batch / steps_per_epoch` (`staircase=False`). Outside that
    range the callback leaves the learning rate alone, so several of them
    can cover consecutive epoch ranges. The value is also written to the
    epoch logs as `learning_rate`.

    Momentum correction (Goyal et al., section 2.1): when the learning rate
    changes from `old` to `new`, the momentum buffer, which Keras keeps in
    units of the update (`v = momentum * v - lr * g`), is multiplied by
    `new / old` before the step. For plain momentum this equals Horovod's
    "momentum * new / old for one step, then restored", and it works
    although Keras 3 compiles `optimizer.momentum` into the train step as a
    constant. It applies to optimizers with a `momentum` attribute and
    momentum buffers (SGD, RMSprop); others are left alone.

    Args:
        initial_lr: the learning rate that `multiplier` scales.
        multiplier: a number, or a function of the (possibly fractional)
            epoch returning the factor. A number implies `staircase=True`.
        start_epoch: first epoch the schedule applies to.
        end_epoch: epoch at which it stops applying (None: never).
        staircase: adjust once per epoch (True) or every batch (False).
        momentum_correction: scale the momentum buffer when the learning
            rate changes.
        steps_per_epoch: batches per epoch; inferred from `fit` when None.

    Raises:
        ValueError: if `staircase=False` and the number of steps per epoch
            is unknown, or if the optimizer's learning rate is a schedule.

    Example:

    ```python
    # Divide the learning rate by 10 at epochs 30 and 60.
    callbacks = [
        kerasdist.callbacks.LearningRateScheduleCallback(
            0.1 * kerasdist.size(), 1.0, start_epoch=0, end_epoch=30),
        kerasdist.callbacks.LearningRateScheduleCallback(
            0.1 * kerasdist.size(), 1e-1, start_epoch=30, end_epoch=60),
        kerasdist.callbacks.LearningRateScheduleCallback(
            0.1 * kerasdist.size(), 1e-2, start_epoch=60),
    ]
    ```
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
                 staircase=True, momentum_correction=True,
                 steps_per_epoch=None):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        if callable(multiplier):
            self.staircase = staircase
            self.multiplier = multiplier
        else:
            self.staircase = True
            self.multiplier = lambda epoch: multiplier
        self._epoch = 0
        self._steps = steps_per_epoch

    def on_train_begin(self, logs=None):
        if isinstance(_optimizer(self.model)._learning_rate,
                      keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(
                f"{type(self).__name__} sets the learning rate, but the "
                "optimizer's learning rate is a LearningRateSchedule. Use a "
                "float learning rate, or kerasdist.schedules.WarmupSchedule "
                "instead of this callback.")
        self._steps = self.steps_per_epoch or self.params.get("steps")
        if not self.staircase and not self._steps:
            raise ValueError(
                f"{type(self).__name__} could not infer the number of steps "
                "per epoch from fit(); pass steps_per_epoch=.")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch < self.start_epoch or (
                self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_lr(self.initial_lr * self.multiplier(self._epoch))
        else:
            epoch = self._epoch + batch / self._steps
            self._set_lr(self.initial_lr * self.multiplier(epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = _get_lr(_optimizer(self.model))

    def _set_lr(self, new_lr):
        optimizer = _optimizer(self.model)
        old_lr = _get_lr(optimizer)
        optimizer.learning_rate = float(new_lr)
        # Compare in float32, the variable's precision.
        if (self.momentum_correction and old_lr != 0
                and np.float32(new_lr) != np.float32(old_lr)):
            ratio = new_lr / old_lr
            for slot in _momentum_slots(optimizer):
                slot.assign(slot * ratio)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual learning-rate warmup (Goyal et al., 2017).

    With N ranks the effective batch is N times larger, so the usual advice
    is to scale the learning rate by N. Starting training at that rate is
    often unstable; this callback starts at `initial_lr / size()` and
    raises the learning rate before every batch, linearly in the
    (fractional) epoch, to `initial_lr` at the last batch of epoch
    `warmup_epochs - 1`; then it leaves the learning rate alone. The
    formula is Horovod's:

        epoch = current_epoch + (batch + 1) / steps_per_epoch
        lr = initial_lr / size() * (epoch * (size() - 1) / warmup_epochs + 1)

    (the `+ 1` batch makes the warmup end exactly at `initial_lr`).

    Args:
        initial_lr: the learning rate after the warmup, usually the
            single-process rate times `size()`.
        warmup_epochs: number of epochs of warmup.
        momentum_correction: scale the momentum buffer when the learning
            rate changes (see `LearningRateScheduleCallback`).
        steps_per_epoch: batches per epoch; inferred from `fit` when None.
        verbose: if > 0, print the final learning rate when warmup ends.

    Example:

    ```python
    model.fit(x, y, callbacks=[
        kerasdist.callbacks.BroadcastGlobalVariablesCallback(0),
        kerasdist.callbacks.MetricAverageCallback(),
        kerasdist.callbacks.LearningRateWarmupCallback(
            initial_lr=0.01 * kerasdist.size(), warmup_epochs=3, verbose=1),
    ])
    ```
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Never past the end: a job resumed at another size counts its
            # interrupted epoch in fractional steps (ResumedWarmupCallback),
            # and its last batch must not overshoot `initial_lr`.
            epoch = min(epoch + 1.0 / self._steps, warmup_epochs)
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0,
                         end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate "
                  f"warmup to {_get_lr(_optimizer(self.model)):g}.")
