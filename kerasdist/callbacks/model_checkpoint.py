"""ModelCheckpoint on rank 0, written atomically, and the way back."""

import glob
import os
import tempfile
import warnings

import h5py
import keras
import numpy as np

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import host as _host
from kerasdist.callbacks import _util
from kerasdist.keras import optimizer as _optimizer

_SUFFIX = ".weights.h5"
_MODEL_SUFFIXES = (".keras", ".h5")
_EPOCH_ATTR = "kerasdist_next_epoch"


def _check_path(filepath):
    if not str(filepath).endswith(_SUFFIX):
        raise ValueError(f"The checkpoint path must end in '{_SUFFIX}', got "
                         f"{filepath!r}.")


def _check_model_path(filepath, save_weights_only):
    path = str(filepath)
    if save_weights_only or path.endswith(_SUFFIX):
        if save_weights_only is False:
            raise ValueError(
                f"ModelCheckpoint({path!r}, save_weights_only=False): a "
                f"'{_SUFFIX}' path holds weights only; end the path in "
                "'.keras' to save the whole model.")
        _check_path(path)
        return True
    if not path.endswith(_MODEL_SUFFIXES):
        raise ValueError(
            f"The checkpoint path must end in '{_SUFFIX}' (weights and "
            "optimizer state, for load_checkpoint) or '.keras' (the whole "
            f"model, for load_model), got {path!r}.")
    return False


class ModelCheckpoint(keras.callbacks.Callback):
    """Saves a checkpoint on rank 0 only; when `fit` returns, every rank
    may read it.

    Give it to `fit` on every rank. At the end of an epoch rank 0 writes
    either one `.weights.h5` file holding the model's weights, every
    optimizer variable (slots, iteration count, learning rate) and the
    number of the next epoch to run (resume with `load_checkpoint`), or,
    for a `.keras` (or legacy `.h5`) path, the whole model as
    `model.save` writes it (load it with `kerasdist.load_model` or
    `keras.models.load_model`). It writes a temporary file in the same
    directory and renames it over the target (`os.replace`), so a reader
    or a crash never sees a half-written checkpoint. Other ranks write
    nothing. When training ends, every rank waits until rank 0 has
    written its last file (one barrier), so code after `fit` may load
    the checkpoint on any rank that sees rank 0's file system; for
    ranks that do not, `kerasdist.load_model(path, root_rank=0)` reads
    it on rank 0 and sends it to the others.
    With a sharded optimizer (`DistributedOptimizer(shard=...)`) every rank
    first sends its shard of the optimizer state to rank 0 (it must then
    be given to every rank), so the file holds the whole state in the plain
    optimizer's layout and resumes at any number of ranks, sharded or not.

    Place it after `MetricAverageCallback` so `monitor` reads the average
    over all ranks.

    Args:
        filepath: path ending in `.weights.h5` or `.keras`; it may contain
            format fields filled from `epoch` (1-based, as in Keras) and
            the logs, e.g. `"ckpt/epoch{epoch:03d}.weights.h5"`.
        monitor: the logged metric `save_best_only` compares.
        verbose: if > 0, print a line per checkpoint written.
        save_best_only: write only when `monitor` improved.
        mode: `"min"`, `"max"` or `"auto"` (max for names with "acc",
            "auc" or "f1", else min).
        save_freq: save every `save_freq` epochs (an int, or `"epoch"` = 1).
        save_weights_only: as Keras' (None: read from the path's ending);
            True needs a `.weights.h5` path, False a `.keras` or `.h5` one.

    Example:

    ```python
    callbacks.append(kerasdist.callbacks.ModelCheckpoint(
        "best_model.keras", save_best_only=True, monitor="val_loss"))
    model.fit(x, y, callbacks=callbacks, ...)
    model = kerasdist.load_model("best_model.keras")   # on every rank
    ```
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0,
                 save_best_only=False, mode="auto", save_freq="epoch",
                 save_weights_only=None):
        super().__init__()
        self.save_weights_only = _check_model_path(filepath,
                                                   save_weights_only)
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
        if _optimizer.replicated(self.model.weights) != \
                list(self.model.weights):
            self._save_sharded_weights(epoch, logs)
            return
        # A sharded optimizer's slots are gathered from every rank, so that
        # rank 0 writes them whole (kerasdist/keras/sharding/).
        with _optimizer.whole_state(self.model.optimizer,
                                    what="kerasdist ModelCheckpoint"):
            if basics.rank() != 0:
                return
            path = self.filepath.format(epoch=epoch + 1, **logs)
            if self.save_weights_only:
                save_checkpoint(path, self.model, next_epoch=epoch + 1)
            else:
                _replace_atomically(path, self.model.save)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: saved checkpoint {path}")

    def _save_sharded_weights(self, epoch, logs):
        # Weights sharded by kerasdist.shard_weights: every rank saves
        # (each whole weight is gathered as the writer reaches it), as
        # kerasdist.save_model does; rank 0 writes the file.
        from kerasdist.keras.saving import save_model

        if self.save_weights_only:
            raise ValueError(
                "kerasdist ModelCheckpoint(save_weights_only=True) cannot "
                "save a model whose weights kerasdist.shard_weights() "
                "sharded; save the whole model (save_weights_only=False), "
                "or use kerasdist.Trainer's checkpoints.")
        path = self.filepath.format(epoch=epoch + 1, **logs)
        save_model(self.model, path)
        if self.verbose > 0 and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: saved checkpoint {path}")

    def on_train_end(self, logs=None):
        # Rank 0 writes in on_epoch_end; without this the other ranks
        # would return from fit (and perhaps load the file) while rank 0
        # is still writing it.
        if basics.size() == 1:
            return
        try:
            # The name tells a deadlock message's reader what is wrong
            # when only some ranks were given this callback.
            _host.host_barrier(
                "kerasdist.callbacks.ModelCheckpoint.fit_end"
                "(give_it_to_fit_on_every_rank)")
        except _capi.KerasdistError as e:
            # Given on rank 0 alone (Horovod's habit) to ranks that have
            # already finished: nobody is left to wait for the file.
            if "shut down" not in str(e):
                raise


def save_checkpoint(path, model, next_epoch):
    """Writes `model`'s weights, optimizer state and `next_epoch` to `path`
    atomically. Call it on one rank only; `ModelCheckpoint` does that."""
    _check_path(path)
    _util.build_optimizer(model)

    def write(tmp):
        model.save_weights(tmp, overwrite=True)
        with h5py.File(tmp, "a") as f:
            f.attrs[_EPOCH_ATTR] = int(next_epoch)

    _replace_atomically(path, write)


def _replace_atomically(path, write):
    """`write(tmp)` to a temporary file beside `path` (same ending), then
    renames it over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    suffix = next((s for s in (_SUFFIX,) + _MODEL_SUFFIXES
                   if path.endswith(s)), "")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        write(tmp)
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
