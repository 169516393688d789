"""Helpers shared by the callbacks (private)."""

import hashlib
import warnings
import weakref

import numpy as np

from kerasdist import basics
from kerasdist._core import host as _host
from kerasdist.keras import framework as _framework
from kerasdist.keras import optimizer as _optimizer


def model_is_built(model):
    """True when every layer of `model` has created its variables."""
    layers = getattr(model, "_flatten_layers", None)
    if layers is None:
        return bool(model.built)
    return bool(model.built) and all(layer.built for layer in layers())


# Models whose ranks average their weights themselves (ModelAverageCallback):
# a plain optimizer is what they need. And the models already warned about.
_AVERAGED_BY_CALLBACK = weakref.WeakSet()
_WARNED = weakref.WeakSet()


def averages_weights_itself(model):
    """Marks `model` as trained with a plain optimizer on purpose (local
    SGD: a callback averages its weights every few steps)."""
    _AVERAGED_BY_CALLBACK.add(model)


def say_if_not_distributed(model):
    """Before the first step of a job of more than one rank: one line (rank
    0, once per model) when the model's optimizer averages nothing, so each
    rank would train on its own gradients and the weights drift apart.

    Horovod's wrapper had the same hole on Keras 3 and nothing said so; a
    keras-hub task compiles itself with its own optimizer, so a `fit`
    without `compile` meets it."""
    if (basics.size() == 1 or basics.rank() != 0 or model in _WARNED
            or model in _AVERAGED_BY_CALLBACK):
        return
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or _optimizer.is_distributed(optimizer):
        return
    _WARNED.add(model)
    warnings.warn(
        f"kerasdist: {model.name}'s optimizer ({type(optimizer).__name__}) "
        "is not a kerasdist DistributedOptimizer, so each of the "
        f"{basics.size()} ranks trains on its own gradients, unaveraged, "
        "and their weights drift apart. Compile with one: "
        "model.compile(optimizer=kd.DistributedOptimizer(...), ...); a "
        "keras-hub task compiles itself with its own optimizer, so call "
        "task.compile(optimizer=kd.DistributedOptimizer(...), ...) before "
        "fit (docs/keras.md, keras-hub).", stacklevel=2)


def build_optimizer(model):
    """Creates the optimizer's slot variables now, so that they exist (and
    can be broadcast or restored) before the first training step."""
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)


def state_variables(model):
    """The variables an exact resume needs, in a fixed order: the model's
    weights (trainable and not, without metric state and seed generators),
    then every optimizer variable (iterations and learning rate included)."""
    variables = _optimizer.replicated(model.weights)
    if model.optimizer is not None:
        variables += _optimizer.whole_variables(model.optimizer)
    return variables


def variable_name(v):
    return getattr(v, "path", None) or v.name


def _fingerprint(v):
    # A hash of the raw bytes: exact (no float tolerance) and the same on
    # every rank that holds the same bits, on every backend.
    data = np.ascontiguousarray(_framework.get().to_numpy(v))
    digest = hashlib.blake2b(data.tobytes(), digest_size=8).digest()
    return np.frombuffer(digest, np.int64)[0]


def verify_identical(variables, tag):
    """Raises RuntimeError on every rank if any variable differs between
    ranks; the message names the first one that does.

    One allgather of a [1, len(variables)] fingerprint row per rank; a rank
    with a different number of variables fails the allgather by shape.
    """
    variables = list(variables)
    if not variables:
        return
    row = np.array([[_fingerprint(v) for v in variables]], np.int64)
    table = _host.host_allgather(
        row, name=f"kerasdist.verify.{tag}.{len(variables)}")
    for i, v in enumerate(variables):
        column = table[:, i]
        differs = np.nonzero(column != column[0])[0]
        if differs.size:
            raise RuntimeError(
                f"Variable '{variable_name(v)}' (shape "
                f"{tuple(v.shape)}) differs between rank 0 and rank "
                f"{int(differs[0])} ({tag}). Ranks must start from the same "
                "weights (BroadcastGlobalVariablesCallback) and apply the "
                "same averaged gradients (DistributedOptimizer).")
