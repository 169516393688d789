"""A sharded optimizer's slots in files: this rank's shards taken to host
memory and written (a Trainer checkpoint's shard files, an hvd.elastic
commit's), and read back at any size, each rank only the elements of its
own shard (`pieces`, `flat_range`), from shard files or a replicated
checkpoint's weight file. The Trainer (kerasdist/trainer/shards.py) and
elastic import this module directly."""

import os

import numpy as np

from kerasdist.keras.optimizer import shard_state
from kerasdist.keras.sharding.layout import flat_range
from kerasdist.keras.sharding.layout import owned
from kerasdist.keras.sharding.layout import pieces


def slot_variables(optimizer):
    """[(i, variable, j)] for each optimizer variable (index i in
    `optimizer.variables`) that holds only this rank's shard of model
    variable j; [] for a replicated optimizer."""
    state = shard_state(optimizer)
    if state is None:
        return []
    out = []
    for i, v in enumerate(optimizer.variables):
        j = state.slot_index(v)
        if j is not None:
            out.append((i, v, j))
    return out


def take_shard(optimizer):
    """This rank's shard of every slot, copied to host memory:
    {optimizer variable index: 1-D array}."""
    import keras
    import numpy as np

    return {i: np.array(keras.ops.convert_to_numpy(v), copy=True)
            for i, v, _ in slot_variables(optimizer)}


def write_shard_file(path, values, **attrs):
    """Writes a shard file (HDF5): one 1-D dataset a slot, named by its
    index in the optimizer's variables (`values`, from `take_shard`), and
    `attrs` (the write's token, rank, size). Not atomic: the caller
    writes a temporary file and renames it."""
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for i, value in values.items():
            if value.dtype.name == "bfloat16":
                f.create_dataset(str(i), data=value.view(np.uint16))
                f[str(i)].attrs["dtype"] = "bfloat16"
            else:
                f.create_dataset(str(i), data=value)


# ---- a sharded optimizer's saved slots, read at another size ----------


class ShardFiles:
    """The slots of a sharded checkpoint, read piece by piece from its
    shard files."""

    def __init__(self, directory, record):
        self.directory = directory
        self.record = record
        self.entries = {int(e["index"]): e for e in record["variables"]}
        self._open = {}

    def _file(self, k):
        import h5py
        f = self._open.get(k)
        if f is None:
            name = self.record["files"][k]["name"]
            path = os.path.join(self.directory, name)
            try:
                f = h5py.File(path, "r")
            except OSError as e:
                raise ValueError(
                    f"shard file {path} is unreadable: {e}") from None
            self._open[k] = f
        return f

    def read(self, i, lo, hi):
        """Elements [lo, hi) of optimizer variable i, flattened."""
        e = self.entries[i]
        return self.read_key(str(i), int(e["numel"]), int(e["chunk"]), lo,
                             hi)

    def read_key(self, key, numel, chunk, lo, hi):
        """Elements [lo, hi) of the saved variable of dataset `key`
        (`numel` elements, written in shards of `chunk`), flattened."""
        out = None
        for k, start, stop, at in pieces(numel, chunk, lo, hi):
            dataset = self._file(k)[key]
            part = _decode(dataset, np.asarray(dataset[start:stop]))
            if out is None:
                out = np.zeros(hi - lo, part.dtype)
            out[at:at + stop - start] = part
        return np.zeros(0) if out is None else out

    def close(self):
        for f in self._open.values():
            f.close()
        self._open = {}


class PlainFile:
    """The slots of a replicated checkpoint (a Keras weight file holding
    the whole optimizer state), read by slices."""

    def __init__(self, path):
        import h5py
        self._file = h5py.File(path, "r")
        self._vars = self._file["optimizer/vars"]

    def read(self, i, lo, hi):
        dataset = self._vars[str(i)]
        return _decode(dataset, flat_range(dataset, lo, hi))

    def close(self):
        self._file.close()


def _decode(dataset, values):
    if dataset.attrs.get("dtype") == "bfloat16":
        import ml_dtypes
        return np.asarray(values).view(ml_dtypes.bfloat16)
    return values


def load_slots(optimizer, source, numels):
    """Assigns each slot of `optimizer` from `source` (ShardFiles or
    PlainFile): a sharded optimizer's rank takes its own shard only, a
    replicated optimizer each slot whole. `numels`: {optimizer variable
    index: element count} of the checkpoint's slots."""
    state = shard_state(optimizer)
    if state is not None:
        layout, rank = state.layout, state.rank
        slots = slot_variables(optimizer)
        if sorted(i for i, _, _ in slots) != sorted(numels):
            raise ValueError(
                "the checkpoint's optimizer state is laid out for other "
                "variables than this optimizer's: another optimizer.")
        for i, v, j in slots:
            n, c = layout.numels[j], layout.chunks[j]
            _check_numel(v, numels[i], n)
            lo, hi = owned(n, c, rank)
            value = np.zeros(c, numpy_dtype(layout.dtypes[j]))
            value[:hi - lo] = source.read(i, lo, hi)
            v.assign(value)
        return
    variables = optimizer.variables
    for i, n in numels.items():
        v = variables[i]
        _check_numel(v, n, int(np.prod(v.shape)))
        v.assign(source.read(i, 0, n).reshape(tuple(v.shape)))


def numpy_dtype(name):
    """The numpy dtype of a layout's dtype name (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _check_numel(variable, saved, wanted):
    if saved != wanted:
        raise ValueError(
            f"the checkpoint's value of optimizer variable "
            f"{getattr(variable, 'path', variable.name)} has {saved} "
            f"elements, this one {wanted}: another model.")


def shard_index(optimizer):
    """The layout of a sharded optimizer's saved slots, for an index
    (a Trainer checkpoint's `optimizer_shards`, an hvd.elastic commit's
    `shards`; the writer adds the files): the number of ranks, and each
    slot's index in `optimizer.variables`, shape, element count and
    shard length."""
    layout = shard_state(optimizer).layout
    return {
        "format": 1,
        "size": int(layout.size),
        "optimizer_variables": len(optimizer.variables),
        "variables": [
            {"index": i, "path": str(getattr(v, "path", v.name)),
             "shape": list(layout.shapes[j]), "numel": layout.numels[j],
             "chunk": layout.chunks[j], "dtype": layout.dtypes[j]}
            for i, v, j in slot_variables(optimizer)],
    }


# ---- sharded weights (kerasdist.shard_weights): each rank's shard --------


def weight_shards(optimizer):
    """[(j, shard variable)] of the model's sharded weights an optimizer
    with shard="weights" updates (j: its index in the layout); [] for
    any other optimizer."""
    from kerasdist.keras.sharding import weights as _weights

    state = shard_state(optimizer)
    if state is None or not state.variables or \
            not _weights.is_shard(state.variables[0]):
        return []
    return list(enumerate(state.variables))


def take_weight_shards(optimizer):
    """This rank's shard of every sharded weight, copied to host memory:
    {"w<j>": 1-D array} (shard file datasets beside the slots')."""
    import keras

    return {f"w{j}": np.array(keras.ops.convert_to_numpy(v), copy=True)
            for j, v in weight_shards(optimizer)}


def weight_index(optimizer):
    """The manifest's `weights` entry of a shard="weights" checkpoint:
    each sharded weight's dataset key, path, shape, element count and
    shard length; [] for another optimizer."""
    from kerasdist.keras.sharding import weights as _weights

    layout = shard_state(optimizer).layout if weight_shards(optimizer) \
        else None
    return [
        {"key": f"w{j}", "path": _weights.info(v).path,
         "shape": list(layout.shapes[j]), "numel": layout.numels[j],
         "chunk": layout.chunks[j], "dtype": layout.dtypes[j]}
        for j, v in weight_shards(optimizer)]


def _check_weights(record, count):
    saved = record.get("weights") or []
    if len(saved) != count:
        raise ValueError(
            f"the checkpoint holds {len(saved)} sharded weights, this "
            f"model {count} trainable weights: another model.")
    return saved


def load_weight_shards(optimizer, source, record):
    """Every rank of a shard="weights" model: assigns each shard variable
    this rank's elements of the saved weight, read from `source`
    (ShardFiles) by pieces."""
    state = shard_state(optimizer)
    layout, rank = state.layout, state.rank
    pairs = weight_shards(optimizer)
    saved = _check_weights(record, len(pairs))
    for (j, v), e in zip(pairs, saved):
        n, c = layout.numels[j], layout.chunks[j]
        _check_numel(v, int(e["numel"]), n)
        lo, hi = owned(n, c, rank)
        value = np.zeros(c, numpy_dtype(layout.dtypes[j]))
        value[:hi - lo] = source.read_key(e["key"], int(e["numel"]),
                                          int(e["chunk"]), lo, hi)
        v.assign(value)


def load_whole_weights(variables, source, record):
    """A model whose weights are whole (replicated): assigns each of
    `variables` (its trainable weights, in order) the whole saved weight
    from the shard files of a shard="weights" checkpoint."""
    saved = _check_weights(record, len(variables))
    for v, e in zip(variables, saved):
        n = int(e["numel"])
        _check_numel(v, n, int(np.prod(v.shape)))
        v.assign(source.read_key(e["key"], n, int(e["chunk"]), 0, n)
                 .reshape(tuple(v.shape)))
