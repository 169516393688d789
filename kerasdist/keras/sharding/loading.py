"""Loading sharded weights by slices: `model.load_weights(path)` of a model
whose weights `kerasdist.shard_weights` sharded, and
`kerasdist.load_model(path, shard="weights")`, read from the file (a
`.weights.h5`, or the weights inside a `.keras`) only each rank's slice of
every sharded weight and of every slot of a sharded optimizer: h5py reads
the rows of a dataset that hold the rank's elements [lo, hi)
(`layout.flat_range`), never the whole dataset. Unsharded variables
(BatchNormalization's moving averages, the optimizer's iterations) are
read whole, as Keras reads them.

Within `sliced(model)`, each layer holding sharded weights and the sharded
optimizer load through a store that hands, for a sharded weight, a
`Lazy` value (the h5py dataset, unread) in place of the numpy array
Keras' store reads; the weight's view (`WholeView.assign`) takes its own
piece of it (`Lazy.kerasdist_own_piece`).
"""

import contextlib

import numpy as np

from kerasdist.keras.sharding.layout import flat_range
from kerasdist.keras.sharding.layout import owned


class Lazy:
    """A saved whole value not read yet: an h5py dataset, read whole
    (`__array__`) or by the slice a rank owns (`kerasdist_own_piece`)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.shape = tuple(dataset.shape)
        self.size = int(np.prod(self.shape))
        self.ndim = len(self.shape)
        self._bfloat16 = dataset.attrs.get("dtype") == "bfloat16"
        self.dtype = _bfloat16() if self._bfloat16 else dataset.dtype

    def _decode(self, values):
        values = np.asarray(values)
        return values.astype(_bfloat16()) if self._bfloat16 else values

    def __array__(self, dtype=None, copy=None):
        out = self._decode(self.dataset[()])
        return out.astype(dtype) if dtype is not None else out

    def flat(self, lo, hi):
        """Elements [lo, hi) of the value flattened (only their rows
        read)."""
        return self._decode(flat_range(self.dataset, lo, hi))

    def kerasdist_own_piece(self, weight):
        """The shard (padded) of the sharded weight `weight` (a
        `WeightShard`) this rank owns, read by slice."""
        if self.size != weight.numel:
            raise ValueError(
                f"kerasdist: cannot assign a saved value of shape "
                f"{self.shape} to the sharded weight {weight.path} of "
                f"shape {weight.shape}.")
        lo, hi = owned(weight.numel, weight.chunk, weight.rank)
        values = self.flat(lo, hi)
        piece = np.zeros((weight.chunk,), values.dtype)
        piece[:hi - lo] = values
        return piece


class _InMemory:
    """A value another kind of store read whole."""

    def __init__(self, value):
        self._flat = value.reshape(-1)
        self.size = value.size

    def flat(self, lo, hi):
        return self._flat[lo:hi]


def _info(variable):
    """The `weights.WeightShard` of a shard or view (weights.info; this
    module is imported by weights.py)."""
    return getattr(variable, "_kerasdist_weight", None)


def _bfloat16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _dataset(store, key):
    """The h5py dataset `key` of a Keras H5 store's current entry, or None
    (another kind of store, or no such dataset)."""
    import h5py

    group = getattr(store, "_h5_entry_group", None)
    if not isinstance(group, h5py.Group) or key not in group:
        return None
    found = group[key]
    return found if isinstance(found, h5py.Dataset) else None


class _LayerStore:
    """A layer's Keras store that hands its sharded weights lazily."""

    def __init__(self, store, layer):
        self._store = store
        self._layer = layer

    def __getattr__(self, name):
        return getattr(self._store, name)

    def __len__(self):
        return len(self._store)

    def keys(self):
        return self._store.keys()

    def __contains__(self, key):
        return key in self._store

    def __getitem__(self, key):
        target = None
        variables = (list(self._layer._trainable_variables)
                     + list(self._layer._non_trainable_variables))
        if str(key).isdigit() and int(key) < len(variables):
            target = variables[int(key)]
        found = _info(target) if target is not None else None
        if found is not None and found.view is target:
            dataset = _dataset(self._store, key)
            if dataset is not None:
                return Lazy(dataset)
        return self._store[key]


def _layer_loader(layer):
    method = layer.load_own_variables

    def load_own_variables(store):
        return method(_LayerStore(store, layer))

    return load_own_variables


def _optimizer_loader(optimizer):
    method = optimizer.load_own_variables

    def load_own_variables(store):
        if len(store.keys()) != len(optimizer.variables):
            return method(store)  # Keras' warning: the state is skipped
        load_optimizer_slices(optimizer, store)

    return load_own_variables


def load_optimizer_slices(optimizer, store):
    """Assigns a sharded optimizer the plain optimizer's state saved in
    `store` (a Keras store of the plain layout): each slot takes this
    rank's shard, read by slice; the shared variables (iterations, learning
    rate) are read whole."""
    state = optimizer.kerasdist_shard_state
    layout = state.layout
    for i, v in enumerate(optimizer.variables):
        j = state.slot_index(v)
        if j is None:
            v.assign(np.asarray(store[str(i)]))
            continue
        dataset = _dataset(store, str(i))
        saved = (Lazy(dataset) if dataset is not None
                 else _InMemory(np.asarray(store[str(i)])))
        n, c = layout.numels[j], layout.chunks[j]
        if saved.size != n:
            raise ValueError(
                f"DistributedOptimizer(shard=...): the saved value of "
                f"{v.path} has {saved.size} elements, but its variable "
                f"has {n}: the file is of another model.")
        lo, hi = owned(n, c, state.rank)
        values = saved.flat(lo, hi)
        piece = np.zeros((c,), values.dtype)
        piece[:hi - lo] = values
        v.assign(piece)


def _sharded_optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None:
        if getattr(optimizer, "kerasdist_shard_state", None) is not None:
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


@contextlib.contextmanager
def sliced(model):
    """Within: Keras' loading of `model`'s weights (and of its sharded
    optimizer's state) reads each rank's slices of the sharded ones."""
    patched = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if any(_info(v) is not None and _info(v).shard is v
               for v in layer._trainable_variables):
            patched.append((layer, _layer_loader(layer)))
    optimizer = _sharded_optimizer(model)
    if optimizer is not None and optimizer.built:
        patched.append((optimizer, _optimizer_loader(optimizer)))
    # An instance's own load_own_variables (the Trainer's shared_only)
    # is wrapped, and put back after.
    before = [owner.__dict__.get("load_own_variables")
              for owner, _ in patched]
    for owner, loader in patched:
        object.__setattr__(owner, "load_own_variables", loader)
    try:
        yield
    finally:
        for (owner, _), old in zip(patched, before):
            if old is None:
                owner.__dict__.pop("load_own_variables", None)
            else:
                object.__setattr__(owner, "load_own_variables", old)


def install(model):
    """Makes `model.load_weights` (already seeing whole weights) load by
    slices; once a model."""
    if getattr(model, "_kerasdist_sliced_load", False):
        return
    method = model.load_weights

    def load_weights(*args, **kwargs):
        with sliced(model):
            return method(*args, **kwargs)

    load_weights.__doc__ = getattr(method, "__doc__", None)
    object.__setattr__(model, "load_weights", load_weights)
    object.__setattr__(model, "_kerasdist_sliced_load", True)
