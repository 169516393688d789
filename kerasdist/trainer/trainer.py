"""Trainer: a base class for data-parallel Keras training.

Subclass it, say how to build the model and where the data is, and call
`fit()` under `kerasdist run -np N`. The Trainer does the rest: sharding,
the scaled learning rate with an optional warmup, the
`DistributedOptimizer`, the broadcast at start, averaged metrics, rank-0
logging, atomic checkpoints and an exact resume after a restart.

Over 500 lines: one class, whose overridable hooks and `fit`'s steps read in
the order they run; its checkpoints (`checkpoints.py`) and metrics live in
modules of their own.
"""

import contextlib
import importlib.util
import os
import sys
import types

import keras
import numpy as np
import tensorflow as tf

from kerasdist import basics
from kerasdist import callbacks as kd_callbacks
from kerasdist import elastic as _elastic
from kerasdist._core import grow as _grow
from kerasdist._core import host as _host
from kerasdist._core import resize as _resize
from kerasdist._core import shrink as _shrink
from kerasdist.keras import framework as _framework
from kerasdist.keras import optimizer as _optimizer
from kerasdist.keras.distributed_optimizer import SHARD_MODES
from kerasdist.keras.distributed_optimizer import DistributedOptimizer
from kerasdist.keras.sharding import files as _shard_files
from kerasdist.keras.sharding import weights as _weights
from kerasdist.trainer import callbacks as _tcb
from kerasdist.trainer import checkpoints
from kerasdist.trainer import data as _tdata
from kerasdist.trainer import inplace as _inplace
from kerasdist.trainer import resume as _tresume
from kerasdist.trainer import shards as _tshards
from kerasdist.trainer import snapshot as _tsnap
from kerasdist.trainer import state as _tstate

# fit() arguments the Trainer sets itself; fit_kwargs may not override them.
_RESERVED_FIT_KWARGS = frozenset({
    "x", "y", "batch_size", "epochs", "initial_epoch", "steps_per_epoch",
    "callbacks", "validation_data", "validation_split", "verbose",
    "shuffle"})
# Constructor settings a checkpoint records, so from_checkpoint can rebuild.
_CONFIG_KEYS = ("epochs", "batch_size", "learning_rate", "scale_lr",
                "warmup_epochs", "seed", "data_is_sharded", "shuffle",
                "shuffle_buffer", "checkpoint_every_steps",
                "checkpoint_every_seconds", "shard", "commit_every_steps")


class Trainer:
    """Base class for synchronous data-parallel training of a Keras model.

    Override `build_model` and `train_data`; optionally `val_data`,
    `build_optimizer`, `build_loss`, `build_metrics` and `callbacks`.
    `fit()` then, on every rank: initialises kerasdist if needed, pins one
    GPU per process (by local rank; nothing on CPU), builds the model and
    wraps the optimizer in `DistributedOptimizer`, shards the data (rank r
    takes examples r, r + size, ... of a new permutation each epoch),
    resumes from the newest complete checkpoint, and trains with the
    broadcast, metric-averaging, warmup and equal-steps callbacks. Rank 0
    alone shows the progress bar, writes checkpoints and TensorBoard logs.

    Exact resume: epoch e's data order and random numbers derive from
    (`seed`, e), and a checkpoint holds the weights and the whole optimizer
    state (iteration count included), so stopping after epoch k and
    resuming gives the same weights as training straight through. Step
    checkpoints (`checkpoint_every_steps` / `checkpoint_every_seconds`)
    also record the position within the epoch and the random-number
    counters, so a job resumed from one continues the epoch where it
    stopped: at the same size with the same weights as an uninterrupted
    run, at another size with the rest of the epoch's examples re-sharded
    over the new ranks and the learning rate rescaled.

    Growing and shrinking: under `kerasdist run --host-discovery-script`,
    when the launcher asks for a resize (hosts joined or left), every rank
    stops at the same step checkpoint boundary, rank 0 writes that step's
    checkpoint, and `fit()` ends the process with exit code 76 (a
    `SystemExit`); the launcher starts the job again at the new size, and
    it resumes there as above (docs/failures-and-elastic.md, "Growing and
    shrinking").
    This needs a `checkpoint_dir`. Under `--recover-in-place` a shrink or
    a grow is done in place instead (below).

    Recovery in place: under `kerasdist run --recover-in-place` every rank
    also commits the training state in memory (`commit_every_steps`); when
    a rank is lost, the survivors keep their processes, re-form the job
    among themselves, go back to the last commit and train on from there
    at the smaller size, as a resume from a step checkpoint at that size
    would (docs/failures-and-elastic.md, "Recovery in place"). The disk
    checkpoints stay for the loss of the whole job. A shrink the launcher
    asks for is done in place too: at the next commit's step the ranks
    no longer placed end with exit code 0 and the others go on from a
    commit made there, as after a lost rank ("Shrinking in place"); so
    is a grow: the new ranks start while the others train, and at the
    first commit's step after they joined they get that commit by
    broadcast, a sharded state's shards laid out over the grown job
    ("Growing in place").

    Args:
        epochs: total number of epochs (>= 1).
        batch_size: examples per batch per rank; one step of the job
            consumes `batch_size * size()` examples.
        learning_rate: the single-process learning rate.
        scale_lr: multiply `learning_rate` by `size()` (the global batch is
            `size()` times larger). False keeps it as given.
        warmup_epochs: ramp the learning rate from `learning_rate` up to
            the scaled rate over this many epochs
            (`LearningRateWarmupCallback`); 0 disables it.
        checkpoint_dir: directory for checkpoints (written by rank 0 at
            every epoch end). None disables checkpoints and resume.
        keep_checkpoints: how many of the newest epoch checkpoints to keep
            (of step checkpoints only the newest is kept).
        checkpoint_every_steps: also write a step checkpoint every this
            many steps (rank 0, in the background); None: none.
        checkpoint_every_seconds: also write a step checkpoint when this
            many seconds have passed since the last checkpoint; None: none.
        commit_every_steps: under `kerasdist run --recover-in-place`,
            commit the state in memory every this many steps of an epoch
            (and at the start of `fit` and every epoch end), for the
            survivors of a lost rank to go on from. None: every 10 steps.
            Without recovery in place nothing is committed.
        auto_resume: resume from the newest complete checkpoint in
            `checkpoint_dir` if there is one.
        fresh_optimizer: resume from a checkpoint that holds no optimizer
            state (weights saved without one) with a fresh optimizer. By
            default such a checkpoint is refused: an exact resume needs
            the optimizer's state (Adam's moments, the step count).
        seed: seeds weight initialisation, data order and dropout.
        verbose: Keras progress level on rank 0 (0, 1 or 2); other ranks
            are silent. Non-zero also prints resume information.
        tensorboard_dir: write TensorBoard logs here (rank 0 only).
        data_is_sharded: `train_data`/`val_data` already return this
            rank's part; the Trainer then shuffles but does not shard.
        shuffle: shuffle the training data every epoch.
        shuffle_buffer: tf.data shuffle buffer; None means the whole data
            set (an exact permutation).
        fit_kwargs: further keyword arguments for `keras.Model.fit`
            (e.g. `class_weight`).
        shard: None (default), "optimizer_state" or "gradients": passed to
            `DistributedOptimizer(shard=...)` (each rank keeps only its
            shard of the optimizer state; docs/keras.md, "Models that do
            not fit"). Its checkpoints are then written in parallel: every
            rank writes its shard file into `checkpoint_dir` (which every
            rank must see: a shared file system on several hosts), rank 0
            the weights and the manifest naming them; a resume at another
            size, or with another `shard`, reads each rank's part.
            "weights": the model's weights are sharded too
            (`kerasdist.shard_weights`: `build_model()` runs under
            `kerasdist.shard_weights()`, so no rank holds the whole
            model); every rank writes its shard of the weights and of
            the optimizer state into its shard file, and the weight file
            holds only the unsharded variables. Such checkpoints resume at
            any size, sharded or replicated, and a replicated checkpoint
            resumes sharded (each rank reading its slices).
        jit_compile: `model.compile`'s `jit_compile` (True, False or
            "auto"). None (default): what suits the backend, False on
            TensorFlow and PyTorch, True on JAX. On TensorFlow, True keeps
            the train step compiled with XLA where kerasdist's collectives
            have XLA kernels (the CPU; a GPU in a build with the GPU
            backend); elsewhere the `DistributedOptimizer` turns XLA off
            with one warning.

    Raises:
        ValueError: for an invalid setting, such as `batch_size=0` or a
            `checkpoint_dir` that is a file.
        ImportError: for `tensorboard_dir` without TensorBoard installed.

    Example:

    ```python
    class Digits(kerasdist.Trainer):
        def build_model(self):
            return keras.Sequential([keras.Input((64,)),
                                     keras.layers.Dense(10, "softmax")])

        def train_data(self):
            return x_train, y_train

    history = Digits(epochs=3, batch_size=32, learning_rate=1e-3,
                     checkpoint_dir="ckpt").fit()
    ```
    """

    # Raised by fit() when checkpoint_dir holds only damaged checkpoints.
    CheckpointError = checkpoints.CheckpointError

    def __init__(self, *, epochs=1, batch_size=32, learning_rate=1e-3,
                 scale_lr=True, warmup_epochs=0, checkpoint_dir=None,
                 keep_checkpoints=3, checkpoint_every_steps=None,
                 checkpoint_every_seconds=None, auto_resume=True, seed=0,
                 verbose=1, tensorboard_dir=None, data_is_sharded=False,
                 shuffle=True, shuffle_buffer=None, fit_kwargs=None,
                 fresh_optimizer=False, shard=None, jit_compile=None,
                 commit_every_steps=None):
        self.epochs = _tstate.positive_int("epochs", epochs)
        self.batch_size = _tstate.positive_int("batch_size", batch_size)
        self.keep_checkpoints = _tstate.positive_int("keep_checkpoints",
                                                     keep_checkpoints)
        self.checkpoint_every_steps, self.checkpoint_every_seconds = \
            _tstate.step_checkpoint_settings(
                checkpoint_every_steps, checkpoint_every_seconds,
                checkpoint_dir)
        if self.step_checkpoints:
            _tsnap.check_supported()
        self.commit_every_steps = _inplace.every_steps(commit_every_steps)
        _tstate.check_numbers(learning_rate, warmup_epochs, seed)
        if shuffle_buffer is not None:
            shuffle_buffer = _tstate.positive_int("shuffle_buffer",
                                                  shuffle_buffer)
        checkpoints.check_directory(checkpoint_dir)
        if tensorboard_dir is not None and \
                importlib.util.find_spec("tensorboard") is None:
            # Keras would fail only at the end of the first epoch.
            raise ImportError("tensorboard_dir needs the tensorboard "
                              "package: pip install tensorboard.")
        fit_kwargs = dict(fit_kwargs or {})
        clash = sorted(_RESERVED_FIT_KWARGS & set(fit_kwargs))
        if clash:
            raise ValueError(f"fit_kwargs may not set {clash}: the Trainer "
                             "sets them (use the constructor arguments or "
                             "override train_data/val_data).")
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be None, 'optimizer_state', "
                             f"'gradients' or 'weights'; got {shard!r}.")
        self.shard = shard
        if jit_compile not in (None, True, False, "auto"):
            raise ValueError(f"jit_compile must be None, True, False or "
                             f"'auto'; got {jit_compile!r}.")
        self.jit_compile = jit_compile
        self.learning_rate = float(learning_rate)
        self.scale_lr = bool(scale_lr)
        self.warmup_epochs = warmup_epochs
        self.checkpoint_dir = None if checkpoint_dir is None else \
            os.fspath(checkpoint_dir)
        self.auto_resume = bool(auto_resume)
        self.fresh_optimizer = bool(fresh_optimizer)
        self.seed = int(seed)
        self.verbose = verbose
        self.tensorboard_dir = tensorboard_dir
        self.data_is_sharded = bool(data_is_sharded)
        self.shuffle = bool(shuffle)
        self.shuffle_buffer = shuffle_buffer
        self.fit_kwargs = fit_kwargs
        self.model = None
        self.optimizer = None
        self.history = None
        self.initial_epoch = 0
        self.initial_samples = 0  # examples of initial_epoch done before
        self.epochs_done = 0  # epochs the current weights were trained for
        self.resumed_from = None  # weight file of the checkpoint loaded
        self.last_checkpoint = None  # manifest path of the last one written
        self._resume = _tresume.ResumeProtocol()
        self._source_point = None  # where from_checkpoint's checkpoint is
        self._steps = None  # rank 0's StepCheckpoints, during _train
        self._plan = None  # the EpochPlan of the _train in progress
        self._step_saved = None  # (epoch, batch) of the last step snapshot
        self._shard_writer = None  # a sharded optimizer's, during _train
        self._commits = None  # the last commit in memory (recovery in place)
        # The ranks agreed on a resize request that is no shrink in place:
        # the job stops for a relaunch at its next checkpoint boundary.
        self._relaunching = False
        # fit() and fine_tune() calls so far: a rank that joins a job grown
        # in place runs the script from its start and joins at its first.
        self._calls = 0

    # ---- what a subclass overrides --------------------------------------

    def build_model(self):
        """Returns the `keras.Model` to train (required)."""
        raise NotImplementedError(
            f"{type(self).__name__} must override build_model() and return a "
            "keras.Model.")

    def train_data(self):
        """Returns the whole training set (required): a `tf.data.Dataset`
        of unbatched (x, y) examples, or a tuple (x, y) of numpy arrays."""
        raise NotImplementedError(
            f"{type(self).__name__} must override train_data().")

    def val_data(self):
        """Returns the whole validation set like `train_data`, or None."""
        return None

    def build_optimizer(self, learning_rate):
        """Returns a Keras optimizer for `learning_rate` (already scaled);
        the Trainer wraps it in DistributedOptimizer. Default: Adam."""
        return keras.optimizers.Adam(learning_rate)

    def build_loss(self):
        """Returns the loss for `compile`. Default: sparse categorical
        cross-entropy (integer labels, probabilities out)."""
        return "sparse_categorical_crossentropy"

    def build_metrics(self):
        """Returns the metrics for `compile`. Default: ["accuracy"]."""
        return ["accuracy"]

    def callbacks(self):
        """Returns extra Keras callbacks; they run after the Trainer's own
        (so they see averaged logs and a written checkpoint)."""
        return []

    # ---- public API -----------------------------------------------------

    @property
    def step_checkpoints(self):
        """Whether step checkpoints are on."""
        return (self.checkpoint_every_steps is not None
                or self.checkpoint_every_seconds is not None)

    @property
    def scaled_learning_rate(self):
        """`learning_rate * size()` with `scale_lr`, else `learning_rate`."""
        return self.learning_rate * (basics.size() if self.scale_lr else 1)

    def fit(self):
        """Trains for `epochs` epochs (resuming if a checkpoint exists).

        Returns:
            The `keras.callbacks.History` of this call, with metrics
            averaged over the ranks (the same on every rank).

        Raises:
            TypeError / ValueError: for bad data or a bad model, before
                any training step.
            kerasdist.trainer.checkpoints.CheckpointError: if `checkpoint_dir`
                holds checkpoints but none is intact.
        """
        _tstate.start()
        train = _tdata.as_dataset(self.train_data(), "train_data()")
        val = self.val_data()
        if val is not None:
            val = _tdata.as_dataset(val, "val_data()")
        self._calls += 1
        self._prepare(train)
        self._resume.begin_fit()
        if _inplace.recovering() and _grow.joined():
            # A new rank of a job that grew in place: the others' commit.
            point, _ = self._share_commit(None, None)
            self.epochs_done = point.epoch
        else:
            point = (self._resume_fit() if self._resume.source is None
                     else self._source_point)
        return self._train(train, val, self.epochs_done, self.epochs,
                           point=point)

    def evaluate(self, data=None):
        """Evaluates on `data` (default `val_data()`), split over the ranks.

        Each rank evaluates its shard; the results are averaged weighted by
        the number of examples, which for means (loss, accuracy) gives the
        value over the whole data set.

        Returns:
            A dict metric name -> float, the same on every rank.
        """
        _tstate.start()
        data = self.val_data() if data is None else data
        if data is None:
            raise ValueError("evaluate() needs data: pass it or override "
                             "val_data().")
        dataset = _tdata.as_dataset(data, "evaluate(data)")
        self._prepare(dataset)
        local, n_local = self._eval_data(dataset)
        counts = _tstate.gather_row([float(n_local)], "eval.count")[:, 0]
        if counts.min() == 0:
            raise ValueError(f"evaluate(): some rank has no examples (counts "
                             f"{counts.astype(int).tolist()}).")
        result = self.model.evaluate(local, verbose=0, return_dict=True)
        keys = sorted(result)
        table = _tstate.gather_row([float(result[k]) for k in keys],
                                   f"eval.{len(keys)}")
        weights = counts / counts.sum()
        return {k: float(np.dot(weights, table[:, i]))
                for i, k in enumerate(keys)}

    @classmethod
    def from_checkpoint(cls, path, **overrides):
        """A trainer whose model and optimizer state come from a checkpoint.

        The settings recorded in the checkpoint (batch size, learning rate,
        seed, ...) are used unless `overrides` sets them. Checkpoints of the
        new trainer go to the checkpoint's directory unless
        `checkpoint_dir=` says otherwise. The job may have any number of
        ranks; the learning rate is scaled for the new `size()`.

        Args:
            path: a checkpoint directory (its newest intact checkpoint), or
                a checkpoint's `.json` manifest or `.weights.h5` file.
            **overrides: constructor arguments.

        Returns:
            An instance of `cls`; the model is built and loaded on the
            first `fit`, `fine_tune` or `evaluate` call.
        """
        manifest = checkpoints.resolve(path)
        config = {k: v for k, v in manifest.get("trainer", {}).items()
                  if k in _CONFIG_KEYS}
        config.setdefault("checkpoint_dir",
                          os.path.dirname(manifest["weights_path"]))
        config.update(overrides)
        trainer = cls(**config)
        trainer._resume.source = manifest
        trainer.epochs_done = int(manifest["epoch"])
        return trainer

    def fine_tune(self, data, epochs, learning_rate=None, freeze=None,
                  val_data=None):
        """Continues training the current (or loaded) model on new data.

        Epochs are numbered on from the checkpoint's: fine-tuning a model
        saved after epoch 4 for 2 epochs runs epochs 5 and 6 and writes
        their checkpoints to `checkpoint_dir`.

        Args:
            data: the whole new training set, like `train_data()`.
            epochs: number of epochs to train (>= 1).
            learning_rate: new single-process learning rate (scaled as in
                the constructor); None keeps the current one.
            freeze: layer names, or a predicate `fn(layer) -> bool`; those
                layers are not trained.
            val_data: optional validation data, like `val_data()`.

        Returns:
            The `keras.callbacks.History` of the fine-tuning.
        """
        epochs = _tstate.positive_int("epochs", epochs)
        if learning_rate is not None:
            _tstate.check_numbers(learning_rate, 0, self.seed)
        _tstate.start()
        self._calls += 1
        dataset = _tdata.as_dataset(data, "fine_tune(data)")
        if val_data is not None:
            val_data = _tdata.as_dataset(val_data, "fine_tune(val_data)")
        self._prepare(dataset)
        if freeze is not None:
            self._freeze(freeze)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
            self._set_learning_rate(self.scaled_learning_rate)
        start = end = self.epochs_done
        end += epochs
        self._resume.begin_fine_tune(start, end)
        point = None
        if _inplace.recovering() and _grow.joined():
            # A new rank of a job that grew in place: the others' commit,
            # and the epoch they fine-tune to.
            point, end = self._share_commit(None, None)
            start = self.epochs_done = point.epoch
        elif self._resume.fine_tune_key is not None:
            start, point = self._resume_fine_tune(start, end)
        return self._train(dataset, val_data, start, end, warmup=False,
                           point=point)

    # ---- internals ------------------------------------------------------

    def _log(self, text):
        if self.verbose and basics.rank() == 0:
            print(f"kerasdist.Trainer: {text}", flush=True)

    def _prepare(self, sample_data):
        """Builds and compiles the model once (and loads the resume
        protocol's source checkpoint)."""
        if self.model is not None:
            return
        keras.utils.set_random_seed(self.seed)
        with _tstate.rank_independent_names():
            with self._sharded_build():
                model = self.build_model()
                if not isinstance(model, keras.Model):
                    raise TypeError(f"build_model() must return a "
                                    f"keras.Model, got "
                                    f"{type(model).__name__}.")
                if not model.built:
                    # Subclassed or Input-less models: build on one batch.
                    x = next(iter(sample_data.batch(1).take(1)))[0]
                    model(x)
            if self.shard == "weights":
                _weights.shard_weights(model)
            optimizer = self.build_optimizer(self.scaled_learning_rate)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError("build_optimizer() must return a "
                            "keras.optimizers.Optimizer, got "
                            f"{type(optimizer).__name__}.")
        if self.warmup_epochs and isinstance(
                optimizer._learning_rate,
                keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError("warmup_epochs > 0 needs a float learning rate; "
                             "build_optimizer() returned a schedule (use "
                             "kerasdist.schedules.WarmupSchedule instead).")
        self.optimizer = DistributedOptimizer(optimizer, shard=self.shard)
        self.model = model
        self._compile()
        # The optimizer compile chose: under the mixed_float16 policy a
        # LossScaleOptimizer around this one (building it builds both),
        # whose loss scale a checkpoint holds too.
        model.optimizer.build(model.trainable_variables)
        if self._resume.source is not None and not (
                _inplace.recovering() and _grow.joining()):
            # (A rank that joined a job grown in place takes the job's
            # state from its commit instead.)
            self._source_point = self._resume.load_source(
                self._load_on_rank0, self._rng_count(), self._load_all)
            _tcb.sync_state(model)
            source = self._resume.source
            self._log(f"loaded checkpoint {source['weights_path']} (after "
                      f"epoch {source['epoch']}, optimizer step "
                      f"{int(self.optimizer.iterations)})")

    def _sharded_build(self):
        """shard="weights": each layer sharded as soon as it is built."""
        if self.shard != "weights":
            return contextlib.nullcontext()
        return _weights.shard_weights()

    @property
    def _weights_sharded(self):
        return bool(self.model is not None and
                    _weights.shards_in(self.model.trainable_variables))

    def _compile(self):
        # By default: TensorFlow, no XLA (as before XLA kernels existed;
        # Keras's "auto" would turn it on on a GPU); JAX: the jitted step
        # calls them as XLA custom calls; PyTorch: eager, Keras's default.
        # `jit_compile` overrides.
        jit_compile = self.jit_compile
        if jit_compile is None:
            jit_compile = _framework.get().jit_compile
        self.model.compile(optimizer=self.optimizer, loss=self.build_loss(),
                           metrics=self.build_metrics(),
                           jit_compile=jit_compile)

    def _set_learning_rate(self, value):
        if not isinstance(self.optimizer._learning_rate,
                          keras.optimizers.schedules.LearningRateSchedule):
            self.optimizer.learning_rate = float(value)

    def _rng_count(self):
        return len(_tcb.seed_generators(self.model))

    def _load_on_rank0(self, manifest):
        """Loads a verified checkpoint on rank 0 (sync_state spreads it)."""
        if basics.rank() != 0:
            return
        path = manifest["weights_path"]
        record = manifest.get("optimizer_shards")
        if record is not None:
            # A sharded optimizer's checkpoint: the weight file holds the
            # shared optimizer variables, the shard files the slots.
            saved_weights = bool(record.get("weights"))
            with _tshards.shared_only(self.model.optimizer, record), \
                    (_tshards.unsharded_layers(self.model, record)
                     if saved_weights else contextlib.nullcontext()):
                self.model.load_weights(path)
            if saved_weights and not self._weights_sharded:
                # shard="weights"' checkpoint, whole weights: rank 0
                # reads them whole from the shard files (then broadcast).
                source = _shard_files.ShardFiles(os.path.dirname(path),
                                                 record)
                try:
                    _shard_files.load_whole_weights(
                        self.model.trainable_variables, source, record)
                finally:
                    source.close()
            if self._sharded is None:  # replicated: rank 0 reads them whole
                self._load_slots(manifest)
        else:
            held = _optimizer_variables_in(path)
            if not self.fresh_optimizer:
                wanted = len(self.optimizer.variables)
                if held < wanted:
                    raise ValueError(
                        f"{path} holds {held} of the optimizer's {wanted} "
                        f"variables (weights saved without their "
                        f"optimizer): resuming from it would train on "
                        f"with a fresh optimizer, not where the run "
                        f"stopped; pass fresh_optimizer=True to the "
                        f"Trainer to do that.")
            if self._sharded is None or \
                    held < len(self.optimizer.variables):
                self.model.load_weights(path)
            else:  # every rank reads its slice of each slot (_load_all)
                with _tshards.shared_only(self.model.optimizer):
                    self.model.load_weights(path)
        self._rescale_learning_rate(manifest.get("world_size"))
        self.resumed_from = manifest["weights_path"]

    def _rescale_learning_rate(self, old):
        """A state saved at `old` ranks: its learning rate was scaled for
        that size (a warmup in progress sets it again each step)."""
        new = basics.size()
        if old and old != new and self.scale_lr:
            lr = float(keras.ops.convert_to_numpy(
                self.optimizer.learning_rate))
            self._set_learning_rate(lr * new / old)

    @property
    def _sharded(self):
        """The sharded optimizer (shard=...), or None."""
        if self.optimizer is None:
            return None
        return _optimizer.sharded_in(self.optimizer)

    @property
    def _load_all(self):
        """What every rank loads of a checkpoint (after rank 0's
        `_load_on_rank0`): a sharded optimizer's ranks each read their
        shard of the slots. None for a replicated optimizer."""
        return None if self._sharded is None else self._load_slots

    def _load_slots(self, manifest):
        """Reads the optimizer's slots of a checkpoint: a sharded
        optimizer's rank its own shard, a replicated optimizer all."""
        record = manifest.get("optimizer_shards")
        path = manifest["weights_path"]
        if self._weights_sharded:
            self._load_weight_shards(manifest)
        if record is not None:
            source = _shard_files.ShardFiles(os.path.dirname(path), record)
            numels = {int(e["index"]): int(e["numel"])
                      for e in record["variables"]}
        else:
            if _optimizer_variables_in(path) < len(self.optimizer.variables):
                return  # fresh_optimizer: nothing to read
            source = _shard_files.PlainFile(path)
            layout = _optimizer.shard_state(self.model.optimizer).layout
            numels = {i: layout.numels[j]
                      for i, _, j in
                      _shard_files.slot_variables(self.model.optimizer)}
        try:
            _shard_files.load_slots(self.model.optimizer, source, numels)
        finally:
            source.close()

    def _load_weight_shards(self, manifest):
        """Every rank of a shard="weights" model: its slices of the saved
        weights, from the shard files of a shard="weights" checkpoint, or
        from the weight file of any other (h5py slices)."""
        record = manifest.get("optimizer_shards")
        path = manifest["weights_path"]
        if record is not None and record.get("weights"):
            source = _shard_files.ShardFiles(os.path.dirname(path), record)
            try:
                _shard_files.load_weight_shards(self.model.optimizer, source,
                                                record)
            finally:
                source.close()
            return
        # Whole weights in the weight file: each rank reads its slices
        # (the optimizer's slots are read below; the shared variables
        # again, alike).
        with _tshards.shared_only(self.model.optimizer, record):
            self.model.load_weights(path)

    def _resume_fit(self):
        """Finds and loads the newest checkpoint on rank 0; every rank gets
        the epoch to start from. Returns it."""
        name, attempt = _tresume.restart_attempt()
        if attempt:
            self._log(f"restart attempt {attempt + 1} ({name}={attempt})")
        point = None
        if self.checkpoint_dir and self.auto_resume:
            point = self._resume.load_latest(
                self.checkpoint_dir, self._load_on_rank0, self._rng_count(),
                self._load_all)
        if point is not None:
            _tcb.sync_state(self.model)
            self._log_resume(point, self.epochs)
        elif self.checkpoint_dir and self.auto_resume:
            self._log(f"no checkpoint in {self.checkpoint_dir}; starting "
                      "from epoch 1")
        self.epochs_done = point.epoch if point else 0
        return point

    def _log_resume(self, point, end, what="resuming"):
        where = _tresume.describe(point, end, basics.size(), self.scale_lr)
        self._log(f"{what} from {self.resumed_from} {where} (optimizer "
                  f"step {int(self.optimizer.iterations)})")

    def _resume_fine_tune(self, start, end):
        """Continues an interrupted fine_tune of the same checkpoint over
        the same epochs from its newest checkpoint; returns the start."""
        if not (self.checkpoint_dir and self.auto_resume):
            return start, None
        point = self._resume.load_latest_fine_tune(
            self.checkpoint_dir, self._load_on_rank0, self._rng_count(),
            self._load_all)
        if point is None:
            return start, None
        _tcb.sync_state(self.model)
        self._log_resume(point, end, "resuming fine-tuning")
        self.epochs_done = point.epoch
        return point.epoch, point

    def _epoch_plan(self, n, start, point):
        """Where training starts: epoch `start`, or within it when `point`
        (a Resumed) is a step checkpoint of that epoch."""
        kwargs = dict(size=basics.size(), sharded=self.data_is_sharded,
                      batch_size=self.batch_size)
        steps = _tdata.epoch_steps(n, **kwargs)
        position, first_steps = 0, steps
        if point is not None and point.samples and point.epoch == start:
            first_steps = _tdata.epoch_steps(n, position=point.samples,
                                             **kwargs)
            if first_steps:
                position = point.samples
            else:  # fewer examples left than ranks: the epoch is done
                start, first_steps = start + 1, steps
        return _tdata.EpochPlan(start, position, first_steps, steps,
                                _tdata.samples_per_step(**kwargs))

    def _train(self, train, val, start, end, warmup=True, point=None):
        n = _tdata.count(train)
        plan = self._epoch_plan(n, start, point)
        self.initial_epoch = plan.first_epoch
        self.initial_samples = plan.first_position
        if plan.first_epoch >= end:
            self._log(f"all {end} epochs are done already; nothing to train")
            self.history = keras.callbacks.History()
            self.history.set_model(self.model)
            return self.history
        rank, size = basics.rank(), basics.size()
        # The shuffle seeds are (global seed, epoch-derived op seed): fix the
        # global one. Never 0: TF's get_seed then compares the (tensor) op
        # seed with 0 in Python, which fails inside the tf.data function.
        tf.random.set_seed(self.seed % (2 ** 31 - 1) + 1)
        pipeline, _ = _tdata.train_pipeline(
            train, n, rank=rank, size=size, sharded=self.data_is_sharded,
            batch_size=self.batch_size, seed=self.seed, shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer, first_epoch=plan.first_epoch,
            last_epoch=end, first_position=plan.first_position,
            first_steps=plan.first_steps)
        val_local = None if val is None else self._val_pipeline(val)
        self._plan = plan
        self._step_saved = None
        self._shard_writer = None
        if self.checkpoint_dir and self._sharded is not None:
            nonce = np.frombuffer(os.urandom(8), np.int64) % (2 ** 62)
            nonce = _host.host_broadcast(nonce, 0,
                                         "kerasdist.trainer.shard_nonce")
            # Every rank writes its shard file there: one line now, not
            # rank 0's wait for files on another disk at the first save.
            _host.check_shared_directory(
                self.checkpoint_dir, "checkpoint_dir",
                "kerasdist.trainer.shared_dir")
            self._shard_writer = _tshards.ShardWriter(
                self.model.optimizer, self.checkpoint_dir, int(nonce[0]),
                model=self.model)
        if self.checkpoint_dir and self.step_checkpoints and (
                rank == 0 or self._shard_writer is not None):
            self._steps = _tsnap.StepCheckpoints(
                self.model, self.checkpoint_dir, self.keep_checkpoints,
                written=self._step_written, sharded=self._shard_writer)
        if _inplace.recovering() and self._commits is None:
            self._commits = _inplace.Commits(self.model)
        if self._resizable:
            # With commits in memory it grows and shrinks in place.
            _resize.announce(rank, grows_in_place=self._resizes_in_place)
        lost = shrink = None
        try:
            self.history = self.model.fit(
                pipeline, epochs=end, initial_epoch=plan.first_epoch,
                steps_per_epoch=plan.steps, validation_data=val_local,
                shuffle=False,  # the pipeline does
                callbacks=self._callbacks(
                    warmup and self.warmup_epochs > 0, point, end),
                verbose=self.verbose if rank == 0 else 0, **self.fit_kwargs)
        except _inplace.ResizeInPlace as e:
            shrink = e
        except Exception as e:
            if self._commits is None or self._commits.last is None or \
                    not _inplace.ranks_lost(e):
                raise
            lost = _inplace.as_ranks_lost(e)
        finally:
            steps, self._steps = self._steps, None
            if steps is not None and lost is None:
                steps.close()  # the step checkpoint in flight completes
            elif steps is not None:
                # A sharded one would wait for the lost rank's shard file.
                steps.abandon()
        if shrink is not None and _grow.started():
            point = self._grow(end)
        elif shrink is not None:
            point = self._shrink(end)
        elif lost is None:
            if _grow.started():
                # The new ranks join a job that is done: they get its end.
                history = self.history
                self._grow(end)
                self.history = history
            return self.history
        else:
            point = self._recover(lost, end)
        return self._train(train, val, point.epoch, end, warmup, point)

    def _recover(self, error, end):
        """Every survivor of a lost rank (`error`): re-forms the job among
        the survivors, goes back to the last commit in memory (the
        learning rate rescaled for the new size, the traced step
        functions dropped) and returns its point."""
        restore, point = self._commit_restorer()
        _elastic.recover_in_place(error, restore, "kerasdist.Trainer")
        return self._from_commit(point[0], end)

    def _shrink(self, end):
        """Every rank, at the commit where the ranks agreed to shrink in
        place (`_resize_here`): the ranks that leave end with exit code 0
        (SystemExit); the others split off, start the runtime on the
        smaller job and go back to that commit as `_recover` does.
        Returns its point."""
        restore, point = self._commit_restorer()

        def log(text):
            print(f"kerasdist.Trainer: {text}", file=sys.stderr, flush=True)

        _shrink.finish(types.SimpleNamespace(
            restore=restore, on_reset=lambda: None, sync=lambda: None), log)
        return self._from_commit(point[0], end)

    def _grow(self, end):
        """Every rank, where the new ranks of a grow in place have joined
        (or at the end of training): starts the runtime on the grown job,
        puts the commit just made back and sends it, with its point, to
        the new ranks (`_share_commit`); returns its point."""
        point = [None]

        def on_reset():
            point[0] = self._commits.restore(grown=True)

        def sync():
            point[0], _ = self._share_commit(point[0], end)

        def log(text):
            print(f"kerasdist.Trainer: {text}", file=sys.stderr, flush=True)

        _grow.finish(types.SimpleNamespace(on_reset=on_reset, sync=sync),
                     log)
        return self._from_commit(point[0], end)

    def _share_commit(self, point, end):
        """Every rank of a job that grew in place, the new ones included
        (`point` and `end` None there): rank 0's commit point, the epoch
        its training call ends at (`end`) and its state, the learning
        rate rescaled for the new size, the traced step functions
        dropped. Returns (point, end)."""
        from kerasdist.objects import broadcast_object
        point, end, key = broadcast_object(
            (point, end, self._resume.fine_tune_key), 0,
            name="kerasdist.trainer.grow")
        self._resume.fine_tune_key = key
        _tcb.sync_state(self.model)
        if self._commits is None:  # a new rank
            self._commits = _inplace.Commits(self.model)
        # A sharded state: the commit's shards laid out over the grown job.
        self._commits.grow(point)
        self._rescale_learning_rate(point.world_size)
        _inplace.forget_traces(self.model)
        # The new ranks' optimizers are new: every rank's next step
        # reduces as a new optimizer's first does (PyTorch's overlap).
        _optimizer.restart_overlap(self.model.optimizer)
        return point, end

    def _commit_restorer(self):
        """(restore, point): `restore()` puts the last commit in memory
        back on the variables at the job's size now (the learning rate
        rescaled, the state synced from rank 0, the traced step functions
        dropped) and sets point[0] to its point."""
        commits, point = self._commits, [None]

        def restore():
            point[0] = commits.restore()
            self._rescale_learning_rate(point[0].world_size)
            _tcb.sync_state(self.model)
            _inplace.forget_traces(self.model)

        return restore, point

    def _from_commit(self, point, end):
        self.epochs_done = point.epoch
        where = _tresume.describe(point, end, basics.size(), self.scale_lr)
        self._log(f"resuming from the last commit in memory {where} "
                  f"(optimizer step {int(self.optimizer.iterations)})")
        return point

    @property
    def _resizes_in_place(self):
        """Whether the job grows and shrinks in place when the launcher
        asks, or (over TCP) lets waiting processes in: an elastic job
        that checks for resizes, or a TCP job that re-forms, with commits
        in memory (--recover-in-place)."""
        return (self._resizable or _grow.joinable()) and \
            self._commits is not None

    def _check_resize(self, epoch, batch):
        """Every rank, at the commits' steps and epoch ends (batch None),
        every callback done with the step: the ranks agree in one small
        allreduce on the launcher's resize request and on whether a grow
        in place is still starting its new ranks; a request is served
        here (`_resize_here`), and where the new ranks have joined the
        state is committed and ResizeInPlace raised."""
        if self._relaunching:
            return
        # Over TCP, processes waiting to join (rank 0 asks the rendezvous)
        # are a request too, served here (`_join_here`).
        flag = np.array([1 if _resize.requested() else 0,
                         1 if _grow.spawning() else 0,
                         1 if self._lets_in and not _grow.started() and
                         _grow.waiting() else 0], np.int64)
        flag = _host.host_allreduce(flag, basics.Max,
                                    "kerasdist.trainer.resize_in_place")
        if _grow.started():
            if not int(flag[1]):
                self._commit_here(epoch, batch)
                raise _inplace.ResizeInPlace()
            return
        if int(flag[0]):
            self._resize_here(epoch, batch)
        elif int(flag[2]):
            self._join_here()

    @property
    def _lets_in(self):
        return _grow.joinable() and not getattr(self, "_no_joins", False)

    def _join_here(self):
        """Every rank, at a commits' step where rank 0 found processes
        waiting to join this TCP job (`kerasdist run --join`): lets them
        in as a grow in place; they join at their first fit() or
        fine_tune(), so only during this Trainer's first training call."""
        body = _grow.request()
        if not _grow.is_request(body):
            return  # they went meanwhile
        if self._calls > 1:
            self._no_joins = True
            if basics.rank() == 0:
                print(f"kerasdist.Trainer: cannot let in the "
                      f"{body['join']} process(es) waiting to join: a new "
                      f"rank runs the script from its start and joins at "
                      f"its first fit() or fine_tune(), and this is call "
                      f"{self._calls}; they wait until their rendezvous "
                      f"timeout.", file=sys.stderr, flush=True)
            return
        _grow.begin(body)

    def _resize_here(self, epoch, batch):
        """Every rank, at a step boundary (`batch`) or an epoch end (batch
        None) where the ranks agreed on a resize request, every callback
        done with the step: where the launcher's request (rank 0 reads
        it, every rank gets it) is a shrink in place, commits the state
        here and raises ResizeInPlace; where it is a grow in place, starts
        the new ranks in the background and returns True (the others
        train on meanwhile); otherwise returns False, and the job stops
        for a relaunch at its next checkpoint boundary (a resize that
        cannot be done in place: a grow onto another host, or during a
        training call after the first, which a new rank would not
        join)."""
        if _grow.started():
            return True
        if self._relaunching:
            return False
        body = _grow.request()
        if _shrink.take(body):
            self._commit_here(epoch, batch)
            raise _inplace.ResizeInPlace()
        if self._resizes_in_place and self._calls > 1:
            if basics.rank() == 0:
                print(f"kerasdist.Trainer: cannot grow in place: a new rank "
                      f"runs the script from its start and joins the job "
                      f"at its first fit() or fine_tune(), and this is "
                      f"call {self._calls}; relaunching at the next step "
                      f"checkpoint instead.", file=sys.stderr, flush=True)
        elif self._resizes_in_place and _grow.begin(body):
            return True
        self._relaunching = True
        return False

    def _commit_here(self, epoch, batch):
        if batch is None:
            self._commits.take(epoch + 1, 0, [])
        else:
            self._commits.take(epoch, self._plan.position(epoch, batch),
                               _tcb.seed_counters(self.model))

    def _val_pipeline(self, val):
        val_local, n_local = self._eval_data(val)
        counts = _tstate.gather_row([float(n_local)], "val.count")[:, 0]
        if counts.min() == 0:
            raise ValueError("val_data() leaves some rank without "
                             "examples; give it at least size() "
                             "examples.")
        return val_local

    def _warmup_callback(self):
        plan = self._plan
        kwargs = dict(initial_lr=self.scaled_learning_rate,
                      warmup_epochs=self.warmup_epochs,
                      verbose=self.verbose if basics.rank() == 0 else 0)
        if plan.first_position:
            return _tcb.ResumedWarmupCallback(
                epoch=plan.first_epoch,
                offset=plan.first_position / plan.per_step, **kwargs)
        return kd_callbacks.LearningRateWarmupCallback(**kwargs)

    def _callbacks(self, warmup, point, end):
        rank, plan = basics.rank(), self._plan
        cbs = [kd_callbacks.BroadcastGlobalVariablesCallback(0),
               kd_callbacks.MetricAverageCallback()]
        if warmup:
            cbs.append(self._warmup_callback())
        # The pipeline already gives every rank the same number of steps;
        # this keeps that true for anything fit_kwargs might change.
        cbs.append(kd_callbacks.EqualizeStepsCallback())
        if plan.first_position:  # within an epoch: go on from there
            cbs.append(_tcb.ReseedCallback(self.seed, rank, plan.first_epoch,
                                           point.rng))
            cbs.append(_tcb.ShortEpochCallback(plan.first_epoch,
                                               plan.first_steps))
        else:
            cbs.append(_tcb.ReseedCallback(self.seed, rank))
        if self.checkpoint_dir:
            cbs.append(_tcb.CheckpointCallback(
                self._save, None if self._shard_writer is None
                else self._save_shard))
        if self._commits is not None:
            every = self.commit_every_steps or _inplace.DEFAULT_EVERY_STEPS
            start = (plan.first_epoch, plan.first_position,
                     point.rng if plan.first_position else [])
            cbs.append(_inplace.CommitCallback(
                self._commits, every, plan.position, plan.is_last, start))
        if self._steps is not None:
            cbs.append(_tcb.StepCheckpointCallback(
                self._save_step, self._steps.busy, plan.is_last,
                self.checkpoint_every_steps, self.checkpoint_every_seconds,
                agree=self._shard_writer is not None))
        cbs.extend(self.callbacks() or [])
        if self.tensorboard_dir and rank == 0:
            cbs.append(keras.callbacks.TensorBoard(self.tensorboard_dir))
        if self._resizes_in_place:
            # At the commits' steps, after every callback has seen the
            # step: a resize the launcher asks for is done in place.
            cbs.append(_inplace.ResizeCheckCallback(
                self._check_resize,
                self.commit_every_steps or _inplace.DEFAULT_EVERY_STEPS,
                plan.is_last, end))
        if self._resizable:
            # With only checkpoint_every_seconds, rank 0 alone knows when a
            # step checkpoint is due: the ranks agree at every step.
            every = (self.checkpoint_every_steps or 1) \
                if self.step_checkpoints else None
            cbs.append(_tcb.ResizeCallback(self._stop_for_resize,
                                           plan.is_last, end,
                                           every_steps=every))
        return cbs

    @property
    def _resizable(self):
        """Whether this job stops for the launcher's resize requests: an
        elastic `kerasdist run` and checkpoints to resume from."""
        return bool(self.checkpoint_dir) and _resize.checking()

    def _stop_for_resize(self, epoch, batch):
        """Every rank, at a step boundary (`batch`) or an epoch end (batch
        None) where they agreed to stop for a resize: rank 0 writes the
        step checkpoint the next attempt resumes from, then every rank
        ends the process (exit code _resize.RESIZE_EXIT_CODE). A job that
        resizes in place does so here instead where the launcher asks for
        it in place (`_resize_here`)."""
        if self._resizes_in_place and self._resize_here(epoch, batch):
            return
        if batch is not None and self._steps is not None:
            self._steps.wait()
            if self._step_saved != (epoch, batch):
                self._save_step(epoch, batch)
            self._steps.wait()
        _host.host_barrier("kerasdist.trainer.resize.saved")
        where = (f"after epoch {epoch + 1}" if batch is None else
                 f"in epoch {epoch + 1}, after its first "
                 f"{self._plan.position(epoch, batch)} examples")
        self._log(f"stopping {where} (optimizer step "
                  f"{int(self.optimizer.iterations)}) to resize: the "
                  f"launcher asked, the checkpoint is written")
        raise _resize.Resize()

    def _save(self, epochs_done, logs):
        if self._steps is not None:
            self._steps.wait()  # one writer at a time in the directory
        self.epochs_done = epochs_done
        info = _tstate.manifest_info(self, logs, _CONFIG_KEYS,
                                     self._resume.manifest_fields())
        writer = self._shard_writer
        if writer is None:
            self.last_checkpoint = checkpoints.save(
                self.checkpoint_dir, epochs_done, self.model.save_weights,
                info, keep=self.keep_checkpoints)
            return
        with writer.weights_io():
            self.last_checkpoint = checkpoints.save(
                self.checkpoint_dir, epochs_done, self.model.save_weights,
                info, keep=self.keep_checkpoints, shards=writer.collect)

    def _save_shard(self, epochs_done):
        """Every rank of a sharded optimizer, at an epoch end: writes its
        shard file of the epoch checkpoint (rank 0's `_save` then waits
        for every rank's)."""
        if self._steps is not None:
            self._steps.wait()
        writer = self._shard_writer
        writer.write(epochs_done, 0, writer.take())

    def _step_written(self, path):
        # On the writer's thread; an epoch checkpoint waits for it first.
        self.last_checkpoint = path

    def _save_step(self, epoch, batch):
        """Rank 0, at a step boundary: has the state after batch `batch` of
        epoch `epoch` (0-based) written in the background."""
        info = _tstate.manifest_info(self, {}, _CONFIG_KEYS,
                                     self._resume.manifest_fields())
        info["rng_counters"] = _tcb.seed_counters(self.model)
        self._steps.save(epoch, self._plan.position(epoch, batch), info)
        self._step_saved = (epoch, batch)

    def _eval_data(self, dataset):
        n = _tdata.count(dataset)
        return _tdata.eval_pipeline(
            dataset, n, rank=basics.rank(), size=basics.size(),
            sharded=self.data_is_sharded, batch_size=self.batch_size)

    def _freeze(self, freeze):
        chosen = _tstate.layers_to_freeze(self.model, freeze)
        for layer in chosen:
            layer.trainable = False
        # Recompile so the train step sees the new trainable set; the
        # optimizer object (and its state) is kept.
        self._compile()


def _optimizer_variables_in(path):
    """How many optimizer variables a Keras weight file holds (Keras 3's
    layout: optimizer/vars/0..N-1; 0 when it was saved without one)."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            group = f.get("optimizer/vars")
            return 0 if group is None else len(group.keys())
    except OSError:
        return 0
