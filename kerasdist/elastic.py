"""Horovod's elastic API (`hvd.elastic`) on kerasdist's restarts.

    import kerasdist as hvd
    hvd.init()
    ...
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=..., epochs=24 - state.epoch,
                        callbacks=[hvd.elastic.UpdateEpochStateCallback(state),
                                   hvd.elastic.UpdateBatchStateCallback(state),
                                   hvd.elastic.CommitStateCallback(state)])

    train(state)

Horovod keeps the committed state in memory and re-forms the workers in the
running processes. kerasdist restarts the processes instead (`kerasdist run
--max-restarts`, `--host-discovery-script`), so a commit also writes the
state to a file that the next attempt starts from:

* `state.commit()`: `save()` (a copy in memory, which `restore()` returns
  to), then rank 0 writes the committed state to
  `$KERASDIST_ELASTIC_DIR/state-N.pkl` (N: the state's number in creation
  order; written to a temporary file and renamed, so a crash never leaves a
  half-written one), then `check_host_updates()`. Without
  KERASDIST_ELASTIC_DIR (a job that is never restarted) nothing is written.
  A sharded optimizer's slots (`DistributedOptimizer(shard=...)` in a
  KerasState), and sharded weights, are never gathered: each rank writes
  its shard to a file of its own beside the commit, which names them
  (`_ShardCommits`), and a restart at another size reads each rank's
  part of them. A replicated
  optimizer's commit resumes a sharded one: rank 0 broadcasts each slot
  whole and every rank keeps its shard.
* `run(func)` (the `@hvd.elastic.run` decorator): rank 0 loads the last
  committed state if there is one (a restarted attempt); if it was
  committed at another number of ranks, the reset callbacks run
  (`register_reset_callbacks`, as after Horovod's reset events); then
  `state.sync()` gives every rank rank 0's state, and `func(state)` runs.
* `check_host_updates()` raises `HostsUpdatedInterrupt` on every rank at the
  same call once the launcher asked any rank to stop for a resize (its
  SIGUSR1, kerasdist/_core/resize.py). `run` then commits the state as it is and
  ends the process with the resize exit code: the launcher relaunches at
  the new size and the next attempt starts from that commit. With
  recovery in place, a job that grows (the launcher wrote a grow request)
  grows in place instead: the ranks start the new ones, run the reset
  callbacks and sync the state to them, and go on
  (kerasdist/_core/grow.py); a sharded optimizer's commit is laid out
  over the grown job first, the new ranks receiving their shards from
  the old ranks' (`_ShardCommits.grow`); one that shrinks (a shrink
  request naming the ranks that leave) shrinks in place: at that commit
  the leavers exit with 0 and the others split off, run the reset
  callbacks and go on (kerasdist/_core/shrink.py).
* `HorovodInternalError` (a collective failed) ends the process with an
  error: the launcher's `--max-restarts` relaunches the job, which resumes
  from the last commit. A peer that dies ends the other ranks by itself
  (the heartbeat, exit code 75), to the same effect.
* `RanksLostError` (a rank was lost in a job started with `kerasdist run
  --recover-in-place`, on Open MPI's ULFM): the survivors keep their
  processes. `run` restores the last commit from memory, starts the
  runtime again on the survivors (`kd.size()` is the new size), runs the
  reset callbacks, syncs, and calls `func(state)` again, as Horovod does
  (docs/failures-and-elastic.md, "Recovery in place"). A sharded
  optimizer's shards (and with `kd.shard_weights`, shard="weights", the
  model's weight shards) are committed with a copy on a buddy rank
  (kerasdist/keras/sharding/buddies.py): the survivors re-partition them
  over the new size in memory (`_ShardCommits.restore`), or end with one
  line where a rank and its buddy were both lost.

Whatever was trained after the last commit is trained again after a
restart. The data's position is not part of the state (as in Horovod, where
`fit` starts a new iterator after a reset); `UpdateBatchStateCallback`
shortens the first epoch after a resume by the batches already done.

`model.fit` that recovers in place, exactly at any size
(kerasdist/keras/elastic_fit.py, re-exported here): `ElasticBatches` (a
Keras PyDataset: each epoch's examples in one order for the whole job, shared
out at the current size from the committed position) and one callback,
`CommitCallback(state, data, batches_per_commit=K)`, which keeps
`state.epoch` and `state.batch` (the job's batches, all ranks together),
commits every K steps and at each epoch's end, and has Keras trace fit's
step again at a new size:

    data = hvd.elastic.ElasticBatches((x, y), batch_size=32, shuffle=True)
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, epochs=24 - state.epoch, shuffle=False,
                        callbacks=[hvd.elastic.CommitCallback(state, data)])

Over 500 lines: it is Horovod's `hvd.elastic` whole (the state classes, `run`,
the callbacks and the commits a restart resumes from), where a Horovod user
looks for it; files are written through `kerasdist/_core/files.py`.
"""

import base64
import functools
import io
import json
import os
import sys
import tempfile
import time
import zipfile

import numpy as np

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import errors as _errors
from kerasdist._core import files as _files
from kerasdist._core import grow as _grow
from kerasdist._core import resize as _resize
from kerasdist._core import shrink as _shrink
from kerasdist.keras import optimizer as _optimizer
from kerasdist.keras.sharding import buddies as _buddies
from kerasdist.keras.sharding import files as _shard_files
from kerasdist.keras.sharding import step as _shard_step

ELASTIC_DIR_ENV = "KERASDIST_ELASTIC_DIR"
_FORMAT = 2


# -- the committed state on disk: data, never code -------------------------
#
# A commit is an .npz file (numpy's zip of .npy arrays, read back with
# allow_pickle=False): "header" holds JSON of the record, in which every
# container is tagged ({"d": [[key, value], ...]}, {"l": [...]},
# {"t": [...]}) and every array or numpy scalar is a reference ({"a": i}
# to the array "a<i>", {"s": i} to a 0-d one read back as a scalar); bytes
# are {"b": base64}. A file that is not that (a planted pickle, a torn
# write) is refused, never executed.

def _encode(obj, arrays):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        if isinstance(obj, int) and not isinstance(obj, bool) and (
                abs(obj) >= 1 << 63):
            return {"i": str(obj)}
        return obj
    if isinstance(obj, (np.ndarray, np.generic)):
        array = np.asarray(obj)
        if array.dtype.hasobject:
            raise TypeError(f"a numpy array of Python objects (dtype "
                            f"{array.dtype})")
        arrays.append(array)
        return {"s" if isinstance(obj, np.generic) else "a": len(arrays) - 1}
    if isinstance(obj, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, arrays), _encode(v, arrays)]
                      for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_encode(v, arrays) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_encode(v, arrays) for v in obj]}
    raise TypeError(f"a value of type {type(obj).__name__}")


def _decode(obj, arrays):
    if not isinstance(obj, dict):
        return obj
    (tag, value), = obj.items()
    if tag == "a":
        return arrays[f"a{int(value)}"]
    if tag == "s":
        return arrays[f"a{int(value)}"][()]
    if tag == "i":
        return int(value)
    if tag == "b":
        return base64.b64decode(value)
    if tag == "d":
        return {_hashable(_decode(k, arrays)): _decode(v, arrays)
                for k, v in value}
    if tag == "l":
        return [_decode(v, arrays) for v in value]
    if tag == "t":
        return tuple(_decode(v, arrays) for v in value)
    raise ValueError(f"unknown tag {tag!r}")


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


def _write_record(path, record):
    """Writes `record` (numbers, strings, bytes, lists, tuples, dicts, numpy
    arrays) to `path` atomically; the commit that was there stays as
    `path`.prev, the fallback of a commit that cannot be read."""
    arrays = []
    try:
        header = json.dumps(_encode(record, arrays))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"kerasdist.elastic: cannot write the committed state: it holds "
            f"{e}. Keep only numbers, strings, bytes, lists, tuples, dicts "
            f"and numpy arrays in the state's keyword arguments.") from None
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-state-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            named = {f"a{i}": a for i, a in enumerate(arrays)}
            named["header"] = np.frombuffer(header.encode(), dtype=np.uint8)
            np.savez(f, **named)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.replace(path, path + ".prev")
        os.replace(tmp, path)
    except BaseException:
        _files.discard(tmp)
        raise


def _check_sizes(path):
    """ValueError unless every member of the commit at `path` is as
    _write_record writes it (np.savez: uncompressed), within the file, and
    holds the array its .npy header declares: nothing is inflated or
    allocated from a size the file only claims (a planted 3 MB commit of
    one deflated 3 GiB member once cost 3.1 GB before it was refused)."""
    size = os.path.getsize(path)
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or \
                    info.file_size != info.compress_size or \
                    info.file_size > size:
                raise ValueError(
                    f"member {info.filename!r} declares {info.file_size} "
                    f"bytes, {info.compress_size} stored, in a file of "
                    f"{size}: not a commit kerasdist wrote (they are "
                    f"uncompressed)")
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                shape, _, dtype = (
                    np.lib.format.read_array_header_1_0(f)
                    if version == (1, 0) else
                    np.lib.format.read_array_header_2_0(f))
                declared = dtype.itemsize
                for n in shape:
                    declared *= n
                if declared > info.file_size:
                    raise ValueError(
                        f"member {info.filename!r} declares an array of "
                        f"{declared} bytes in {info.file_size}")


def _read_record(path):
    """The record in `path`; ValueError when it is not one (never runs
    anything in the file: no pickle), before anything is inflated or
    allocated from the sizes the file declares."""
    try:
        _check_sizes(path)
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        header = arrays.pop("header").tobytes().decode()
        record = _decode(json.loads(header), arrays)
    except (OSError, ValueError, KeyError, TypeError, EOFError,
            zipfile.BadZipFile, UnicodeDecodeError, AttributeError,
            IndexError, RecursionError, io.UnsupportedOperation) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise ValueError("not a committed state this version wrote")
    return record


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name). Under `run` the process ends
    with an error and the launcher's `--max-restarts` relaunches the job
    from the last commit."""


# A rank was lost and the survivors re-form in place (kerasdist/_core/capi.py).
RanksLostError = _capi.RanksLostError


class HostsUpdatedInterrupt(RuntimeError):
    """The launcher asked the job to resize (raised by
    `State.check_host_updates()` on every rank at the same call)."""

    def __init__(self, skip_sync=False):
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


def _log(text):
    # On stderr: rank 0's stdout may be in the middle of Keras' progress
    # bar, which a line there would be glued onto; the launcher ends the
    # bar's line before another stream's line.
    print(f"kerasdist.elastic: {text}", file=sys.stderr, flush=True)


def _directory():
    return os.environ.get(ELASTIC_DIR_ENV) or None


def _to_numpy(variable):
    if hasattr(variable, "numpy"):
        return np.array(variable.numpy())
    import keras
    return np.array(keras.ops.convert_to_numpy(variable))


def _broadcast_arrays(arrays, name):
    """Rank 0's arrays on every rank (same shapes and dtypes everywhere),
    one broadcast per dtype."""
    if basics.size() == 1 or not arrays:
        return [np.array(a) for a in arrays]
    from kerasdist._core import host as _host
    out = [None] * len(arrays)
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(np.dtype(a.dtype).str, []).append(i)
    for key in sorted(by_dtype):
        idx = by_dtype[key]
        flat = np.concatenate([np.ravel(arrays[i]) for i in idx]) \
            if idx else np.zeros(0)
        got = _host.host_broadcast(flat, 0, f"kerasdist.elastic.sync.{key}")
        at = 0
        for i in idx:
            n = int(np.prod(arrays[i].shape, dtype=np.int64))
            out[i] = np.array(got[at:at + n]).reshape(arrays[i].shape)
            at += n
    return out


def _broadcast_object(obj):
    if basics.size() == 1:
        return obj
    from kerasdist.objects import broadcast_object
    return broadcast_object(obj, 0, name="kerasdist.elastic.object")


def _rank():
    return basics.rank()


class State:
    """State kept across the job's restarts (Horovod's
    `horovod.common.elastic.State`).

    Args:
        bcast_object: function broadcasting a Python object from rank 0
            (default: kerasdist's broadcast_object).
        get_rank: function returning this rank (default: kerasdist.rank).
    """

    _count = 0

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or _broadcast_object
        self._rank = get_rank or _rank
        self._reset_callbacks = []
        self._number = State._count
        State._count += 1

    def register_reset_callbacks(self, callbacks):
        """Functions to call after a reset: in kerasdist, when a restarted
        attempt resumes from a commit made at another number of ranks
        (e.g. to scale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Horovod's notification hook; kerasdist's resize requests come
        from the launcher's signal instead, so this does nothing."""

    def commit(self):
        """save(), then rank 0 writes the committed state where the next
        attempt of the job starts from (KERASDIST_ELASTIC_DIR), then
        check_host_updates()."""
        self.save()
        self.persist()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank once the launcher
        asked any rank to stop for a resize; the ranks agree on it in one
        small allreduce (only in a job that grows and shrinks)."""
        if not _resize.checking() and not _grow.joinable():
            return
        # With recovery in place a request to grow starts the new ranks in
        # the background, and the commit after they joined raises
        # (kerasdist/_core/grow.py); over TCP, processes waiting to join
        # are a request too.
        flag = np.array([1 if _resize.requested() else 0,
                         1 if _grow.spawning() else 0,
                         1 if not _grow.started() and _grow.waiting()
                         else 0], np.int64)
        if basics.size() > 1:
            from kerasdist._core import host as _host
            flag = _host.host_allreduce(flag, basics.Max,
                                        "kerasdist.elastic.hosts")
        if _grow.started():
            if not int(flag[1]):
                raise HostsUpdatedInterrupt(False)
            return
        if not int(flag[0]) and not int(flag[2]):
            return
        # The launcher's request in place, if any (rank 0 reads it, every
        # rank gets it): a shrink ends the function at this commit, a grow
        # starts the new ranks in the background; without one the job
        # stops for a relaunch. Processes waiting to join (over TCP) that
        # went meanwhile: nothing to do.
        body = _grow.request()
        if not int(flag[0]) and not _grow.is_request(body):
            return
        if _shrink.take(body):
            raise HostsUpdatedInterrupt(False)
        if _grow.is_request(body):
            why = self._cannot_grow()
            if why:
                # A relaunch at the new size from this commit (its files).
                if _rank() == 0:
                    _log(f"cannot grow in place: {why}; relaunching at "
                         f"the new size from this commit")
                raise HostsUpdatedInterrupt(False)
        if not _grow.begin(body):
            raise HostsUpdatedInterrupt(False)

    def _cannot_grow(self):
        """Why this state cannot grow in place (one phrase, the same on
        every rank), or None: KerasState's sharded optimizer laid out
        over other ranks than the job's."""
        return None

    def save(self):
        """Saves the state in memory."""
        raise NotImplementedError()

    def restore(self):
        """Returns to the last saved state, undoing what changed since."""
        raise NotImplementedError()

    def sync(self):
        """Gives every rank rank 0's state."""
        raise NotImplementedError()

    def reset(self):
        """Called after a reset, before the reset callbacks."""

    # -- kerasdist: the committed state on disk -------------------------

    def _saved(self):
        """The saved state as a picklable dict (subclasses add to it)."""
        return {}

    def _load_saved(self, saved):
        """Takes a dict of _saved()'s as the saved state."""

    def _check_record(self, record, directory):
        """Rank 0, before taking a commit: raises ValueError if what it
        names besides itself (a sharded optimizer's shard files) is not
        intact, so that the commit before it is taken instead."""

    def _load_parts(self, committed):
        """Every rank, once rank 0 has taken a commit (`committed`: the
        ranks it was made at, the same on every rank): loads what each
        rank reads for itself (its shard of a sharded optimizer)."""

    @property
    def path(self):
        """The file rank 0 writes the committed state to, or None (no
        KERASDIST_ELASTIC_DIR)."""
        directory = _directory()
        if directory is None:
            return None
        return os.path.join(directory, f"state-{self._number}.npz")

    def persist(self):
        """Rank 0 writes the saved state to `path`, atomically, keeping the
        commit before as the fallback."""
        path = self.path
        if path is None or self._rank() != 0:
            return
        _write_record(path, {"format": _FORMAT, "size": basics.size(),
                             "saved": self._saved()})
        _resize.report_progress()

    def load_committed(self):
        """Rank 0: takes the committed state in `path` as the saved state
        and restores it. Returns the number of ranks it was committed at,
        or None when there is none. A commit that cannot be read (a write
        torn by a crash, a file that is not one) gives way to the commit
        before it, with a line saying so."""
        path = self.path
        if path is None:
            return None
        errors = []
        for candidate in (path, path + ".prev"):
            if not os.path.exists(candidate):
                continue
            try:
                record = _read_record(candidate)
                self._check_record(record, os.path.dirname(candidate))
            except ValueError as e:
                errors.append(f"{candidate}: {e}")
                continue
            if errors:
                _log(f"the last commit cannot be read ({errors[0]}); "
                     f"resuming from the one before it")
            self._load_saved(record["saved"])
            self.restore()
            return int(record["size"])
        if errors:
            raise ValueError(f"kerasdist.elastic: no commit can be read: "
                             f"{'; '.join(errors)}; remove them to start "
                             f"afresh.")
        return None


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as
    attributes (Horovod's ObjectState)."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: getattr(self, attr)
                             for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _saved(self):
        out = super()._saved()
        out["objects"] = dict(self._saved_state)
        return out

    def _load_saved(self, saved):
        super()._load_saved(saved)
        objects = saved.get("objects", {})
        missing = sorted(set(self._saved_state) - set(objects))
        if missing:
            raise ValueError(f"kerasdist.elastic: the committed state has no "
                             f"{', '.join(missing)}: it was written by a "
                             f"state with other attributes.")
        self._saved_state = {k: objects[k] for k in self._saved_state}


class _VariablesState(ObjectState):
    """ObjectState plus a list of variables (their values in memory)."""

    def __init__(self, **kwargs):
        self._values = [_to_numpy(v) for v in self._variables()]
        super().__init__(**kwargs)

    def _variables(self):
        raise NotImplementedError()

    def save(self):
        self._values = [_to_numpy(v) for v in self._variables()]
        super().save()

    def restore(self):
        for var, value in zip(self._variables(), self._values):
            var.assign(value)
        super().restore()

    def sync(self):
        variables = self._variables()
        values = _broadcast_arrays([_to_numpy(v) for v in variables],
                                   f"state{self._number}")
        for var, value in zip(variables, values):
            var.assign(value)
        self._values = values
        super().sync()

    def _saved(self):
        out = super()._saved()
        out["values"] = list(self._values)
        return out

    def _load_saved(self, saved):
        values = saved.get("values", [])
        variables = self._variables()
        shapes = [tuple(np.shape(v)) for v in self._values]
        got = [tuple(np.shape(v)) for v in values]
        if len(values) != len(variables) or shapes != got:
            raise ValueError(
                f"kerasdist.elastic: the committed state holds "
                f"{len(values)} variable(s) of shapes {got[:4]}..., the "
                f"state now {len(variables)} of shapes {shapes[:4]}...: "
                f"the model changed. Remove {self.path} to start afresh.")
        self._values = [np.array(v) for v in values]
        super()._load_saved(saved)


class TensorFlowState(_VariablesState):
    """State of a list of variables plus keyword attributes (Horovod's
    TensorFlowState). `variables` defaults to TF1's global variables;
    `session` is accepted and ignored (TF2 runs eagerly)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            import tensorflow as tf
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        self.session = session
        super().__init__(**kwargs)

    def _variables(self):
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """State of a Keras model and its optimizer (weights, optimizer
    variables, the dropout layers' seed states) plus keyword attributes
    (Horovod's TensorFlowKerasState). The model must be built, and the
    optimizer's variables created (one `fit` step, or `optimizer.build`).
    `backend` is accepted and ignored."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run "
                             "`model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        # A sharded optimizer's slots (shard=...), and with shard="weights"
        # the model's weight shards: this rank's shard, kept and committed
        # by each rank itself (_ShardCommits).
        self._shards = _ShardCommits(self.optimizer, model)
        super().__init__(**kwargs)

    def _cannot_grow(self):
        # A sharded optimizer grows in place with the job (its shards laid
        # out again at the new size, `_ShardCommits.grow`) only where it
        # is laid out over the whole job (not a process set).
        if self._shards.sharded() and _buddies.resized(self.optimizer):
            return ("the sharded optimizer (shard=) is laid out over "
                    f"{_optimizer.shard_state(self.optimizer).layout.size} "
                    f"of the job's {basics.size()} ranks")
        return None

    def _variables(self):
        # Not the shards of sharded weights (kerasdist.shard_weights):
        # each rank holds its own, which _ShardCommits keeps.
        variables = _optimizer.replicated(self.model.variables)
        if self.optimizer is not None:
            seen = {id(v) for v in variables}
            variables += [v for v in _optimizer.whole_variables(
                self.optimizer) if id(v) not in seen]
        return variables

    def save(self):
        self._shards.save()
        super().save()

    def restore(self):
        self._shards.restore()
        super().restore()

    def sync(self):
        # After a grow in place: the commit's shards laid out over the
        # grown job first (the old ranks' optimizer is built again at the
        # new size), then the variables every rank shares by broadcast.
        self._shards.grow()
        super().sync()
        self._shards.protect()

    def persist(self):
        """Without a sharded optimizer, State.persist. With one, every
        rank writes its shard of the slots to a file of its own beside
        `path`, and rank 0 then writes the commit naming them (their
        layout, sizes and SHA-256) as `path`: no rank gathers the slots."""
        path = self.path
        if path is None or not self._shards.sharded():
            return super().persist()
        files, index = self._shards.write(path, self._number)
        if self._rank() != 0:
            return
        _write_record(path, {"format": _FORMAT, "size": basics.size(),
                             "saved": self._saved(),
                             "shards": dict(index, files=files)})
        self._shards.remove_unused(path, self._number)
        _resize.report_progress()

    def _check_record(self, record, directory):
        self._shards.check(record.get("shards"), directory)

    def _load_saved(self, saved):
        # A commit of a sharded optimizer holds only the variables every
        # rank shares; a replicated state takes its slots from the shard
        # files (_load_parts) and keeps its own values for them here.
        # A commit of a replicated optimizer holds its slots whole; a
        # sharded state notes them (rank 0) for _load_parts to give each
        # rank its shard of.
        record = self._shards.pending
        if record is not None and not self._shards.sharded():
            saved = dict(saved, values=self._with_slots(saved["values"],
                                                        record))
        elif record is None and self._shards.sharded():
            saved = dict(saved, values=self._without_slots(saved["values"]))
        super()._load_saved(saved)

    def _with_slots(self, values, record):
        slots = {int(e["index"]) for e in record["variables"]}
        model = len(self.model.variables)
        shared = iter(values[model:])
        out = list(values[:model])
        seen = {id(v) for v in self.model.variables}
        for i, v in enumerate(self.optimizer.variables):
            if id(v) in seen:
                continue
            out.append(_to_numpy(v) if i in slots else next(shared))
        return out

    def _without_slots(self, values):
        # `values`: the model's variables, then the replicated optimizer's
        # (as _variables() lists them); the slots' whole values go to
        # self._shards.whole, the rest stay (their shapes are checked
        # by _VariablesState._load_saved).
        model = len(self.model.variables)
        seen = {id(v) for v in self.model.variables}
        mine = [i for i, v in enumerate(self.optimizer.variables)
                if id(v) not in seen]
        if len(values) != model + len(mine):
            return values  # another model: _load_saved says so
        state = _optimizer.shard_state(self.optimizer)
        slots = {i: j for i, _, j in
                 _shard_files.slot_variables(self.optimizer)}
        out, whole = list(values[:model]), {}
        for i, value in zip(mine, values[model:]):
            if i not in slots:
                out.append(value)
                continue
            value = np.asarray(value)
            if value.size != state.layout.numels[slots[i]]:
                raise ValueError(
                    f"kerasdist.elastic: the committed optimizer variable "
                    f"{i} has {value.size} elements, this optimizer's "
                    f"{state.layout.numels[slots[i]]}: the model changed. "
                    f"Remove {self.path} to start afresh.")
            whole[i] = value
        self._shards.whole = whole
        return out

    def _load_parts(self, committed):
        self._shards.load(self._bcast_object(self._shards.pending),
                          os.path.dirname(self.path))
        if self._shards.sharded() and \
                self._bcast_object(self._shards.whole is not None):
            self._shards.load_whole()


class KerasState(TensorFlowKerasState):
    """Horovod's `horovod.tensorflow.keras.elastic.KerasState`."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


def _resume(state):
    """A restarted attempt's start: rank 0 loads the last commit, the reset
    callbacks run if it was made at another size, every rank syncs."""
    committed = state.load_committed() if _rank() == 0 else None
    committed = _broadcast_object(committed)
    if committed is not None:
        state._load_parts(committed)
        if _rank() == 0:
            where = ", ".join(f"{k}={getattr(state, k)!r}" for k in
                              ("epoch", "batch") if hasattr(state, k))
            _log(f"resuming from the last commit ({state.path}"
                 + (f"; {where}" if where else "") + f"), committed at "
                 f"{committed} rank(s), now {basics.size()}")
        if committed != basics.size():
            state.on_reset()
    state.sync()


def _internal_error(e):
    """Whether `e` is a HorovodInternalError, or a TensorFlow error of a
    kerasdist op that the runtime failed (Horovod's TF `run` takes
    UnknownError of its ops as one)."""
    if isinstance(e, HorovodInternalError):
        return True
    # TensorFlow's error classes, known by name: nothing to import where
    # TensorFlow is not the backend.
    tf_error = any(c.__module__.startswith("tensorflow")
                   and c.__name__ in ("UnknownError", "AbortedError",
                                      "InternalError")
                   for c in type(e).__mro__)
    return tf_error and "Kerasdist" in str(e)


def _ranks_lost(e):
    """Whether `e` says a rank was lost and the survivors re-form in place
    (RanksLostError, or a TensorFlow error of a kerasdist op, or XLA's
    error of a kerasdist FFI call inside `jax.jit`, that says so)."""
    xla_error = any(c.__module__.split(".")[0] in ("jax", "jaxlib")
                    for c in type(e).__mro__)
    return isinstance(e, RanksLostError) or (
        (_internal_error(e) or xla_error) and
        _capi.RANKS_LOST_TEXT in str(e))


def recover_in_place(error, restore, who="kerasdist.elastic"):
    """After a lost rank (`error`): the runtime has re-formed the job among
    the survivors; this rank starts it again there (new `size()` and
    `rank()`) and calls `restore()` to go back to the last commit in
    memory. A failure on the way (another rank lost meanwhile), or a rank
    lost while the job grows in place, ends the rank with one line,
    `who: recovery in place failed: ...`: a relaunch resumes from the
    last commit on disk. Rank 0 says in one line that the
    job re-formed. Used by `run` and by kerasdist.Trainer."""
    was, began = basics.size(), time.monotonic()
    if _grow.started():
        # The new ranks' start (MPI_Comm_spawn, then the merge) is a
        # collective of the job as it was, the lost rank included, and
        # so is the re-form that lets them in: neither would ever end.
        _grow.end_rank(f"{who}: recovery in place failed", RuntimeError(
            f"{error}; lost while the job was growing in place, which "
            f"needs every rank of the job until the new ones have "
            f"joined"))
    # shutdown() returns once the survivors have re-formed.
    _grow.restart_or_end(restore, f"{who}: recovery in place failed")
    if _rank() == 0:
        why = (str(error).strip().splitlines() or ["a rank was lost"])[0]
        print(f"{who}: {why}; re-formed in place at {basics.size()} "
              f"rank(s) (was {was}) in {time.monotonic() - began:.2f} s, "
              f"resuming from the last commit", file=sys.stderr, flush=True)


def _recover_in_place(state, error):
    """`run`'s recovery: the last commit restored, the reset callbacks
    run, rank 0's state synced (Horovod's reset)."""
    def restore():
        state.restore()
        state.on_reset()
        state.sync()

    recover_in_place(error, restore)


def run(func):
    """Runs `func(state, ...)` from the job's last commit (Horovod's
    `hvd.elastic.run` decorator; see the module's doc for how kerasdist
    maps it onto restarts and onto recovery in place)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not basics.is_initialized():
            basics.init()
        if _resize.checking():
            _resize.announce(_rank(), grows_in_place=True)
        if _grow.joined():  # a new rank of a job that grew in place
            state.sync()
        else:
            _resume(state)
        while True:
            try:
                result = _run_once(func, state, *args, **kwargs)
            except RanksLostError as e:
                _recover_in_place(state, e)
                continue
            except _GrowInPlace:
                _grow.finish(state, _log)
                continue
            except _ShrinkInPlace:
                # Those that leave end here (SystemExit(0)).
                _shrink.finish(state, _log)
                continue
            if _grow.started():  # the new ranks join a job that is done
                _grow.finish(state, _log)
            return result

    return wrapper


class _GrowInPlace(Exception):
    """The new ranks have joined (kerasdist/_core/grow.py): at this commit
    every rank starts the runtime on the grown job."""


class _ShrinkInPlace(Exception):
    """The ranks agreed to shrink in place (kerasdist/_core/shrink.py): at
    this commit those that leave end, and the others start the runtime on
    the job without them."""


def _run_once(func, state, *args, **kwargs):
    """`func(state, ...)` once, as `run` handles its ends but a lost rank
    with recovery in place (raised as RanksLostError for `run` to take)."""
    try:
        return func(state, *args, **kwargs)
    except HostsUpdatedInterrupt:
        if _grow.started():
            raise _GrowInPlace() from None
        if not _resize.checking():
            raise
        if _shrink.pending():
            raise _ShrinkInPlace() from None
        state.save()
        state.persist()
        if basics.size() > 1:
            from kerasdist._core import host as _host
            _host.host_barrier("kerasdist.elastic.resize")
        if _rank() == 0:
            _log("stopping to resize: the launcher asked, the state is "
                 "committed")
        raise _resize.Resize() from None
    except Exception as e:
        if _ranks_lost(e):
            # A framework's error (TensorFlow's "Graph execution error:"
            # first; Keras' "Exception encountered when calling
            # Dense.call()." around a sharded weight's gather): the line
            # that says what happened.
            said = _errors.ranks_lost_line(e)
            if isinstance(e, RanksLostError) and str(e) == said:
                raise
            raise RanksLostError(said) from e
        if not _internal_error(e) or _directory() is None:
            raise
        why = str(e).strip().splitlines()[0] if str(e).strip() else \
            "a collective failed"
        print(f"kerasdist.elastic: rank {_rank()}: {why}; ending this "
              f"rank (a restart resumes from the last commit).",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _keras_callback():
    import keras
    return keras.callbacks.Callback


class _EndOfEpoch:
    """model.stop_training while an epoch is cut short (truthy: Keras ends
    the epoch; reset to False at its end, so training goes on)."""

    def __bool__(self):
        return True


_END_OF_EPOCH = _EndOfEpoch()


def _callbacks():
    Callback = _keras_callback()

    class CommitStateCallback(Callback):
        """Commits `state` every `batches_per_commit` batches and at every
        epoch end (Horovod's CommitStateCallback)."""

        def __init__(self, state, batches_per_commit=1):
            super().__init__()
            self.state = state
            self.batches_per_commit = batches_per_commit
            self.batches_remaining = batches_per_commit

        def on_train_begin(self, logs=None):
            self.batches_remaining = self.batches_per_commit

        def on_batch_end(self, batch, logs=None):
            self.batches_remaining -= 1
            if self.batches_remaining == 0:
                if not self._epoch_ends(batch):
                    self.commit()
                self.batches_remaining = self.batches_per_commit

        def _epoch_ends(self, batch):
            # The epoch's last batch: its end commits next, with nothing
            # trained in between. Committing here too would leave a state
            # (all batches done, the epoch not) that a resume cannot cut
            # to an epoch of no batches.
            steps = self.params.get("steps") if self.params else None
            return (steps is not None and batch + 1 >= steps) or \
                self.model.stop_training is _END_OF_EPOCH

        def on_epoch_end(self, epoch, logs=None):
            self.commit()

        def commit(self):
            self.state.commit()

    class UpdateBatchStateCallback(Callback):
        """Keeps `state.batch` = the batches done in the current epoch (0
        at its start and end), and cuts the first epoch after a resume
        short by `state.batch` batches (Horovod's UpdateBatchStateCallback,
        which keeps the last batch's index instead)."""

        def __init__(self, state):
            super().__init__()
            self.state = state
            self._first = True
            self._steps = None
            self._offset = 0

        def on_train_begin(self, logs=None):
            self._first = True

        def on_epoch_begin(self, epoch, logs=None):
            self._steps, self._offset = None, 0
            steps = self.params.get("steps") if self.params else None
            done = int(getattr(self.state, "batch", 0) or 0)
            if self._first and done:
                self._offset = done
                if steps:
                    self._steps = max(steps - done, 1)
            self._first = False

        def on_batch_end(self, batch, logs=None):
            self.state.batch = self._offset + batch + 1
            if self._steps is not None and batch + 1 >= self._steps and \
                    not self.model.stop_training:
                self.model.stop_training = _END_OF_EPOCH

        def on_epoch_end(self, epoch, logs=None):
            self.state.batch = 0
            self._steps, self._offset = None, 0
            if self.model.stop_training is _END_OF_EPOCH:
                self.model.stop_training = False

        def on_train_end(self, logs=None):
            if self.model.stop_training is _END_OF_EPOCH:
                self.model.stop_training = False

    class UpdateEpochStateCallback(Callback):
        """Keeps `state.epoch` = the epochs done, counted across resumes
        (Horovod's UpdateEpochStateCallback)."""

        def __init__(self, state):
            super().__init__()
            self.state = state
            self.initial_epoch = self.state.epoch

        def on_train_begin(self, logs=None):
            self.initial_epoch = self.state.epoch

        def on_epoch_end(self, epoch, logs=None):
            self.state.epoch = self.initial_epoch + epoch + 1

    for cls in (CommitStateCallback, UpdateBatchStateCallback,
                UpdateEpochStateCallback):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {"CommitStateCallback": CommitStateCallback,
            "UpdateBatchStateCallback": UpdateBatchStateCallback,
            "UpdateEpochStateCallback": UpdateEpochStateCallback}


_CALLBACK_NAMES = ("CommitStateCallback", "UpdateBatchStateCallback",
                   "UpdateEpochStateCallback")


# model.fit recovering in place (kerasdist/keras/elastic_fit.py).
_FIT_NAMES = ("CommitCallback", "ElasticBatches")


def __getattr__(name):
    # The callbacks subclass keras.callbacks.Callback: built on first use,
    # so importing this module does not import Keras.
    if name in _CALLBACK_NAMES:
        globals().update(_callbacks())
        return globals()[name]
    if name in _FIT_NAMES:
        from kerasdist.keras import elastic_fit
        globals().update({n: getattr(elastic_fit, n) for n in _FIT_NAMES})
        return globals()[name]
    raise AttributeError(f"module 'kerasdist.elastic' has no attribute "
                         f"{name!r}")


__all__ = ["CommitCallback", "CommitStateCallback", "ElasticBatches",
           "HorovodInternalError",
           "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "RanksLostError", "State",
           "TensorFlowKerasState", "TensorFlowState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class _ShardCommits:
    """A sharded optimizer's slots in an elastic state: this rank's shard
    in memory (save/restore), written by each rank to its own file at a
    commit (`state-N.<commit>.shard-R-of-S.h5`, named with a token that
    is new for every commit of every attempt), and read back at any size
    (each rank of a sharded optimizer reads only its elements; a
    replicated one reads them whole on rank 0)."""

    def __init__(self, optimizer, model=None):
        self.optimizer = optimizer
        self.model = model
        self.values = _buddies.take(optimizer) if optimizer else {}
        # The last commit's shards, with a copy of a buddy's where the job
        # recovers in place (kerasdist/keras/sharding/buddies.py).
        self.copies = None
        self.pending = None  # rank 0: the shards of the commit it took
        # Rank 0, after taking a replicated optimizer's commit: its slots,
        # whole ({optimizer variable index: value}).
        self.whole = None
        self._nonce = None
        self._count = 0
        self._stems = []  # this state's newest commits' stems, oldest first
        # The job's size at the last commit (kd.size()): another now after
        # a grow in place (`grow`).
        self.job_size = None

    def sharded(self):
        return self.optimizer is not None and \
            _optimizer.shard_state(self.optimizer) is not None

    def save(self):
        if self.sharded():
            self.copies = _buddies.commit(self.optimizer, self.copies)
            self.job_size = basics.size()
            self.values = self.copies.values

    def protect(self):
        """Every rank, at a sync: commits the shards as they are where
        no buddy holds a copy of them yet (before the first commit)."""
        if self.sharded() and _buddies.keeps_copies() and (
                self.copies is None or self.copies.copy is None or
                self.copies.size != basics.size()):
            self.save()

    def grow(self):
        """Every rank at a sync: where the job grew in place (an old
        rank's shards laid out for fewer ranks than the job now has; the
        ranks agree on it in one small allreduce), the last commit's
        shards re-partitioned over the grown job, the new ranks receiving
        theirs from the old (`buddies.grow`); nothing elsewhere."""
        if not self.sharded() or basics.size() == 1:
            return
        from kerasdist._core import host as _host
        # An old rank: committed at another job size, its shards still
        # laid out for it (not an optimizer on a process set).
        grown = self.job_size not in (None, basics.size()) and \
            _buddies.resized(self.optimizer)
        flag = np.array([1 if grown else 0], np.int64)
        flag = _host.host_allreduce(flag, basics.Max,
                                    "kerasdist.elastic.shards_grown")
        if int(flag[0]):
            self.copies = _buddies.grow(self.optimizer, self.copies,
                                        self.model)
            self.values = self.copies.values
            self.job_size = basics.size()
            # The shard files' names go on as the old ranks' (a commit's
            # stem is the same on every rank; rank 0 is an old rank).
            self._nonce, self._count, self._stems = _broadcast_object(
                (self._nonce, self._count, self._stems))

    def restore(self):
        if self.sharded() and _buddies.resized(self.optimizer):
            # Every survivor of a recovery in place: the committed shards
            # re-partitioned over the new size, from the survivors' own
            # and buddy copies; ShardsLostError (one line) where one is
            # lost, which ends the recovery (a relaunch from disk).
            self.copies = _buddies.recover(self.optimizer, self.copies,
                                           self.model)
            self.values = self.copies.values
        if self.sharded():
            _buddies.assign(self.optimizer, self.values)

    def write(self, path, number):
        """Every rank: writes its shard file of a commit beside `path`;
        returns (files, index) of the commit, the same on every rank."""
        from kerasdist._core import host as _host

        state = _optimizer.shard_state(self.optimizer)
        rank, size = state.rank, state.layout.size
        directory = os.path.dirname(path)
        if self._nonce is None:
            nonce = np.frombuffer(os.urandom(8), np.int64) % (2 ** 62)
            self._nonce = int(_host.host_broadcast(
                nonce, 0, "kerasdist.elastic.shard_nonce")[0])
            # Every rank writes its shard file there, and rank 0 reads
            # them all at the next start: one line at the first commit,
            # not a commit that cannot be restored.
            _host.check_shared_directory(
                directory, f"the elastic commit directory ({ELASTIC_DIR_ENV})",
                "kerasdist.elastic.shared_dir")
        self._count += 1
        stem = f"state-{number}.{self._nonce:x}-{self._count}"
        os.makedirs(directory, exist_ok=True)
        mine = os.path.join(directory, _shard_name(stem, rank, size))
        _files.atomic_write(mine, lambda tmp: _shard_files.write_shard_file(
            tmp, self.values, token=stem, rank=rank, size=size),
            prefix=".tmp-state-")
        digest = _files.sha256(mine)
        row = np.array([[os.path.getsize(mine)] + list(np.frombuffer(
            bytes.fromhex(digest), np.int64))], np.int64)
        table = _host.host_allgather(row, "kerasdist.elastic.shard_files")
        files = [{"name": _shard_name(stem, k, size),
                  "bytes": int(table[k][0]),
                  "sha256": np.asarray(table[k][1:], np.int64).tobytes().hex()}
                 for k in range(size)]
        self._stems = (self._stems + [stem])[-2:]
        index = _shard_files.shard_index(self.optimizer)
        weights = _shard_files.weight_index(self.optimizer)
        if weights:  # shard="weights": the model's shards, as the Trainer's
            index["weights"] = weights
        return files, index

    def remove_unused(self, path, number):
        """Rank 0, after a commit: deletes this state's shard files that
        neither the commit nor the one before it (`.prev`) names."""
        directory = os.path.dirname(path)
        prefix = f"state-{number}."
        for name in os.listdir(directory):
            if name.startswith(prefix) and ".shard-" in name and \
                    name.split(".shard-")[0] not in self._stems:
                try:
                    os.remove(os.path.join(directory, name))
                except FileNotFoundError:
                    pass

    def check(self, record, directory):
        """Rank 0: raises ValueError unless every shard file `record`
        names is intact; notes it as the commit's shards."""
        self.pending = None
        self.whole = None
        sharded = bool(self.optimizer is not None and
                       _shard_files.weight_shards(self.optimizer))
        if sharded != bool((record or {}).get("weights")):
            raise ValueError(
                "it is a commit of a model whose weights were " +
                ("whole; this one's kerasdist.shard_weights() sharded (a "
                 "commit's weights are read at the mode they were "
                 "committed in)" if sharded else
                 "sharded (kerasdist.shard_weights); this one's are whole "
                 "(shard them too, with DistributedOptimizer(shard="
                 "'weights'))"))
        if record is None:  # none, or a replicated optimizer's slots whole
            return
        for entry in record["files"]:
            shard = os.path.join(directory, entry["name"])
            if not os.path.exists(shard):
                raise ValueError(f"shard file {shard} is missing")
            if os.path.getsize(shard) != entry["bytes"] or \
                    _files.sha256(shard) != entry["sha256"]:
                raise ValueError(f"shard file {shard} is damaged (its size "
                                 "or SHA-256 is not the commit's)")
        self.pending = record

    def load(self, record, directory):
        """Every rank, with the shards rank 0 took (None: none): reads
        this rank's part of the slots."""
        self.pending = None
        if record is None:
            return
        stem = record["files"][0]["name"].split(".shard-")[0]
        self._stems = [stem]
        if self.sharded() or basics.rank() == 0:
            source = _shard_files.ShardFiles(directory, record)
            try:
                _shard_files.load_slots(
                    self.optimizer, source,
                    {int(e["index"]): int(e["numel"])
                     for e in record["variables"]})
                if record.get("weights"):
                    _shard_files.load_weight_shards(self.optimizer, source,
                                                    record)
            finally:
                source.close()
        self.save()

    def load_whole(self):
        """Every rank of a sharded optimizer, once rank 0 took a commit of
        a replicated one (its slots in `self.whole`): each slot's whole
        value is broadcast from rank 0, one slot at a time, and every rank
        keeps its own shard of it (`step.own_shard`, the optimizer's
        own slicing)."""
        state = _optimizer.shard_state(self.optimizer)
        layout = state.layout
        for i, v, j in _shard_files.slot_variables(self.optimizer):
            dtype = _shard_files.numpy_dtype(layout.dtypes[j])
            if self.whole is not None:
                flat = np.asarray(self.whole[i]).astype(dtype).reshape(-1)
            else:
                flat = np.zeros(layout.numels[j], dtype)
            flat = _broadcast_arrays([flat], "whole_slots")[0]
            v.assign(_shard_step.own_shard(np, flat, layout.numels[j],
                                           layout.chunks[j], state.rank))
        self.whole = None
        self.save()


def _shard_name(stem, rank, size):
    return f"{stem}.shard-{rank:05d}-of-{size:05d}.h5"


