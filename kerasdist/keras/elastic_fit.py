"""`model.fit` that recovers in place (docs/failures-and-elastic.md,
"Recovery in place"), re-exported by kerasdist.elastic: the data fit
trains, `ElasticBatches`, and one callback, `CommitCallback`, that keeps
the position and commits.

    data = kd.elastic.ElasticBatches((x, y), batch_size=32, shuffle=True)
    state = kd.elastic.KerasState(model, epoch=0, batch=0)
    state.register_reset_callbacks([rescale_the_learning_rate])

    @kd.elastic.run
    def train(state):
        state.model.fit(data, epochs=EPOCHS - state.epoch, shuffle=False,
                        callbacks=[kd.elastic.CommitCallback(
                            state, data, batches_per_commit=10)])

The position is the job's, not a rank's, so that it means the same at any
size: an epoch is every example once, in one order (`arange`, or shuffled
by `seed` and the epoch's number), cut into batches of `batch_size`
examples; `state.batch` counts the batches of the epoch that the job has
trained, all ranks together. A step at S ranks trains the next S batches,
batch `state.batch + r` on rank r (the epoch's last step takes what is
left: kerasdist/keras/elastic_schedule.py). After a recovery at another size
the next step trains the batches after the commit: nothing is trained
twice or skipped.
"""

import warnings
import weakref

import keras
import numpy as np

from kerasdist import basics
from kerasdist.keras.elastic_schedule import batches_done
from kerasdist.keras.elastic_schedule import epoch_order
from kerasdist.keras.elastic_schedule import epoch_steps
from kerasdist.keras.elastic_schedule import step_rows
from kerasdist.keras.optimizer import restart_overlap


def _leaves(data):
    if isinstance(data, dict):
        return [x for v in data.values() for x in _leaves(v)]
    if isinstance(data, (tuple, list)):
        return [x for v in data for x in _leaves(v)]
    return [data]


def _take(data, rows):
    if isinstance(data, dict):
        return {k: _take(v, rows) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        return tuple(_take(v, rows) for v in data)
    return np.asarray(data[rows])


# Keras' line when an epoch's data ends before its count of steps: a
# resumed epoch does, by design.
_RAN_OUT = "Your input ran out of data"
# model -> (its train function, the size it was made at).
_MADE_AT = weakref.WeakKeyDictionary()
# ElasticBatches -> the states whose reset callbacks forget its epoch.
_FORGETS = weakref.WeakKeyDictionary()


class ElasticBatches(keras.utils.PyDataset):
    """The batches this rank trains, for `model.fit` under `elastic.run`
    with `CommitCallback` (Horovod's ElasticSampler, for Keras): each
    epoch's examples in one order for the whole job, shared out at the
    current size from the committed position (the module's doc).

    Args:
        data: what `fit` takes as `x`: a tuple `(x, y)` or `(x, y,
            sample_weight)`, an array, or a dict of arrays, all of one
            length, indexable with an array of row numbers (numpy).
            Every rank holds all of it (or overrides `load`).
        batch_size: examples per rank per step.
        shuffle: a new order each epoch, from `seed` and the epoch's
            number (the same on every rank, at every size).
        seed: the shuffle's seed.
        num_examples: the number of examples, where `data` is None and
            `load` is overridden to read them.

    Pass `shuffle=False` to `fit`: the order is this object's. Keras'
    `workers` and `use_multiprocessing` are refused (they fetch batches
    out of order).
    """

    def __init__(self, data, batch_size, shuffle=False, seed=0,
                 num_examples=None):
        super().__init__()
        if data is not None:
            lengths = {len(x) for x in _leaves(data)}
            if len(lengths) != 1:
                raise ValueError(f"ElasticBatches: the arrays of `data` have "
                                 f"lengths {sorted(lengths)}; give arrays "
                                 f"of one length.")
            num_examples = lengths.pop()
        if not isinstance(num_examples, int) or num_examples < 1:
            raise ValueError(f"ElasticBatches: no examples ({num_examples!r}"
                             f"); give `data`, or `num_examples` >= 1 with "
                             f"an overridden `load`.")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ElasticBatches: batch_size must be a positive "
                             f"int, got {batch_size!r}.")
        self.data, self.batch_size = data, batch_size
        self.shuffle, self.seed = bool(shuffle), seed
        self.num_examples = num_examples
        self._epoch, self._start, self._steps = 0, 0, None
        self._order = None
        self._next = None

    def seek(self, epoch, batch):
        """Starts the epoch fit trains next at batch `batch` (the job's
        count, as `state.batch`) of epoch `epoch`; returns its steps at
        the current size."""
        self._epoch, self._start = int(epoch), int(batch)
        self._order = epoch_order(self.num_examples, self.shuffle, self.seed,
                                  self._epoch)
        self._steps = epoch_steps(self.num_examples, self.batch_size,
                                  self._start, basics.size())
        return self._steps

    def batches_done(self, steps):
        """The epoch's batches the job has trained after `steps` steps of
        it at the current size (what `state.batch` becomes)."""
        return batches_done(self.num_examples, self.batch_size, self._start,
                             steps, basics.size())

    @property
    def num_batches(self):
        # Keras reads it at fit's start (a whole epoch's steps at the
        # current size: every epoch's count in its loop) and at the start
        # of each epoch's iteration, after CommitCallback's seek (that
        # epoch's steps: a resumed one ends sooner, as data that runs out).
        if self._steps is not None:
            return self._steps
        return epoch_steps(self.num_examples, self.batch_size, 0,
                           basics.size())

    def __len__(self):
        return self.num_batches

    def on_epoch_begin(self):
        self._next = 0

    def on_epoch_end(self):
        self._next, self._steps = None, None

    def _forget(self):
        """After a failed fit (a recovery): no epoch is under way."""
        self._next, self._steps, self._order = None, None, None

    def __getitem__(self, index):
        if self.workers > 1 or self.use_multiprocessing:
            raise ValueError("ElasticBatches: fetches its batches in order; "
                             "leave `workers` at 1 and `use_multiprocessing` "
                             "off.")
        if self._next is not None:
            if index != self._next:
                raise ValueError(
                    f"ElasticBatches: fit asked for batch {index} where "
                    f"{self._next} comes next: pass `shuffle=False` to "
                    f"fit (the order is ElasticBatches', its `shuffle`).")
            self._next = index + 1
        if self._order is None:
            self.seek(self._epoch, self._start)
        # Keras looks at the first batches for their shapes before any
        # epoch: any batch will do there.
        step = index if index < self._steps else 0
        rows = step_rows(self._order, self.batch_size, self._start, step,
                         basics.rank(), basics.size())
        return self.load(rows)

    def load(self, rows):
        """The batch of examples `rows` (an int array): `data`'s rows,
        as `fit` takes them. Override it to read them from elsewhere."""
        return _take(self.data, rows)


class CommitCallback(keras.callbacks.Callback):
    """The one callback of `model.fit` under `elastic.run` (Horovod's
    CommitStateCallback, UpdateBatchStateCallback and
    UpdateEpochStateCallback in one, exact at any size): keeps
    `state.epoch` (epochs done) and `state.batch` (the current epoch's
    batches the job has trained, all ranks together), commits `state`
    every `batches_per_commit` steps and at every epoch's end, starts each
    epoch of `data` at the committed position, and has Keras make the
    model's train function again when the job's size changed since it
    was made (a recovery or a grow in place: its graph may hold the old
    size; PyTorch's overlap hooks are dropped then too, see
    kerasdist.keras.optimizer.restart_overlap).

    Args:
        state: a `kerasdist.elastic.KerasState` with attributes `epoch`
            and `batch` (`KerasState(model, epoch=0, batch=0)`).
        data: the `ElasticBatches` that fit trains.
        batches_per_commit: steps between commits (each commit copies the
            model and optimizer to host memory).
    """

    def __init__(self, state, data, batches_per_commit=1):
        super().__init__()
        if not (hasattr(state, "epoch") and hasattr(state, "batch")):
            raise ValueError(
                "CommitCallback keeps the position in state.epoch and "
                "state.batch: create the state with them, "
                "KerasState(model, epoch=0, batch=0).")
        if not isinstance(data, ElasticBatches):
            raise ValueError(
                f"CommitCallback: `data` must be the ElasticBatches that fit "
                f"trains (got {type(data).__name__}): it shares out each "
                f"epoch from the committed position.")
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"CommitCallback: batches_per_commit must be a "
                             f"positive int, got {batches_per_commit!r}.")
        self.state, self.data = state, data
        self.batches_per_commit = batches_per_commit
        self._since_commit = 0
        self._steps = None
        self._quiet = None
        # A failed fit leaves its epoch under way: the reset after the
        # recovery ends it (once per state and data, however many
        # callbacks are made).
        states = _FORGETS.setdefault(data, weakref.WeakSet())
        if state not in states:
            states.add(state)
            state.register_reset_callbacks([data._forget])

    def on_train_begin(self, logs=None):
        self._hear_ran_out()
        model, size = self.model, basics.size()
        made = _MADE_AT.get(model)
        if made is not None and made[1] != size:
            if made[0] is model.train_function:
                model.make_train_function(force=True)
            # Grown in place: the new ranks' optimizers are new, and reduce
            # their first step synchronously; so do these.
            restart_overlap(model.optimizer)
        _MADE_AT[model] = (model.train_function, size)
        self._since_commit = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._hear_ran_out()
        whole = epoch_steps(self.data.num_examples, self.data.batch_size, 0,
                            basics.size())
        self._steps = self.data.seek(self.state.epoch, self.state.batch)
        if self._steps < whole:
            # Resumed mid-epoch: its data ends before Keras' count of
            # steps, which Keras reports as a mistake; it is not one here.
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message=_RAN_OUT)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self.data.batches_done(batch + 1)
        self._since_commit += 1
        # Not on the epoch's last step: its end commits, with nothing
        # trained in between.
        if batch + 1 < self._steps and \
                self._since_commit >= self.batches_per_commit:
            self._commit()

    def on_epoch_end(self, epoch, logs=None):
        self._hear_ran_out()
        self.state.epoch += 1
        self.state.batch = 0
        self._commit()

    def on_train_end(self, logs=None):
        self._hear_ran_out()

    def _hear_ran_out(self):
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None

    def _commit(self):
        # On JAX, reading `self.model` brings the step's state back to
        # the model's variables, which the commit copies.
        _ = self.model
        self._since_commit = 0
        self.state.commit()


for _cls in (ElasticBatches, CommitCallback):
    _cls.__module__ = "kerasdist.elastic"
