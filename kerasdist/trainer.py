"""Trainer: a base class for data-parallel Keras training.

Subclass it, say how to build the model and where the data is, and call
`fit()` under `kerasdist run -np N`. The Trainer does the rest: sharding,
the scaled learning rate with an optional warmup, the
`DistributedOptimizer`, the broadcast at start, averaged metrics, rank-0
logging, atomic checkpoints and an exact resume after a restart.
"""

import importlib.util
import os

import keras
import numpy as np
import tensorflow as tf

from kerasdist import _trainer_callbacks as _tcb
from kerasdist import _trainer_data as _tdata
from kerasdist import _trainer_resume as _tresume
from kerasdist import _trainer_state as _tstate
from kerasdist import _keras_backend
from kerasdist import basics
from kerasdist import checkpoints
from kerasdist import callbacks as kd_callbacks
from kerasdist.optimizer import DistributedOptimizer

# fit() arguments the Trainer sets itself; fit_kwargs may not override them.
_RESERVED_FIT_KWARGS = frozenset({
    "x", "y", "batch_size", "epochs", "initial_epoch", "steps_per_epoch",
    "callbacks", "validation_data", "validation_split", "verbose",
    "shuffle"})
# Constructor settings a checkpoint records, so from_checkpoint can rebuild.
_CONFIG_KEYS = ("epochs", "batch_size", "learning_rate", "scale_lr",
                "warmup_epochs", "seed", "data_is_sharded", "shuffle",
                "shuffle_buffer")


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
    resuming gives the same weights as training straight through.

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
        keep_checkpoints: how many of the newest checkpoints to keep.
        auto_resume: resume from the newest complete checkpoint in
            `checkpoint_dir` if there is one.
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
                 keep_checkpoints=3, auto_resume=True, seed=0, verbose=1,
                 tensorboard_dir=None, data_is_sharded=False, shuffle=True,
                 shuffle_buffer=None, fit_kwargs=None):
        self.epochs = _tstate.positive_int("epochs", epochs)
        self.batch_size = _tstate.positive_int("batch_size", batch_size)
        self.keep_checkpoints = _tstate.positive_int("keep_checkpoints",
                                                     keep_checkpoints)
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
        self.learning_rate = float(learning_rate)
        self.scale_lr = bool(scale_lr)
        self.warmup_epochs = warmup_epochs
        self.checkpoint_dir = None if checkpoint_dir is None else \
            os.fspath(checkpoint_dir)
        self.auto_resume = bool(auto_resume)
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
        self.epochs_done = 0  # epochs the current weights were trained for
        self.resumed_from = None  # weight file of the checkpoint loaded
        self.last_checkpoint = None  # manifest path of the last one written
        self._resume = _tresume.ResumeProtocol()

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
            kerasdist.checkpoints.CheckpointError: if `checkpoint_dir`
                holds checkpoints but none is intact.
        """
        _tstate.start()
        train = _tdata.as_dataset(self.train_data(), "train_data()")
        val = self.val_data()
        if val is not None:
            val = _tdata.as_dataset(val, "val_data()")
        self._prepare(train)
        self._resume.begin_fit()
        start = (self._resume_fit() if self._resume.source is None
                 else self.epochs_done)
        return self._train(train, val, start, self.epochs)

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
        if self._resume.fine_tune_key is not None:
            start = self._resume_fine_tune(start, end)
        return self._train(dataset, val_data, start, end, warmup=False)

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
            model = self.build_model()
            if not isinstance(model, keras.Model):
                raise TypeError(f"build_model() must return a keras.Model, "
                                f"got {type(model).__name__}.")
            if not model.built:
                # Subclassed or Input-less models: build on one batch.
                x = next(iter(sample_data.batch(1).take(1)))[0]
                model(x)
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
        self.optimizer = DistributedOptimizer(optimizer)
        self.model = model
        self._compile()
        self.optimizer.build(model.trainable_variables)
        if self._resume.source is not None:
            self._resume.load_source(self._load_on_rank0)
            _tcb.sync_state(model)

    def _compile(self):
        # TensorFlow: no XLA, kerasdist's TF ops have no XLA kernel (Keras's
        # "auto" turns XLA on when a GPU is present). JAX: the jitted step
        # calls them as XLA custom calls. PyTorch: eager, Keras's default.
        self.model.compile(optimizer=self.optimizer, loss=self.build_loss(),
                           metrics=self.build_metrics(),
                           jit_compile=_keras_backend.jit_compile())

    def _set_learning_rate(self, value):
        if not isinstance(self.optimizer._learning_rate,
                          keras.optimizers.schedules.LearningRateSchedule):
            self.optimizer.learning_rate = float(value)

    def _load_on_rank0(self, manifest):
        """Loads a verified checkpoint on rank 0 (sync_state spreads it)."""
        if basics.rank() != 0:
            return
        self.model.load_weights(manifest["weights_path"])
        if manifest.get("world_size") != basics.size():
            # Written at another world size: its learning rate was scaled
            # for that size.
            self._set_learning_rate(self.scaled_learning_rate)
        self.resumed_from = manifest["weights_path"]

    def _resume_fit(self):
        """Finds and loads the newest checkpoint on rank 0; every rank gets
        the epoch to start from. Returns it."""
        name, attempt = _tresume.restart_attempt()
        if attempt:
            self._log(f"restart attempt {attempt + 1} ({name}={attempt})")
        done = None
        if self.checkpoint_dir and self.auto_resume:
            done = self._resume.load_latest(self.checkpoint_dir,
                                            self._load_on_rank0)
        if done is not None:
            _tcb.sync_state(self.model)
            self._log(f"resuming from {self.resumed_from} at epoch "
                      f"{done + 1} of {self.epochs} (optimizer "
                      f"step {int(self.optimizer.iterations)})")
        elif self.checkpoint_dir and self.auto_resume:
            self._log(f"no checkpoint in {self.checkpoint_dir}; starting "
                      "from epoch 1")
        self.epochs_done = done or 0
        return self.epochs_done

    def _resume_fine_tune(self, start, end):
        """Continues an interrupted fine_tune of the same checkpoint over
        the same epochs from its newest checkpoint; returns the start."""
        if not (self.checkpoint_dir and self.auto_resume):
            return start
        done = self._resume.load_latest_fine_tune(self.checkpoint_dir,
                                                  self._load_on_rank0)
        if done is None:
            return start
        _tcb.sync_state(self.model)
        self._log(f"resuming fine-tuning from {self.resumed_from} at epoch "
                  f"{done + 1} of {end}")
        self.epochs_done = done
        return done

    def _train(self, train, val, start, end, warmup=True):
        self.initial_epoch = start
        if start >= end:
            self._log(f"all {end} epochs are done already; nothing to train")
            self.history = keras.callbacks.History()
            self.history.set_model(self.model)
            return self.history
        rank, size = basics.rank(), basics.size()
        # The shuffle seeds are (global seed, epoch-derived op seed): fix the
        # global one. Never 0: TF's get_seed then compares the (tensor) op
        # seed with 0 in Python, which fails inside the tf.data function.
        tf.random.set_seed(self.seed % (2 ** 31 - 1) + 1)
        pipeline, steps = _tdata.train_pipeline(
            train, _tdata.count(train), rank=rank, size=size,
            sharded=self.data_is_sharded, batch_size=self.batch_size,
            seed=self.seed, shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer, first_epoch=start,
            last_epoch=end)
        val_local = None
        if val is not None:
            val_local, n_local = self._eval_data(val)
            counts = _tstate.gather_row([float(n_local)], "val.count")[:, 0]
            if counts.min() == 0:
                raise ValueError("val_data() leaves some rank without "
                                 "examples; give it at least size() "
                                 "examples.")
        history = self.model.fit(
            pipeline, epochs=end, initial_epoch=start, steps_per_epoch=steps,
            validation_data=val_local, shuffle=False,  # the pipeline does
            callbacks=self._callbacks(warmup and self.warmup_epochs > 0),
            verbose=self.verbose if rank == 0 else 0, **self.fit_kwargs)
        self.history = history
        return history

    def _callbacks(self, warmup):
        rank = basics.rank()
        cbs = [kd_callbacks.BroadcastGlobalVariablesCallback(0),
               kd_callbacks.MetricAverageCallback()]
        if warmup:
            cbs.append(kd_callbacks.LearningRateWarmupCallback(
                initial_lr=self.scaled_learning_rate,
                warmup_epochs=self.warmup_epochs,
                verbose=self.verbose if rank == 0 else 0))
        # The pipeline already gives every rank the same number of steps;
        # this keeps that true for anything fit_kwargs might change.
        cbs.append(kd_callbacks.EqualizeStepsCallback())
        cbs.append(_tcb.ReseedCallback(self.seed, rank))
        if self.checkpoint_dir:
            cbs.append(_tcb.CheckpointCallback(self._save))
        cbs.extend(self.callbacks() or [])
        if self.tensorboard_dir and rank == 0:
            cbs.append(keras.callbacks.TensorBoard(self.tensorboard_dir))
        return cbs

    def _save(self, epochs_done, logs):
        self.epochs_done = epochs_done
        info = _tstate.manifest_info(self, logs, _CONFIG_KEYS,
                                     self._resume.manifest_fields())
        self.last_checkpoint = checkpoints.save(
            self.checkpoint_dir, epochs_done, self.model.save_weights, info,
            keep=self.keep_checkpoints)

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
