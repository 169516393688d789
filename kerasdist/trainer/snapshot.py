"""Step checkpoints of the Trainer: a snapshot at a step boundary, written
in the background (private).

The step pays for copying the state to host memory; a thread writes the
copy to disk, so training goes on while the file is written and synced.

The weight file is the one `model.save_weights` writes: Keras's own
walk over the model (`saving_lib._save_state`) runs once against a
recording store, which notes where each variable goes. A snapshot then
reads every variable in one `tf.function` call, and the writer thread
replays the noted layout into Keras's `H5IOStore` with those values. (On
JAX and PyTorch, whose variables a `tf.function` would only capture as
constants when traced, a snapshot reads them one by one.) So
`model.load_weights` (and `Trainer.from_checkpoint`) read a step
checkpoint like an epoch checkpoint.

Layers store their variables themselves; an optimizer stores
`variable.numpy()` of each of its `variables` in order, and those copies
are traced back to the variables through the entry's path. Anything else
that saves a value rather than a variable (a layer saving a computed
value) makes every snapshot walk the model again, which costs more (a
fraction of a `save_weights`) but stays correct.
"""

import concurrent.futures
import contextlib

import keras
import numpy as np
import tensorflow as tf

from kerasdist.trainer import checkpoints

try:  # Keras 3's saving internals; step checkpoints need them.
    from keras.src.saving import saving_lib
except ImportError:  # pragma: no cover - another Keras layout
    saving_lib = None


def check_supported():
    """Raises ValueError if this Keras cannot write snapshots."""
    if saving_lib is None or not hasattr(saving_lib, "_save_state") or \
            not hasattr(saving_lib, "H5IOStore"):
        raise ValueError(
            "checkpoint_every_steps / checkpoint_every_seconds need Keras "
            f"3's saving internals, which Keras {keras.__version__} does "
            "not have; use epoch checkpoints only.")


class _Recorder(saving_lib.H5IOStore if saving_lib else object):
    """Takes the place of H5IOStore in Keras's save walk and records
    `(path, metadata, [(key, value), ...])` for each object it visits."""

    def __init__(self, convert):
        # No file: nothing of H5IOStore's own state is used.
        self.mode = "w"
        self.records = []
        self._convert = convert

    def __bool__(self):
        return True

    def make(self, path, metadata=None):
        self.records.append((path, dict(metadata or {}), []))
        return self

    def __setitem__(self, key, value):
        self.records[-1][2].append((key, self._convert(value)))


def _walk(model, convert):
    recorder = _Recorder(convert)
    saving_lib._save_state(model, weights_store=recorder, assets_store=None,
                           inner_path="", visited_saveables=set())
    return recorder.records


def _copy(value):
    return np.array(keras.ops.convert_to_numpy(value), copy=True)


def _resolve(model, path):
    """The object Keras's walk saved at `path` ("optimizer",
    "layers/dense"), or None when it cannot be found by attribute and
    name."""
    obj = model
    for part in path.split("/") if path else []:
        if isinstance(obj, (list, tuple)):
            named = [o for o in obj if getattr(o, "name", None) == part]
            obj = named[0] if len(named) == 1 else None
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _as_variables(model, path, items):
    """`items` with every value a keras.Variable, or None. Values that are
    copies (an optimizer's `variable.numpy()`, key i for `variables[i]`)
    are traced back to the object's variables."""
    if all(isinstance(v, keras.Variable) for _, v in items):
        return items
    variables = getattr(_resolve(model, path), "variables", None)
    if not isinstance(variables, (list, tuple)):
        return None
    out = []
    for key, value in items:
        if not isinstance(value, keras.Variable):
            # Key i for variables[i] (all of them, or, for a sharded
            # optimizer's checkpoint, those every rank shares).
            var = variables[int(key)] if key.isdigit() and \
                int(key) < len(variables) else None
            if not isinstance(var, keras.Variable) or \
                    tuple(np.shape(value)) != tuple(var.shape):
                return None
            value = var
        out.append((key, value))
    return out


class Snapshotter:
    """Copies a model's saved state (weights and optimizer) to numpy.

    Build it once the model and its optimizer are built; `take()` at a
    step boundary returns records for `write_weights`.
    """

    def __init__(self, model, io=None):
        check_supported()
        self._model = model
        # A context for Keras's walk (shards.shared_only for a sharded
        # optimizer: its weight file holds the shared variables only).
        self._io = io or contextlib.nullcontext
        self._layout = []
        with self._io():
            records = _walk(model, lambda value: value)
        for path, metadata, items in records:
            items = _as_variables(model, path, items)
            if items is None:  # something other than variables: walk
                self._layout = None  # at every snapshot
                return
            self._layout.append((path, metadata, items))
        values = [v for _, _, items in self._layout for _, v in items]
        if keras.backend.backend() == "tensorflow":
            self._read = tf.function(
                lambda: [tf.identity(v.value) for v in values])
            self._read.get_concrete_function()  # trace now, not in a step
        else:
            self._read = lambda: [keras.ops.convert_to_numpy(v.value)
                                  for v in values]

    def take(self):
        """The model's state now, as records that own their arrays."""
        if self._layout is None:
            with self._io():
                return _walk(self._model, _copy)
        arrays = iter([np.array(t, copy=True) for t in self._read()])
        return [(path, metadata, [(key, next(arrays)) for key, _ in items])
                for path, metadata, items in self._layout]


def write_weights(records, path):
    """Writes `records` (from `Snapshotter.take`) as a Keras weight file."""
    store = saving_lib.H5IOStore(path, mode="w")
    try:
        for entry_path, metadata, items in records:
            entry = store.make(entry_path, metadata=metadata or None)
            for key, value in items:
                entry[key] = value
    finally:
        store.close()


class BackgroundWriter:
    """Runs one write at a time on a thread of its own.

    `busy()` says whether a write is in flight; `wait()` blocks until it
    has finished and re-raises its exception, if it failed.
    """

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kerasdist-checkpoint")
        self._future = None

    def busy(self):
        return self._future is not None and not self._future.done()

    def submit(self, fn, *args):
        """Starts `fn(*args)`; the caller checks `busy()` first."""
        self.wait()
        self._future = self._pool.submit(fn, *args)

    def wait(self):
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self):
        """Waits for the write in flight and ends the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


class StepCheckpoints:
    """Rank 0's step checkpoints during one training run: `save` takes a
    snapshot and has it written to `directory` in the background, then
    calls `written(manifest_path)` on the writer's thread.

    With a sharded optimizer (`sharded`, a ShardWriter) every rank has
    one and saves at the same steps: each snapshots its shard of the
    optimizer's slots and writes its shard file; rank 0 also the weights,
    and commits the manifest once every rank's file is in place."""

    def __init__(self, model, directory, keep, written=None, sharded=None):
        self._sharded = sharded
        self._snapshotter = None
        if sharded is None or sharded.rank == 0:
            self._snapshotter = Snapshotter(
                model, io=None if sharded is None else sharded.weights_io)
        self._writer = BackgroundWriter()
        self._directory = directory
        self._keep = keep
        self._written = written or (lambda path: None)

    def busy(self):
        """Whether a write is in flight (a snapshot now would wait)."""
        return self._writer.busy()

    def save(self, epoch, samples, info):
        """Snapshots the state after `epoch` epochs and `samples` examples
        of the next; `info` goes into the manifest."""
        sharded = self._sharded
        mine = None if sharded is None else sharded.take()
        if self._snapshotter is None:  # a sharded optimizer's rank > 0
            self._writer.submit(sharded.write, epoch, samples, mine)
            return
        records = self._snapshotter.take()

        def write():
            shards = None
            if sharded is not None:
                sharded.write(epoch, samples, mine)
                shards = sharded.collect
            self._written(checkpoints.save(
                self._directory, epoch,
                lambda path: write_weights(records, path), info,
                keep=self._keep, samples=samples, shards=shards))

        self._writer.submit(write)

    def wait(self):
        """Blocks until the write in flight is on disk; raises its error."""
        self._writer.wait()

    def close(self):
        """Waits for the write in flight and ends the writer's thread."""
        self._writer.close()

    def abandon(self):
        """Ends the writer's thread after a lost rank: a sharded write in
        flight stops waiting for the other ranks' files and is not
        committed (its error dropped); another write completes first."""
        if self._sharded is not None:
            self._sharded.abandon()
        try:
            self._writer.close()
        except checkpoints.CheckpointError:
            pass
