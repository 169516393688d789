"""EqualizeStepsCallback: every rank ends each epoch at the same step."""

import keras

from kerasdist import data


class _EndOfEpoch:
    """A truthy `model.stop_training` that ends the epoch, not the training.

    Keras leaves the batch loop when `stop_training` is truthy and then also
    the epoch loop; this callback puts the flag back to False at the epoch
    end, unless another callback (EarlyStopping) set it to a real True.
    """

    def __bool__(self):
        return True

    def __repr__(self):
        return "kerasdist.callbacks.EqualizeStepsCallback.END_OF_EPOCH"


_END_OF_EPOCH = _EndOfEpoch()


class EqualizeStepsCallback(keras.callbacks.Callback):
    """Ends every epoch after the smallest number of batches over the ranks.

    With uneven shards (10 examples on 3 ranks, or a dataset sharded after
    `batch`), ranks hold different numbers of batches. A rank that runs out
    first stops calling the gradient allreduce while the others wait in it:
    the job hangs. This callback agrees on the minimum number of batches
    (one allreduce Min when `fit` starts) and ends each epoch on every rank
    after that many batches; the ranks with more data skip their last
    batches (different ones each epoch when the data is shuffled).

    It needs the number of batches of each rank's data: numpy arrays, or a
    `tf.data.Dataset` of known cardinality. For a dataset of unknown size,
    `repeat()` it and pass `steps_per_epoch=kerasdist.data.equalize_steps(
    ...)` to `fit` instead.

    Use `steps_per_execution=1` (the default), or a value that divides the
    agreed number of steps.

    Raises:
        ValueError: if the number of batches is unknown.

    Example:

    ```python
    x, y = kerasdist.data.shard((x, y))
    model.fit(x, y, batch_size=32, callbacks=[
        kerasdist.callbacks.BroadcastGlobalVariablesCallback(0),
        kerasdist.callbacks.EqualizeStepsCallback()])
    ```
    """

    def __init__(self):
        super().__init__()
        self.steps = None

    def on_train_begin(self, logs=None):
        local = self.params.get("steps")
        if local is None:
            raise ValueError(
                "EqualizeStepsCallback needs the number of batches per epoch, "
                "but fit() does not know it (a dataset of unknown "
                "cardinality). Repeat the dataset and pass steps_per_epoch="
                "kerasdist.data.equalize_steps(...) to fit() instead.")
        self.steps = data.min_steps(local)

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 >= self.steps and not self.model.stop_training:
            self.model.stop_training = _END_OF_EPOCH

    def on_epoch_end(self, epoch, logs=None):
        if self.model.stop_training is _END_OF_EPOCH:
            self.model.stop_training = False

    def on_train_end(self, logs=None):
        if self.model.stop_training is _END_OF_EPOCH:
            self.model.stop_training = False
