"""Callbacks the Trainer adds on its own (private)."""

import time

import keras
import numpy as np

from kerasdist import basics
from kerasdist import callbacks as kd_callbacks
from kerasdist._core import host as _host
from kerasdist._core import resize as _resize
from kerasdist.keras import framework as _framework
from kerasdist.keras import optimizer as _optimizer


def seed_generators(model):
    """The model's random-seed generators (Dropout, noise layers...), in
    an order that is the same on every rank."""
    generators = []
    for layer in model._flatten_layers(include_self=True):
        generators.extend(getattr(layer, "_seed_generators", None) or [])
    return generators


def seed_counters(model):
    """How many draws each seed generator has made since its epoch began
    (the second half of its state; the first comes from seed, epoch and
    rank). The same on every rank: all run the same steps."""
    return [int(keras.ops.convert_to_numpy(g.state.value)[1])
            for g in seed_generators(model)]


class ReseedCallback(keras.callbacks.Callback):
    """Sets every random-seed state of the model (Dropout, noise layers...)
    at each epoch start from (seed, epoch, rank).

    The random numbers of epoch e then do not depend on how many epochs
    this process ran before: a resumed job draws the same dropout masks as
    an uninterrupted one. Ranks draw different ones (they see different
    examples anyway). A job resumed in the middle of epoch `resume_epoch`
    starts that epoch's generators at the draw counts the step checkpoint
    recorded (`resume_counters`), so its later steps draw what the
    uninterrupted job drew.
    """

    def __init__(self, seed, rank, resume_epoch=None, resume_counters=()):
        super().__init__()
        self.seed = int(seed)
        self.rank = int(rank)
        self.resume_epoch = resume_epoch
        self.resume_counters = list(resume_counters)

    def on_epoch_begin(self, epoch, logs=None):
        generators = seed_generators(self.model)
        counters = [0] * len(generators)
        if epoch == self.resume_epoch and self.resume_counters:
            counters = self.resume_counters
        for i, generator in enumerate(generators):
            value = (self.seed * 1000003 + epoch * 7919 + self.rank * 104729
                     + i * 31) % (2 ** 31 - 1)
            state = generator.state
            state.assign(np.array([value, counters[i]], dtype=state.dtype))


class _EndOfEpoch:
    """A truthy `model.stop_training` that ends the epoch, not the training
    (as in EqualizeStepsCallback)."""

    def __bool__(self):
        return True


_END_OF_EPOCH = _EndOfEpoch()


class ShortEpochCallback(keras.callbacks.Callback):
    """Ends epoch `epoch` after `steps` batches: the part of an epoch left
    after a step checkpoint is shorter than a whole one."""

    def __init__(self, epoch, steps):
        super().__init__()
        self.epoch = epoch
        self.steps = steps
        self._active = False

    def on_epoch_begin(self, epoch, logs=None):
        self._active = epoch == self.epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._active and batch + 1 >= self.steps and \
                not self.model.stop_training:
            self.model.stop_training = _END_OF_EPOCH

    def on_epoch_end(self, epoch, logs=None):
        self.on_train_end()

    def on_train_end(self, logs=None):
        if self.model.stop_training is _END_OF_EPOCH:
            self.model.stop_training = False


class ResumedWarmupCallback(kd_callbacks.LearningRateWarmupCallback):
    """The learning-rate warmup of a job resumed within epoch `epoch`: its
    batch b counts as batch `b + offset` of that epoch, `offset` being the
    part already trained in steps of the current size. At the size that
    wrote the checkpoint the offset is a whole number of steps and the
    learning rates are those of the uninterrupted job; at another size the
    warmup goes on from the same fraction of the epoch, towards the rate
    scaled for the new size."""

    def __init__(self, initial_lr, warmup_epochs, epoch, offset, verbose=0):
        super().__init__(initial_lr=initial_lr, warmup_epochs=warmup_epochs,
                         verbose=verbose)
        self.resume_epoch = epoch
        self.offset = offset
        self._shift = 0

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._shift = self.offset if epoch == self.resume_epoch else 0

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch + self._shift, logs)


class StepCheckpointCallback(keras.callbacks.Callback):
    """Rank 0's step checkpoints: when `every_steps` steps or
    `every_seconds` seconds have passed since the last checkpoint (of
    either kind), `save(epoch, batch)` snapshots the state and hands it to
    the background writer.

    Never at an epoch's last step (the epoch checkpoint follows at once)
    and never while the previous write is in flight (`busy()`): the step
    does not wait for the disk; the snapshot is taken at the first step
    boundary after the write has finished.
    """

    def __init__(self, save, busy, is_last, every_steps=None,
                 every_seconds=None, agree=False):
        super().__init__()
        self._save = save
        self._busy = busy
        # A sharded optimizer's checkpoints: every rank has one, and they
        # agree on each save (`agree_all`), so all save at the same steps.
        self._agree = agree
        self._is_last = is_last  # is_last(epoch, batch)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._epoch = 0
        self._reset()

    def _reset(self):
        self._steps = 0
        self._since = time.monotonic()

    def _due(self):
        return (self.every_steps is not None
                and self._steps >= self.every_steps) or (
            self.every_seconds is not None
            and time.monotonic() - self._since >= self.every_seconds)

    def on_train_begin(self, logs=None):
        self._reset()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._agree:
            if self._is_last(self._epoch, batch):
                return
            if self.every_seconds is None:
                # Whether it is due is the same on every rank; whether
                # its writer is free is not.
                if not self._due() or not agree_all(not self._busy()):
                    return
            elif not agree_all(self._due() and not self._busy()):
                return
        elif not self._due() or self._busy() or \
                self._is_last(self._epoch, batch):
            return
        sync_model_state(self)
        self._save(self._epoch, batch)
        self._reset()

    def on_epoch_end(self, epoch, logs=None):
        self._reset()  # the epoch checkpoint was just written


def sync_model_state(callback):
    """Puts the training state back on the model's variables before the
    Trainer reads them in the middle of an epoch (a step checkpoint, a
    resize). On JAX, Keras keeps that state apart while it trains and syncs
    it back only when a callback asks for its `model`
    (`keras.callbacks.Callback.model` calls `jax_state_sync()`); elsewhere
    the variables always hold it and this does nothing."""
    sync = getattr(callback.model, "jax_state_sync", None)
    if sync is not None:
        sync()


def agree_all(flag):
    """Whether `flag` is true on every rank (one 8-byte allreduce, min)."""
    value = np.array([1 if flag else 0], np.int64)
    return bool(_host.host_allreduce(value, basics.Min,
                                     "kerasdist.trainer.step_agree")[0])


def resize_agreed():
    """Whether any rank was asked to stop for a resize; the same answer on
    every rank (one 8-byte allreduce, max)."""
    flag = np.array([1 if _resize.requested() else 0], np.int64)
    return bool(_host.host_allreduce(flag, basics.Max,
                                     "kerasdist.trainer.resize")[0])


class EveryStepsCallback(keras.callbacks.Callback):
    """Counts an epoch's steps for the callbacks that act every
    `every_steps` steps of an epoch but its last (`is_last(epoch,
    batch)`: the epoch end follows there); None: never between epoch
    ends. `_due(batch)`, from `on_train_batch_end`, says whether this step
    is one; the same steps on every rank."""

    def __init__(self, every_steps, is_last):
        super().__init__()
        self.every_steps = every_steps
        self._is_last = is_last  # is_last(epoch, batch)
        self._epoch = 0
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps = 0

    def _due(self, batch):
        if self.every_steps is None:
            return False
        self._steps += 1
        return not (self._steps % self.every_steps
                    or self._is_last(self._epoch, batch))


class ResizeCallback(EveryStepsCallback):
    """Stops the job for a resize at a checkpoint boundary, once the
    launcher asked any rank (kerasdist/_core/resize.py).

    The ranks agree on it (`resize_agreed`) every `every_steps` steps of an
    epoch (None: at epoch ends only), never at an epoch's last step (the
    epoch end follows), and at every epoch end but the last. All ranks make
    the same checks, so all stop at the same step even when the request
    reached them at different steps. Then `stop(epoch, batch)` writes the
    step checkpoint (batch None at an epoch end, whose checkpoint is
    written already) and ends the process. Place it last: the callbacks
    before it have seen the step.
    """

    def __init__(self, stop, is_last, last_epoch, every_steps=None):
        super().__init__(every_steps, is_last)
        self._stop_job = stop
        self.last_epoch = last_epoch  # fit's `epochs`

    def on_train_batch_end(self, batch, logs=None):
        if not self._due(batch):
            return
        if resize_agreed():
            sync_model_state(self)
            self._stop_job(self._epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 < self.last_epoch and resize_agreed():
            self._stop_job(epoch, None)


class CheckpointCallback(keras.callbacks.Callback):
    """Rank 0 writes a checkpoint at each epoch end; then all ranks meet
    in a barrier, so that when any rank leaves `on_epoch_end` the
    checkpoint of that epoch is complete on disk.

    Place it after MetricAverageCallback: the manifest records the
    averaged logs.
    """

    def __init__(self, save, save_shard=None):
        super().__init__()
        self._save = save  # save(epochs_done, logs) on rank 0
        # A sharded optimizer's: save_shard(epochs_done) on every rank
        # writes its shard file (rank 0's save waits for them all).
        self._save_shard = save_shard

    def on_epoch_end(self, epoch, logs=None):
        if self._save_shard is not None:
            self._save_shard(epoch + 1)
        if basics.rank() == 0:
            self._save(epoch + 1, dict(logs or {}))
        _host.host_barrier(f"kerasdist.trainer.checkpoint.{epoch}")


def sync_state(model):
    """Broadcasts model weights and optimizer variables from rank 0.

    Names come from positions and shapes (as in
    BroadcastGlobalVariablesCallback): auto-generated layer names may
    differ between ranks.
    """
    variables = _optimizer.replicated(model.weights)
    if model.optimizer is not None:
        variables += _optimizer.whole_variables(model.optimizer)
    names = [f"kerasdist.trainer.sync.{i}." + "x".join(str(d) for d in v.shape)
             for i, v in enumerate(variables)]
    _framework.get().assign_broadcast(variables, 0, names)
