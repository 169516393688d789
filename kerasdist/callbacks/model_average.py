"""ModelAverageCallback: local SGD with periodic model averaging."""

import zlib

import keras

from kerasdist import basics
from kerasdist.callbacks import _util
from kerasdist.keras import framework as _framework
from kerasdist.keras import optimizer as _optimizer


class ModelAverageCallback(keras.callbacks.Callback):
    """Averages the model over all ranks every K optimizer steps (local SGD).

    Each rank trains on its own shard with its own, plain (not
    distributed) optimizer; ranks do not communicate while they step.
    After every `every_n_batches`-th optimizer step, at the end of every
    epoch and at the end of training, every rank replaces its weights
    (trainable and non-trainable floating-point weights, e.g. BatchNorm
    statistics) and, with `average_optimizer_state=True`, the optimizer's
    floating-point slot variables (momentum, Adam moments) by their
    average over ranks, in one grouped allreduce. After an epoch the model
    that is evaluated, saved or checkpointed is the same on every rank.

    The schedule is counted by `optimizer.iterations`: averaging happens
    when it reaches a multiple of `every_n_batches` (the epoch-end
    averages are extra and do not shift it). `iterations` is part of the
    optimizer state that `kerasdist.callbacks.ModelCheckpoint` and
    `model.save` store, so a job resumed from a checkpoint taken in the
    middle of an averaging period averages at the same steps as one that
    was never interrupted. For the resumed job to continue exactly, the
    optimizer state must also be the same on every rank when the
    checkpoint is taken: use `average_optimizer_state=True`, or an
    optimizer without state (SGD without momentum).

    With `every_n_batches=1` and SGD without momentum this equals
    synchronous training with `DistributedOptimizer` (the average of the
    ranks' updated weights is the update by the average gradient). With
    larger K there is K times less communication, and ranks drift apart
    in between; see docs/local_sgd.md.

    Put it after `BroadcastGlobalVariablesCallback` (ranks must start
    from the same weights) and before callbacks that read the weights at
    an epoch end (`ModelCheckpoint`, `EarlyStopping` with
    `restore_best_weights`). With uneven shards add
    `EqualizeStepsCallback`: every rank must reach each averaging point.
    With `steps_per_execution` > 1 averaging happens at the first batch
    end at or after each multiple of K.

    Args:
        every_n_batches: K, the number of optimizer steps between averages
            (an int >= 1).
        average_optimizer_state: also average the optimizer's slot
            variables (not `iterations` and the learning rate, which are
            the same on every rank).

    Raises:
        ValueError: if `every_n_batches` is not an int >= 1, or the model's
            optimizer is a `kerasdist.DistributedOptimizer` (it already
            averages every step).

    Example:

    ```python
    kerasdist.init()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, epochs=5, callbacks=[
        kerasdist.callbacks.BroadcastGlobalVariablesCallback(0),
        kerasdist.callbacks.ModelAverageCallback(every_n_batches=8)])
    ```
    """

    def __init__(self, every_n_batches=8, average_optimizer_state=False):
        super().__init__()
        if isinstance(every_n_batches, bool) or not isinstance(
                every_n_batches, int) or every_n_batches < 1:
            raise ValueError("every_n_batches must be an int >= 1; got "
                             f"{every_n_batches!r}.")
        self.every_n_batches = every_n_batches
        self.average_optimizer_state = bool(average_optimizer_state)
        self._average = None
        self._averaged_at = None  # iterations at the last average
        self._period = None  # iterations // K at the last check

    def on_train_begin(self, logs=None):
        if getattr(self.model.optimizer, "_kerasdist_settings", None):
            raise ValueError(
                "ModelAverageCallback needs the plain optimizer: a "
                "kerasdist.DistributedOptimizer already averages gradients "
                "every step. Compile with the unwrapped optimizer.")
        _util.averages_weights_itself(self.model)
        self._average = None  # the variables may have changed since
        self._averaged_at = None
        self._period = self._iterations() // self.every_n_batches

    def on_train_batch_end(self, batch, logs=None):
        step = self._iterations()
        period = step // self.every_n_batches
        if period != self._period:
            self._period = period
            self._average_now(step)

    def on_epoch_end(self, epoch, logs=None):
        self._average_now(self._iterations())

    def on_train_end(self, logs=None):
        self._average_now(self._iterations())

    def _iterations(self):
        return int(keras.ops.convert_to_numpy(
            self.model.optimizer.iterations))

    def _average_now(self, step):
        if basics.size() == 1 or step == self._averaged_at:
            return
        self._averaged_at = step
        if self._average is None:
            self._average = _averaging_function(
                self._variables(), self.every_n_batches)
        self._average()

    def _variables(self):
        variables = _optimizer.replicated(self.model.weights)
        optimizer = self.model.optimizer
        if self.average_optimizer_state:
            _util.build_optimizer(self.model)
            skip = {id(optimizer.iterations)}
            rate = getattr(optimizer, "_learning_rate", None)
            if isinstance(rate, keras.Variable):
                skip.add(id(rate))
            variables += [v for v in _optimizer.whole_variables(optimizer)
                          if id(v) not in skip]
        seen, unique = set(), []
        for v in variables:
            if keras.backend.is_float_dtype(v.dtype) and id(v) not in seen:
                seen.add(id(v))
                unique.append(v)
        return unique


def _averaging_function(variables, k):
    """A function that replaces every variable by its average over ranks
    (one grouped allreduce, then the assigns; a `tf.function` on
    TensorFlow).

    Collective names come from the variables' count and shapes (the same
    on every rank that built the same model), not from layer names, which
    may differ between ranks.
    """
    shapes = ".".join("x".join(str(d) for d in v.shape) for v in variables)
    crc = zlib.crc32(shapes.encode())  # not hash(): salted per process
    name = f"kerasdist.model_average.{k}.{len(variables)}.{crc:08x}"
    return _framework.get().assign_average(variables, name)
