"""Callbacks the Trainer adds on its own (private)."""

import keras
import numpy as np

from kerasdist import _frontend
from kerasdist import _keras_backend
from kerasdist import basics


def _seed_generators(model):
    generators = []
    for layer in model._flatten_layers(include_self=True):
        generators.extend(getattr(layer, "_seed_generators", None) or [])
    return generators


class ReseedCallback(keras.callbacks.Callback):
    """Sets every random-seed state of the model (Dropout, noise layers...)
    at each epoch start from (seed, epoch, rank).

    The random numbers of epoch e then do not depend on how many epochs
    this process ran before: a resumed job draws the same dropout masks as
    an uninterrupted one. Ranks draw different ones (they see different
    examples anyway).
    """

    def __init__(self, seed, rank):
        super().__init__()
        self.seed = int(seed)
        self.rank = int(rank)

    def on_epoch_begin(self, epoch, logs=None):
        for i, generator in enumerate(_seed_generators(self.model)):
            value = (self.seed * 1000003 + epoch * 7919 + self.rank * 104729
                     + i * 31) % (2 ** 31 - 1)
            state = generator.state
            state.assign(np.array([value, 0], dtype=state.dtype))


class CheckpointCallback(keras.callbacks.Callback):
    """Rank 0 writes a checkpoint at each epoch end; then all ranks meet
    in a barrier, so that when any rank leaves `on_epoch_end` the
    checkpoint of that epoch is complete on disk.

    Place it after MetricAverageCallback: the manifest records the
    averaged logs.
    """

    def __init__(self, save):
        super().__init__()
        self._save = save  # save(epochs_done, logs) on rank 0

    def on_epoch_end(self, epoch, logs=None):
        if basics.rank() == 0:
            self._save(epoch + 1, dict(logs or {}))
        _frontend.host_barrier(f"kerasdist.trainer.checkpoint.{epoch}")


def sync_state(model):
    """Broadcasts model weights and optimizer variables from rank 0.

    Names come from positions and shapes (as in
    BroadcastGlobalVariablesCallback): auto-generated layer names may
    differ between ranks.
    """
    variables = list(model.weights)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    names = [f"kerasdist.trainer.sync.{i}." + "x".join(str(d) for d in v.shape)
             for i, v in enumerate(variables)]
    _keras_backend.assign_broadcast(variables, 0, names)
