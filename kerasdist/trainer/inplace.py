"""Recovery in place of the Trainer (private): commits in memory between
its disk checkpoints, which the survivors of a lost rank go on from.

Under `kerasdist run --recover-in-place` (KERASDIST_RECOVER_IN_PLACE=1)
every rank copies the training state to host memory at the start of each
`model.fit` of the Trainer, every `commit_every_steps` steps of an epoch
and at every epoch end: the model's weights, the optimizer's variables
that every rank holds alike (the iteration count and the learning rate
among them), a sharded optimizer's own shard of its slots, and where the
data stands (epochs done, examples of the next epoch trained, the seed
generators' draw counts), exactly what a step checkpoint on disk records.

When a collective fails with RanksLostError, the Trainer's survivors
re-form among themselves (`kerasdist.elastic.recover_in_place`), put the
last commit back on their variables and train on from its position as a
resume from a step checkpoint at the new size does: the rest of the epoch
re-sharded over the ranks left, the learning rate rescaled, the step
function traced again. A sharded optimizer's commit (shard=
"optimizer_state" or "gradients") holds this rank's shard of the slots and
a copy of its buddy's (kerasdist/keras/sharding/buddies.py, one alltoall
a commit), and with shard="weights" its shard of the model's weights
too: the survivors re-partition the committed shards over the new size
in memory (the weight shards laid out at the new size in place,
`buddies.resize_weights`) and go on as well; where a rank and its buddy
were both lost they end with one line, and a relaunch (`--max-restarts`)
resumes from the last checkpoint on disk.

A shrink the launcher asks for (`kerasdist run --host-discovery-script`)
is done in place the same way: at a step where the ranks agree on the
request they commit, raise ResizeInPlace out of `model.fit`, and the
Trainer ends the ranks that leave (exit code 0) and goes on with the
others from that commit (kerasdist/_core/shrink.py). A grow the launcher
asks for starts the new ranks in the background (kerasdist/_core/grow.py)
while the others train; at the first commit's step after they joined
the ranks commit, re-form with them, send them the commit and its point
by broadcast, and every rank trains on from there; a sharded state's
committed shards are laid out over the grown job, each new rank receiving
only its own shards from the old ranks (`buddies.grow`).
"""

import os

import keras
import numpy as np

from kerasdist import basics
from kerasdist._core import errors as _errors
from kerasdist.keras import optimizer as _optimizer
from kerasdist.keras.sharding import buddies as _buddies
from kerasdist.trainer import callbacks as _tcb
from kerasdist.trainer import resume as _tresume

# Set on every rank by `kerasdist run --recover-in-place` (the core reads it
# too: ops/core/transport/mpi_recovery.cc).
RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"
# Steps between two commits in memory when the Trainer is not told.
DEFAULT_EVERY_STEPS = 10


def recovering():
    """Whether this job recovers in place (kerasdist run
    --recover-in-place)."""
    return os.environ.get(RECOVER_ENV) == "1"


def ranks_lost(error):
    """Whether `error` says a rank of the job was lost: RanksLostError, or
    a framework's error around a kerasdist op that failed with it (a
    jitted step's), which carries the core's text."""
    return isinstance(error, _errors.RanksLostError) or \
        _errors.RANKS_LOST_TEXT in str(error)


def as_ranks_lost(error):
    """`error` as a RanksLostError: a framework's error (JAX's
    "INTERNAL: kerasdist: rank 0: a rank of the job was lost (...)",
    TensorFlow's "Graph execution error:" with that line further down,
    Keras' "Exception encountered when calling Dense.call()." around a
    sharded weight's gather) with the core's message alone."""
    text = _errors.ranks_lost_line(error)
    if isinstance(error, _errors.RanksLostError) and str(error) == text:
        return error
    return _errors.RanksLostError(text)


def every_steps(value):
    """Checks `commit_every_steps`; returns it (an int >= 1, or None)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"commit_every_steps must be an int >= 1 or None, "
                         f"got {value!r}.")
    return int(value)


class Commit:
    """One commit: the state's values, a sharded optimizer's shards
    (`shard`, a buddies.Copies, or None) and where the data stood then
    (`point`, a resume.Resumed)."""

    def __init__(self, values, shard, point):
        self.values = values
        self.shard = shard
        self.point = point


class Commits:
    """The Trainer's last commit in memory, of `model` and its optimizer.

    `take(epoch, samples, rng)` copies the state to host memory;
    `restore()` puts the last one back on the variables and returns its
    point.
    """

    def __init__(self, model):
        self._model = model
        variables = _optimizer.replicated(model.weights)
        seen = {id(v) for v in variables}
        variables += [v for v in _optimizer.whole_variables(model.optimizer)
                      if id(v) not in seen]
        self._variables = variables
        self.last = None
        if keras.backend.backend() == "tensorflow":
            # One call for all, as the step checkpoints' Snapshotter does
            # (one by one took 7.5 ms for 301 k weights with Adam).
            import tensorflow as tf

            self._read = tf.function(
                lambda: [tf.identity(v.value) for v in variables])
        else:
            self._read = lambda: [keras.ops.convert_to_numpy(v.value)
                                  for v in variables]

    @property
    def sharded(self):
        """Whether a commit holds only this rank's shard of the
        optimizer's slots (with a buddy's copy: `buddies.commit`)."""
        return _optimizer.shard_state(self._model.optimizer) is not None

    def take(self, epoch, samples, rng):
        """Commits the state after `epoch` epochs and `samples` examples
        of the next; `rng`: the seed generators' draw counts. A sharded
        optimizer's shard (with shard="weights", and the model's weight
        shards) goes to its buddy too (a collective: every rank
        commits at the same steps); the last commit stays as it was if
        that fails."""
        values = [np.array(t, copy=True) for t in self._read()]
        shard = None
        if self.sharded:
            shard = _buddies.commit(self._model.optimizer,
                                    None if self.last is None
                                    else self.last.shard)
        self.last = Commit(values, shard, _tresume.Resumed(
            int(epoch), int(samples), basics.size(), list(rng)))

    def restore(self, grown=False):
        """Puts the last commit back on the variables; returns its point.
        A sharded optimizer laid out for another size (after a lost rank)
        is built again at the new size with its committed shards (and
        the model's weight shards, shard="weights") re-partitioned over
        the survivors (`buddies.recover`; ShardsLostError, one line,
        where a shard is on no survivor). `grown`: the job grew in place;
        the shards wait for `grow`, which the new ranks join."""
        commit = self.last
        optimizer = self._model.optimizer
        if not grown and self.sharded and _buddies.resized(optimizer):
            commit.shard = _buddies.recover(optimizer, commit.shard,
                                            self._model)
        elif not grown and commit.shard is not None:
            _buddies.assign(optimizer, commit.shard.values)
        for variable, value in zip(self._variables, commit.values):
            variable.assign(value)
        return commit.point

    def grow(self, point):
        """Every rank of a job that grew in place, the new ones too (their
        state synced from rank 0 already, `self.last` None there), at
        the commit `point`: a sharded optimizer's committed shards (and
        the model's weight shards) laid out over the grown job, each new
        rank receiving its shards from the old ranks (`buddies.grow`, a
        collective), and committed again at the new size, one commit on
        every rank. Nothing for a replicated state."""
        if not self.sharded:
            return
        copies = _buddies.grow(self._model.optimizer,
                               None if self.last is None else self.last.shard,
                               self._model)
        if self.last is None:
            self.last = Commit([np.array(t, copy=True) for t in self._read()],
                               copies, point)
        else:
            self.last.shard = copies


class ResizeInPlace(Exception):
    """The ranks agreed to shrink in place as the launcher asked
    (kerasdist/_core/shrink.py has taken its request), or the new ranks
    of a grow in place have joined (kerasdist/_core/grow.py), and the
    state is committed: raised out of `model.fit` for the Trainer to
    re-form the job and go on from that commit."""


class ResizeCheckCallback(_tcb.EveryStepsCallback):
    """Calls `check(epoch, batch)` every `every_steps` steps of an epoch
    but its last, and at every epoch end but the last (batch None): the
    Trainer's check for a resize in place, on every rank at the same
    steps. Place it after the callbacks that see a step."""

    def __init__(self, check, every_steps, is_last, last_epoch):
        super().__init__(every_steps, is_last)
        self._check = check
        self.last_epoch = last_epoch  # fit's `epochs`

    def on_train_batch_end(self, batch, logs=None):
        if not self._due(batch):
            return
        _tcb.sync_model_state(self)
        self._check(self._epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 < self.last_epoch:
            self._check(epoch, None)


class CommitCallback(_tcb.EveryStepsCallback):
    """Commits the state in memory (`commits.take`) at the start of
    training, every `every_steps` steps of an epoch but its last, and at
    every epoch end (`position(epoch, batch)`: the examples of the epoch
    trained after batch `batch`). Every rank commits at the same steps,
    with no collective. Place it after the callbacks that change the state
    at an epoch end (the learning-rate schedules)."""

    def __init__(self, commits, every_steps, position, is_last, start):
        super().__init__(every_steps, is_last)
        self._commits = commits
        self._position = position  # position(epoch, batch)
        self._start = start  # (epoch, samples, rng) of the fit's start

    def on_train_begin(self, logs=None):
        _tcb.sync_model_state(self)
        self._commits.take(*self._start)

    def on_train_batch_end(self, batch, logs=None):
        if not self._due(batch):
            return
        _tcb.sync_model_state(self)
        self._commits.take(self._epoch, self._position(self._epoch, batch),
                           _tcb.seed_counters(self.model))

    def on_epoch_end(self, epoch, logs=None):
        _tcb.sync_model_state(self)
        self._commits.take(epoch + 1, 0, [])


def forget_traces(model):
    """Drops the model's traced train, test and predict functions, so the
    next `fit` traces them again at the new size (a jitted step bakes in
    the number of ranks it averages over)."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)

