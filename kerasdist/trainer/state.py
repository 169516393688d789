"""Process setup and small helpers of the Trainer (private); the resume
protocol is in kerasdist.trainer.resume."""

import collections
import contextlib
import warnings

import keras
import numpy as np
import tensorflow as tf

from kerasdist import __version__ as kerasdist_version
from kerasdist import basics
from kerasdist._core import host as _host


def start():
    """Initialises kerasdist if needed; pins this process's GPU."""
    if not basics.is_initialized():
        basics.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        try:
            gpu = gpus[basics.local_rank() % len(gpus)]
            tf.config.set_visible_devices(gpu, "GPU")
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:
            pass  # TF already set up its devices; keep them.


@contextlib.contextmanager
def rank_independent_names():
    """Builds Keras objects with auto names that do not depend on what this
    process built before.

    Keras numbers auto names per process ("sequential_2/dense_3"), and
    DistributedOptimizer names each gradient allreduce after its
    variable's path. A rank that built one model more before the Trainer's
    (a rank-0-only evaluation model, say) would name the same gradient
    differently from the other ranks, and the job would hang. Inside this
    context the counters start from zero; afterwards each is the larger of
    its old and new value, so later names stay unique.
    """
    try:  # Keras keeps the counters in private global state.
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - another Keras layout
        yield
        return
    key = "object_name_uids"
    old = global_state.get_global_attribute(
        key, default=collections.defaultdict(int), set_to_default=True)
    fresh = collections.defaultdict(int)
    global_state.set_global_attribute(key, fresh)
    try:
        yield
    finally:
        merged = collections.defaultdict(int, old)
        for name, count in fresh.items():
            merged[name] = max(merged[name], count)
        global_state.set_global_attribute(key, merged)


def manifest_info(trainer, logs, config_keys, resume_fields):
    """What a checkpoint's manifest records besides the file facts:
    `resume_fields` (ResumeProtocol.manifest_fields()) and the trainer's
    public state."""
    cls = type(trainer)
    return {
        "step": int(trainer.optimizer.iterations),
        "world_size": basics.size(),
        **resume_fields,
        "trainer_class": f"{cls.__module__}.{cls.__qualname__}",
        "trainer": {k: getattr(trainer, k) for k in config_keys},
        "logs": {k: float(v) for k, v in logs.items()
                 if isinstance(v, (int, float, np.number))},
        "versions": {"kerasdist": kerasdist_version,
                     "tensorflow": tf.__version__,
                     "keras": keras.__version__},
    }


def positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


def step_checkpoint_settings(every_steps, every_seconds, checkpoint_dir):
    """Checks checkpoint_every_steps / _seconds; returns them (int or None,
    float or None).

    Raises:
        ValueError: for a value that is not > 0, or either without a
            checkpoint_dir.
    """
    if every_steps is not None:
        every_steps = positive_int("checkpoint_every_steps", every_steps)
    if every_seconds is not None:
        if isinstance(every_seconds, bool) or not isinstance(
                every_seconds, (int, float, np.number)) or \
                not every_seconds > 0:
            raise ValueError("checkpoint_every_seconds must be a number > 0, "
                             f"got {every_seconds!r}.")
        every_seconds = float(every_seconds)
    if (every_steps or every_seconds) and checkpoint_dir is None:
        raise ValueError("checkpoint_every_steps / checkpoint_every_seconds "
                         "need a checkpoint_dir to write to.")
    return every_steps, every_seconds


def check_numbers(learning_rate, warmup_epochs, seed):
    """Raises ValueError for a bad learning rate, warmup or seed."""
    if isinstance(learning_rate, bool) or not isinstance(
            learning_rate, (int, float)) or not learning_rate > 0:
        raise ValueError(f"learning_rate must be a number > 0, got "
                         f"{learning_rate!r}.")
    if isinstance(warmup_epochs, bool) or not isinstance(
            warmup_epochs, int) or warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be an int >= 0, got "
                         f"{warmup_epochs!r}.")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}.")


def gather_row(row, tag):
    """[size, len(row)] float64 table of every rank's `row`."""
    row = np.asarray([row], np.float64)
    return _host.host_allgather(row, f"kerasdist.trainer.{tag}")


def layers_to_freeze(model, freeze):
    """The layers `freeze` (names, one name or a predicate) selects.

    Raises:
        ValueError: for names the model does not have.
    """
    layers = list(model._flatten_layers(include_self=False))
    if callable(freeze):
        chosen = [layer for layer in layers if freeze(layer)]
    else:
        names = [freeze] if isinstance(freeze, str) else list(freeze)
        known = {layer.name for layer in layers}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"freeze names unknown layers {unknown}; the "
                             f"model has {sorted(known)}.")
        chosen = [layer for layer in layers if layer.name in names]
    if not chosen:
        warnings.warn("fine_tune(freeze=...) matched no layer.")
    return chosen
