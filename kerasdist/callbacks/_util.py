"""Helpers shared by the callbacks (private)."""

import hashlib

import numpy as np

from kerasdist._core import host as _host
from kerasdist.keras import framework as _framework
from kerasdist.keras.sharding import optimizer as _sharding


def model_is_built(model):
    """True when every layer of `model` has created its variables."""
    layers = getattr(model, "_flatten_layers", None)
    if layers is None:
        return bool(model.built)
    return bool(model.built) and all(layer.built for layer in layers())


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
    variables = list(model.weights)
    if model.optimizer is not None:
        variables += _sharding.whole_variables(model.optimizer)
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
