"""The Trainer's checkpoints of a sharded optimizer (private;
`Trainer(shard=...)`, `DistributedOptimizer(opt, shard=...)`).

A sharded optimizer's slots (moments, momentum...) exist only as each
rank's shard. A checkpoint of it is written in parallel and never
gathered: every rank writes its own shard file

    epoch-000002.shard-00001-of-00003.h5    rank 1's slots, one dataset
                                            per optimizer variable index

and rank 0 writes the weight file as for a replicated optimizer, except
that of the optimizer it holds only the variables every rank shares (the
step, the learning rate), then the manifest last. The manifest's
`optimizer_shards` (`index`) names the shard files with their size and
SHA-256, and the layout they were written in: the number of ranks, and
for each sharded optimizer variable its index, shape, element count and
shard length (`chunk`: rank k's file holds elements
[k * chunk, (k + 1) * chunk) of the variable flattened and zero-padded).

Every rank writes its file atomically (a temporary file renamed); rank 0
waits until each file of this write is in place (each file carries the
write's token, so a file left by an earlier attempt is never taken), then
hashes them and commits the manifest. A crash before the manifest leaves
the previous checkpoint the newest; `checkpoints.read_manifest` checks
every shard file named, so a damaged one makes the checkpoint be skipped
like a damaged weight file.

Loading re-partitions for the size and mode of the job reading it: each
rank of a sharded optimizer reads, from the files (or from a replicated
checkpoint's weight file), only the elements of its own shard
(`_sharding.pieces`, `_sharding.flat_range`); a replicated optimizer (on
rank 0, which then broadcasts) reads each slot whole.
"""

import contextlib
import os
import time

import numpy as np

from kerasdist import _sharding
from kerasdist.trainer import checkpoints

# How long rank 0 waits for the other ranks' shard files of one write.
WAIT_SECONDS = 600.0
_POLL = 0.02


def shard_name(stem, rank, size):
    """File name of rank `rank`'s shard file of the checkpoint `stem`
    ("epoch-000002") written by `size` ranks."""
    return f"{stem}.shard-{rank:05d}-of-{size:05d}.h5"


def slot_variables(optimizer):
    """[(i, variable, j)] for each optimizer variable (index i in
    `optimizer.variables`) that holds only this rank's shard of model
    variable j; [] for a replicated optimizer."""
    state = _sharding.shard_state(optimizer)
    if state is None:
        return []
    out = []
    for i, v in enumerate(optimizer.variables):
        j = state.slot_index(v)
        if j is not None:
            out.append((i, v, j))
    return out


def index(optimizer):
    """The layout part of a sharded checkpoint's `optimizer_shards`
    record (the files are added by rank 0 once written)."""
    layout = _sharding.shard_state(optimizer).layout
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


def take(optimizer):
    """This rank's shard of every slot, copied to host memory:
    {optimizer variable index: 1-D array}."""
    import keras

    return {i: np.array(keras.ops.convert_to_numpy(v), copy=True)
            for i, v, _ in slot_variables(optimizer)}


def write(path, values, token, rank, size):
    """Writes this rank's shard file atomically."""
    import h5py

    def put(tmp):
        with h5py.File(tmp, "w") as f:
            f.attrs["token"] = token
            f.attrs["rank"] = rank
            f.attrs["size"] = size
            for i, value in values.items():
                if value.dtype.name == "bfloat16":
                    f.create_dataset(str(i), data=value.view(np.uint16))
                    f[str(i)].attrs["dtype"] = "bfloat16"
                else:
                    f.create_dataset(str(i), data=value)

    checkpoints.atomic_write(path, put)


def _token_of(path):
    import h5py
    try:
        with h5py.File(path, "r") as f:
            token = f.attrs.get("token")
    except OSError:
        return None
    return token.decode() if isinstance(token, bytes) else token


def collect(directory, stem, size, token, wait=WAIT_SECONDS):
    """Rank 0: waits until every rank's shard file of the write `token` is
    in place; returns the manifest's list of files (name, bytes,
    sha256)."""
    files = []
    deadline = time.monotonic() + wait
    for r in range(size):
        name = shard_name(stem, r, size)
        path = os.path.join(directory, name)
        while _token_of(path) != token:
            if time.monotonic() > deadline:
                raise checkpoints.CheckpointError(
                    f"rank {r}'s shard file {path} of this checkpoint did "
                    f"not appear within {wait:.0f} s; the checkpoint is "
                    "not committed.")
            time.sleep(_POLL)
        files.append({"name": name, "bytes": os.path.getsize(path),
                      "sha256": checkpoints.file_sha256(path)})
    return files


# ---- the weight file: only the optimizer variables every rank shares ----


@contextlib.contextmanager
def shared_only(optimizer, record=None):
    """A context in which `optimizer` saves (in a Keras weight file) only
    the variables that are not slots of the sharded optimizer, under their
    index in `optimizer.variables`, and loads only those. `record`: the
    manifest's `optimizer_shards` of the checkpoint being loaded (its
    slots are skipped: the shard files hold them)."""
    skip = {id(v) for _, v, _ in slot_variables(optimizer)}
    if record is not None:
        skip = {int(e["index"]) for e in record["variables"]}
        keep = [i for i in range(len(optimizer.variables)) if i not in skip]
    else:
        keep = [i for i, v in enumerate(optimizer.variables)
                if id(v) not in skip]

    def save_own_variables(store):
        for i in keep:
            store[str(i)] = optimizer.variables[i]

    def load_own_variables(store):
        if record is not None and \
                len(optimizer.variables) != record["optimizer_variables"]:
            raise ValueError(
                f"the checkpoint's optimizer has "
                f"{record['optimizer_variables']} variables, this one "
                f"{len(optimizer.variables)}: it is another optimizer.")
        wanted = set(keep)
        for key in store.keys():
            if int(key) in wanted:
                optimizer.variables[int(key)].assign(store[key])

    optimizer.save_own_variables = save_own_variables
    optimizer.load_own_variables = load_own_variables
    try:
        yield
    finally:
        del optimizer.save_own_variables
        del optimizer.load_own_variables


# ---- reading slots ------------------------------------------------------


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
                raise checkpoints.CheckpointError(
                    f"checkpoint shard file {path} is unreadable: {e}"
                ) from None
            self._open[k] = f
        return f

    def read(self, i, lo, hi):
        """Elements [lo, hi) of optimizer variable i, flattened."""
        e = self.entries[i]
        out = None
        for k, start, stop, at in _sharding.pieces(int(e["numel"]),
                                                   int(e["chunk"]), lo, hi):
            dataset = self._file(k)[str(i)]
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
        return _decode(dataset, _sharding.flat_range(dataset, lo, hi))

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
    state = _sharding.shard_state(optimizer)
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
            lo, hi = _sharding.owned(n, c, rank)
            value = np.zeros(c, _numpy_dtype(layout.dtypes[j]))
            value[:hi - lo] = source.read(i, lo, hi)
            v.assign(value)
        return
    variables = optimizer.variables
    for i, n in numels.items():
        v = variables[i]
        _check_numel(v, n, int(np.prod(v.shape)))
        v.assign(source.read(i, 0, n).reshape(tuple(v.shape)))


def _numpy_dtype(name):
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


class ShardWriter:
    """One rank's part of writing a sharded optimizer's checkpoints: its
    shard file, and on rank 0 the weight file's optimizer entry (the
    shared variables, `weights_io`) and the manifest's index (`collect`).
    `nonce`: the same on every rank, new for each training run; with the
    checkpoint's name it makes the token that tells this write's files
    from those an earlier attempt left."""

    def __init__(self, optimizer, directory, nonce):
        state = _sharding.shard_state(optimizer)
        self.optimizer = optimizer
        self.rank = state.rank
        self.size = state.layout.size
        self.directory = directory
        self.nonce = int(nonce)

    def weights_io(self):
        return shared_only(self.optimizer)

    def take(self):
        return take(self.optimizer)

    def _token(self, stem):
        return f"{self.nonce}:{stem}"

    def write(self, epoch, samples, values):
        """Writes this rank's shard file of the checkpoint (epoch,
        samples) from `values` (`take()`)."""
        stem = checkpoints.stem(epoch, samples)
        os.makedirs(self.directory, exist_ok=True)
        write(os.path.join(self.directory,
                           shard_name(stem, self.rank, self.size)),
              values, self._token(stem), self.rank, self.size)

    def collect(self, stem):
        """Rank 0: the manifest's `optimizer_shards` once every file of
        the checkpoint `stem` is in place."""
        record = index(self.optimizer)
        record["files"] = collect(self.directory, stem, self.size,
                                  self._token(stem))
        return record
