"""Python objects between ranks: `broadcast_object`, `broadcast_object_fn`
and `allgather_object`, as in Horovod. An object travels as its pickled
bytes (cloudpickle where installed, else pickle) through the core's
broadcast and allgather, its length first, so the same on every framework
and in every TensorFlow mode (eager, `tf.function` tracing, TF1 graphs).

Unnamed calls are numbered in call order (as the eager collectives are),
so every rank must make them in the same order. Horovod names them after
the object's type, which differs between the root's object and the others'
placeholder (`None`) in the usual `broadcast_object(obj if root else None)`.
"""

import pickle

import numpy as np

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist._core import capi as _capi
from kerasdist._core import host as _host

__all__ = ["allgather_object", "broadcast_object", "broadcast_object_fn"]

try:
    import cloudpickle as _pickler  # functions, lambdas and local classes
except ImportError:  # pragma: no cover
    _pickler = pickle


def _check_root(root_rank):
    n = basics.size()
    if (not isinstance(root_rank, (int, np.integer))
            or isinstance(root_rank, bool) or not 0 <= root_rank < n):
        raise ValueError(f"root_rank must be an int in [0, {n}), got "
                         f"{root_rank!r}.")
    return int(root_rank)


def _bytes(obj):
    return np.frombuffer(_pickler.dumps(obj), np.uint8)


def _load(data):
    return pickle.loads(np.ascontiguousarray(data).tobytes())


def _check_name(name, what):
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{what}(name=...) must be a str or None; got "
                        f"{type(name).__name__}.")


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=None):
    """Every rank gets `root_rank`'s `obj` (any picklable object).

    Args:
        obj: the object on the root; ignored elsewhere (pass `None`).
        root_rank: the rank whose object everyone gets.
        session: accepted for Horovod's TF1 signature and not needed: the
            bytes go through the runtime directly, in every mode.
        name: the name ranks match this broadcast by (default: numbered in
            call order, the same on every rank).

    Returns:
        The root's object: on the root `obj` itself, elsewhere a copy.

    Raises:
        RuntimeError: if kerasdist is not initialized.
        ValueError: if `root_rank` is not an int in `[0, size())`.
        pickle.PicklingError (or TypeError): if `obj` cannot be pickled.

    Example:
    >>> state = kd.broadcast_object(state if kd.rank() == 0 else None)
    """
    del session
    _host.require_init()
    root_rank = _check_root(root_rank)
    _check_name(name, "broadcast_object")
    with _capi.process_set_scope(
            _process_sets.resolve(process_set)
            if process_set is not None else _capi.current_process_set()):
        return _broadcast_object(obj, root_rank, name)


def _broadcast_object(obj, root_rank, name):
    base = _host.eager_name("broadcast_object", name)
    root = basics.rank() == root_rank
    data = _bytes(obj) if root else np.zeros(0, np.uint8)
    length = _host.host_broadcast(np.array([data.size], np.int64),
                                  root_rank, base + ".sz")[0]
    if not root:
        data = np.zeros(int(length), np.uint8)
    data = _host.host_broadcast(data, root_rank, base + ".t")
    return obj if root else _load(data)


def broadcast_object_fn(root_rank=0, session=None, name=None,
                        process_set=None):
    """A function `bcast(obj)` that broadcasts `obj` from `root_rank`, as
    Horovod's: made once, called as often as needed (every call is a
    `broadcast_object` named `name`).

    Args:
        root_rank: the rank whose objects everyone gets.
        session: accepted for Horovod's TF1 signature and not needed.
        name: the name of every broadcast (default "broadcast_object_fn").

    Returns:
        `bcast(obj)`, returning the root's object on every rank.

    Raises:
        TypeError: for a `name` that is not a str.

    Example:
    >>> bcast = kd.broadcast_object_fn(root_rank=0)
    >>> epoch = bcast(epoch)
    """
    del session
    _check_name(name, "broadcast_object_fn")
    name = name or "broadcast_object_fn"

    def bcast(obj):
        return broadcast_object(obj, root_rank, name=name,
                                process_set=process_set)

    return bcast


def allgather_object(obj, session=None, name=None, process_set=None):
    """The list of every rank's `obj` (any picklable object), in rank
    order; the objects may differ in size.

    Args:
        obj: this rank's object.
        session: accepted for Horovod's TF1 signature and not needed.
        name: the name ranks match this allgather by (default: numbered in
            call order, the same on every rank).

    Returns:
        A list of `size()` objects; entry `rank()` is a copy of `obj`.

    Raises:
        RuntimeError: if kerasdist is not initialized.

    Example:
    >>> counts = kd.allgather_object(len(my_shard))
    """
    del session
    _host.require_init()
    _check_name(name, "allgather_object")
    with _capi.process_set_scope(
            _process_sets.resolve(process_set)
            if process_set is not None else _capi.current_process_set()):
        return _allgather_object(obj, name)


def _allgather_object(obj, name):
    base = _host.eager_name("allgather_object", name)
    data = _bytes(obj)
    sizes = _host.host_allgather(np.array([data.size], np.int64),
                                 base + ".sz")
    gathered = _host.run_host(_capi.OP_ALLGATHER, base + ".t", [data],
                              [(int(sizes.sum()),)], owned=True)[0]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [_load(gathered[offsets[k]:offsets[k + 1]])
            for k in range(len(sizes))]
