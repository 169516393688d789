"""ModelCheckpoint on rank 0, written atomically, and the way back."""

import glob
import os
import tempfile
import warnings

import h5py
import keras
import numpy as np

from kerasdist import _sharding
from kerasdist import basics
from kerasdist.callbacks import _util

_SUFFIX = ".weights.h5"
_EPOCH_ATTR = "kerasdist_next_epoch"


def _check_path(filepath):
    if not str(filepath).endswith(_SUFFIX):
        raise ValueError(f"The checkpoint path must end in '{_SUFFIX}', got "
                         f"{filepath!r}.")


class ModelCheckpoint(keras.callbacks.Callback):
    """Saves everything an exact resume needs, on rank 0 only.

    At the end of an epoch rank 0 writes one `.weights.h5` file holding the
    model's weights, every optimizer variable (slots, iteration count,
    learning rate) and the number of the next epoch to run. It writes a
    temporary file in the same directory and renames it over the target
    (`os.replace`), so a reader or a crash never sees a half-written
    checkpoint. Other ranks write nothing. Resume with `load_checkpoint`.
    With a sharded optimizer (`DistributedOptimizer(shard=...)`) every rank
    sends its shard of the optimizer state to the file's writer first, so
    the file holds the whole state in the plain optimizer's layout and
    resumes at any number of ranks, sharded or not.

    Place it after `MetricAverageCallback` so `monitor` reads the average
    over all ranks.

    Args:
        filepath: path ending in `.weights.h5`; it may contain format
            fields filled from `epoch` (1-based, as in Keras) and the logs,
            e.g. `"ckpt/epoch{epoch:03d}.weights.h5"`.
        monitor: the logged metric `save_best_only` compares.
        verbose: if > 0, print a line per checkpoint written.
        save_best_only: write only when `monitor` improved.
        mode: `"min"`, `"max"` or `"auto"` (max for names with "acc",
            "auc" or "f1", else min).
        save_freq: save every `save_freq` epochs (an int, or `"epoch"` = 1).

    Example:

    ```python
    callbacks.append(kerasdist.callbacks.ModelCheckpoint(
        "ckpt/epoch{epoch:03d}.weights.h5"))
    ```
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0,
                 save_best_only=False, mode="auto", save_freq="epoch"):
        super().__init__()
        _check_path(filepath)
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got "
                             f"{mode!r}.")
        if save_freq == "epoch":
            save_freq = 1
        if not isinstance(save_freq, int) or save_freq < 1:
            raise ValueError("save_freq must be 'epoch' or a positive int, "
                             f"got {save_freq!r}.")
        self.filepath = os.fspath(filepath)
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_freq = save_freq
        if mode == "auto":
            mode = "max" if any(s in monitor for s in ("acc", "auc", "f1")) \
                else "min"
        self._better = np.greater if mode == "max" else np.less
        self.best = -np.inf if mode == "max" else np.inf

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if (epoch + 1) % self.save_freq:
            return
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                warnings.warn(f"ModelCheckpoint: metric {self.monitor!r} is "
                              f"not in the logs {sorted(logs)}; skipping.")
                return
            # Every rank updates `best`: same averaged logs, same decision.
            if not self._better(current, self.best):
                return
            self.best = current
        # A sharded optimizer's slots are gathered from every rank, so that
        # rank 0 writes them whole (kerasdist/_sharding.py).
        with _sharding.whole_state(self.model.optimizer):
            if basics.rank() != 0:
                return
            path = self.filepath.format(epoch=epoch + 1, **logs)
            save_checkpoint(path, self.model, next_epoch=epoch + 1)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: saved checkpoint {path}")


def save_checkpoint(path, model, next_epoch):
    """Writes `model`'s weights, optimizer state and `next_epoch` to `path`
    atomically. Call it on one rank only; `ModelCheckpoint` does that."""
    _check_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _util.build_optimizer(model)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX,
                               dir=directory)
    os.close(fd)
    try:
        model.save_weights(tmp, overwrite=True)
        with h5py.File(tmp, "a") as f:
            f.attrs[_EPOCH_ATTR] = int(next_epoch)
        # mkstemp creates 0600; give the file the mode open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path, model):
    """Restores a checkpoint written by `ModelCheckpoint` into `model`.

    Loads the weights and the whole optimizer state (creating the
    optimizer's variables first if needed) and returns the epoch to resume
    from. Call it on every rank (a shared or copied file), or on rank 0 only
    followed by `BroadcastGlobalVariablesCallback` in `fit`.

    Args:
        path: a `.weights.h5` file written by `ModelCheckpoint`.
        model: a compiled and built model of the same architecture.

    Returns:
        The next epoch to run: pass it to `fit(initial_epoch=...)`.

    Raises:
        ValueError: if the path is not a kerasdist checkpoint or the model
            is not built.

    Example:

    ```python
    path = kerasdist.callbacks.latest_checkpoint("ckpt")
    initial_epoch = 0
    if path is not None:
        initial_epoch = kerasdist.callbacks.load_checkpoint(path, model)
    model.fit(x, y, epochs=10, initial_epoch=initial_epoch, callbacks=...)
    ```
    """
    _check_path(path)
    with h5py.File(path, "r") as f:
        if _EPOCH_ATTR not in f.attrs:
            raise ValueError(f"{path!r} is not a kerasdist checkpoint (no "
                             f"{_EPOCH_ATTR} attribute).")
        next_epoch = int(f.attrs[_EPOCH_ATTR])
    if not _util.model_is_built(model):
        raise ValueError("load_checkpoint needs a built model: build it "
                         "(model.build(input_shape) or call it on a batch) "
                         "and compile it first.")
    _util.build_optimizer(model)
    model.load_weights(path)
    return next_epoch


def latest_checkpoint(directory):
    """Returns the checkpoint in `directory` with the highest epoch, or None.

    Example:

    ```python
    path = kerasdist.callbacks.latest_checkpoint("ckpt")
    ```
    """
    best, best_epoch = None, -1
    for path in sorted(glob.glob(os.path.join(directory, "*" + _SUFFIX))):
        if os.path.basename(path).startswith(".tmp-"):
            continue
        try:
            with h5py.File(path, "r") as f:
                epoch = int(f.attrs.get(_EPOCH_ATTR, -1))
        except OSError:
            continue
        if epoch > best_epoch:
            best, best_epoch = path, epoch
    return best
