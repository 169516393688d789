"""MetricAverageCallback: logs averaged over all ranks."""

import numbers
import zlib

import keras
import numpy as np

from kerasdist._core import host as _host
from kerasdist.callbacks import _util


def _average_logs(logs, tag):
    # Sorted keys: every rank packs the same values in the same order.
    keys = sorted(k for k, v in logs.items()
                  if isinstance(v, (numbers.Number, np.number))
                  and not isinstance(v, (bool, np.bool_)))
    if not keys:
        return
    # Column 0 holds a checksum of the key list so a rank that logs other
    # metrics fails loudly instead of averaging unrelated numbers.
    key_sum = float(zlib.crc32("\n".join(keys).encode()))
    row = np.array([[key_sum] + [float(logs[k]) for k in keys]], np.float64)
    table = _host.host_allgather(
        row, name=f"kerasdist.metric_average.{tag}")
    if np.any(table[:, 0] != key_sum):
        raise ValueError(
            "MetricAverageCallback: ranks logged different metrics; this rank "
            f"logged {keys}. Every rank must compile the same metrics and run "
            "validation at the same epochs.")
    # A mean over the gathered table: the same numbers in the same order on
    # every rank, so every rank gets bit-identical averages.
    means = table[:, 1:].mean(axis=0)
    for k, m in zip(keys, means):
        logs[k] = float(m)


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the logged metrics over all ranks.

    Each rank computes its metrics on its own shard of the data. At every
    epoch end this callback replaces each numeric entry of the logs
    (training and `val_` metrics) by its mean over the ranks, in place, so
    every rank sees the same values. Keras passes one logs dict through the
    callbacks in list order and calls the progress bar and `History` last,
    so put this callback BEFORE the callbacks that read the metrics
    (`ModelCheckpoint`, `EarlyStopping`, `ReduceLROnPlateau`, `CSVLogger`,
    `TensorBoard`): they then see the averaged values, as does the printed
    progress bar and the returned `History`.

    The epoch value of a metric is the mean of the ranks' epoch values (a
    mean of means: exact when every rank has the same number of batches).

    Args:
        every_batch: if True, also average the logs after every training
            batch, so the progress bar on rank 0 shows values averaged over
            all ranks while the epoch runs. It costs one small allgather per
            batch.

    Raises:
        ValueError: if ranks logged different metric names.

    Example:

    ```python
    model.fit(x, y, callbacks=[
        kerasdist.callbacks.BroadcastGlobalVariablesCallback(0),
        kerasdist.callbacks.MetricAverageCallback(),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
    ])
    ```
    """

    def __init__(self, every_batch=False):
        super().__init__()
        self.every_batch = every_batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            _util.say_if_not_distributed(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.every_batch and logs is not None:
            _average_logs(logs, "batch")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            _average_logs(logs, "epoch")
