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
(`kerasdist.keras.sharding.layout`'s `pieces` and `flat_range`, read
by `kerasdist.keras.sharding.files`); a replicated optimizer (on
rank 0, which then broadcasts) reads each slot whole.
"""

import contextlib
import os
import threading
import time

from kerasdist.keras import optimizer as _optimizer
from kerasdist.keras.sharding import files as _shard_files
from kerasdist.trainer import checkpoints

# How long rank 0 waits for the other ranks' shard files of one write.
WAIT_SECONDS = 600.0
_POLL = 0.02


def shard_name(stem, rank, size):
    """File name of rank `rank`'s shard file of the checkpoint `stem`
    ("epoch-000002") written by `size` ranks."""
    return f"{stem}.shard-{rank:05d}-of-{size:05d}.h5"


def write(path, values, token, rank, size):
    """Writes this rank's shard file atomically."""
    checkpoints.atomic_write(path, lambda tmp: _shard_files.write_shard_file(
        tmp, values, token=token, rank=rank, size=size))


def _token_of(path):
    import h5py
    try:
        with h5py.File(path, "r") as f:
            token = f.attrs.get("token")
    except OSError:
        return None
    return token.decode() if isinstance(token, bytes) else token


def collect(directory, stem, size, token, wait=WAIT_SECONDS, stop=None):
    """Rank 0: waits until every rank's shard file of the write `token` is
    in place; returns the manifest's list of files (name, bytes,
    sha256). `stop` (a threading.Event): once set, gives up at once (a
    rank was lost; its file may never come)."""
    files = []
    deadline = time.monotonic() + wait
    for r in range(size):
        name = shard_name(stem, r, size)
        path = os.path.join(directory, name)
        while _token_of(path) != token:
            if stop is not None and stop.is_set():
                raise checkpoints.CheckpointError(
                    f"the checkpoint was abandoned before rank {r}'s shard "
                    f"file {path} appeared; it is not committed.")
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
    skip = {id(v) for _, v, _ in _shard_files.slot_variables(optimizer)}
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

    def nothing(store):
        pass

    patched = [(optimizer, save_own_variables, load_own_variables)]
    inner = _optimizer.sharded_in(optimizer)
    if inner is not None and inner is not optimizer:
        # A LossScaleOptimizer around it (mixed_float16): Keras' walk
        # visits the inner optimizer too, whose variables are the
        # wrapper's already (above).
        patched.append((inner, nothing, nothing))
    for target, save, load in patched:
        target.save_own_variables = save
        target.load_own_variables = load
    try:
        yield
    finally:
        for target, _, _ in patched:
            del target.save_own_variables
            del target.load_own_variables


# ---- sharded weights (Trainer(shard="weights")) -------------------------


def _layer_variables(layer):
    return list(layer._trainable_variables) + \
        list(layer._non_trainable_variables)


def _has_sharded(layer, paths=()):
    from kerasdist.keras.sharding import weights as _weights

    return any(_weights.info(v) is not None or
               getattr(v, "path", None) in paths
               for v in layer._trainable_variables)


@contextlib.contextmanager
def unsharded_layers(model, record=None):
    """A context in which the layers holding sharded weights save (in a
    Keras weight file) only their other variables (moving averages...),
    under their index among the layer's variables: the shard files hold
    the sharded ones. Loading, those layers (and, with `record`, the
    manifest's `optimizer_shards` of a shard="weights" checkpoint, the
    layers whose weights it names, in a model whose weights are whole)
    assign only the variables the file holds."""
    from kerasdist.keras.sharding import weights as _weights

    paths = {e["path"] for e in (record or {}).get("weights") or ()}
    layers = [layer for layer in model._flatten_layers(include_self=True,
                                                       recursive=True)
              if _has_sharded(layer, paths)]

    def saver(layer):
        def save_own_variables(store):
            for i, v in enumerate(_layer_variables(layer)):
                if _weights.info(v) is None:
                    store[str(i)] = v
        return save_own_variables

    def loader(layer):
        def load_own_variables(store):
            variables = _layer_variables(layer)
            for key in store.keys():
                variables[int(key)].assign(store[key])
        return load_own_variables

    for layer in layers:
        object.__setattr__(layer, "save_own_variables", saver(layer))
        object.__setattr__(layer, "load_own_variables", loader(layer))
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("save_own_variables", None)
            layer.__dict__.pop("load_own_variables", None)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class ShardWriter:
    """One rank's part of writing a sharded optimizer's checkpoints: its
    shard file, and on rank 0 the weight file's optimizer entry (the
    shared variables, `weights_io`) and the manifest's index (`collect`).
    `nonce`: the same on every rank, new for each training run; with the
    checkpoint's name it makes the token that tells this write's files
    from those an earlier attempt left."""

    def __init__(self, optimizer, directory, nonce, model=None):
        state = _optimizer.shard_state(optimizer)
        self.optimizer = optimizer
        # shard="weights": the model's weight shards go into the shard
        # files too, and the weight file holds the layers' other
        # variables only.
        self.model = model if _shard_files.weight_shards(optimizer) \
            else None
        self.rank = state.rank
        self.size = state.layout.size
        self.directory = directory
        self.nonce = int(nonce)
        self.stop = threading.Event()  # set: `collect` gives up

    def abandon(self):
        """Rank 0's wait for the other ranks' files of the write in
        flight ends at once, the checkpoint not committed (a rank was
        lost: recovery in place)."""
        self.stop.set()

    def weights_io(self):
        if self.model is None:
            return shared_only(self.optimizer)
        return _both(shared_only(self.optimizer),
                     unsharded_layers(self.model))

    def take(self):
        values = _shard_files.take_shard(self.optimizer)
        values.update(_shard_files.take_weight_shards(self.optimizer))
        return values

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
        record = _shard_files.shard_index(self.optimizer)
        weights = _shard_files.weight_index(self.optimizer)
        if weights:
            record["weights"] = weights
        record["files"] = collect(self.directory, stem, self.size,
                                  self._token(stem), stop=self.stop)
        return record
