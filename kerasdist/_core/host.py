"""Framework-free pieces the JAX and PyTorch front ends share: collective
names for eager calls, the row split of a reducescatter, and small eager
collectives on sizes (what an allgather or alltoall must know before it can
shape its result).

The ranks match collectives by name, so an unnamed one needs a name that is
the same on every rank for the same logical tensor. Eagerly, unnamed calls
are numbered in call order per kind (every rank makes them in the same
order, as with TF's eager ops).
"""

import ctypes
import itertools
import os
import threading

import numpy as np

from kerasdist import basics
from kerasdist._core import capi as _capi

_counters = {}
_lock = threading.Lock()
# join() calls so far: every rank makes the same number, so unnamed calls
# after the j-th are numbered afresh under "j<j>" on every rank (the ranks
# that did not join first made unnamed calls the joined ones did not).
_joins = 0


def require_init():
    """Raises RuntimeError unless kerasdist.init() has run."""
    if not basics.is_initialized():
        raise RuntimeError("kerasdist is not initialized; call "
                           "kerasdist.init() first.")


def check_op(op, what):
    """Raises ValueError unless `op` is one of the core's reduce ops."""
    ops = _capi.reduce_ops()
    if op not in ops.values():
        raise ValueError(f"{what}: op must be one of kerasdist."
                         f"{', kerasdist.'.join(ops)}; got {op!r}.")


def eager_name(kind, name):
    """`name`, or `<kind>.noname.<k>` for the k-th unnamed call of `kind`."""
    if name is not None:
        return str(name)
    ps = _capi.current_process_set()
    if ps:
        # Only a set's members make its calls: a count of their own.
        kind = f"{kind}.set{ps}"
    with _lock:
        counter = _counters.setdefault(kind, itertools.count())
        if _joins:
            return f"{kind}.noname.j{_joins}.{next(counter)}"
        return f"{kind}.noname.{next(counter)}"


def restart_names_after_join():
    """Numbers unnamed calls afresh, the same on every rank, once join() has
    returned (eager_name)."""
    global _joins
    with _lock:
        _joins += 1
        _counters.clear()


def forget_set_names(process_set_id):
    """Restarts the numbering of unnamed calls on set `process_set_id`
    (when it is added: a reused id starts afresh on every member)."""
    suffix = f".set{process_set_id}"
    with _lock:
        for kind in [k for k in _counters if k.endswith(suffix)]:
            del _counters[kind]


def scatter_rows(rows, n):
    """Rows each rank keeps in a reducescatter of `rows` rows over `n` ranks:
    earlier ranks get one more when it does not divide (as the core does)."""
    return tuple(rows // n + (k < rows % n) for k in range(n))


def host_int64(op, values, name):
    """Runs a small allgather (`_capi.OP_ALLGATHER`) or one-value-per-rank
    alltoall (`_capi.OP_ALLTOALL`) of int64 `values` through the core and
    returns the result as a tuple of ints."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    n = basics.size()
    if _capi.current_process_set():
        n = len(_capi.process_set_ranks(_capi.current_process_set()) or ())
    kwargs = {"splits": [1] * n} if op == _capi.OP_ALLTOALL else {}
    h = _capi.Handle(op, name, _capi.DTYPES[np.dtype(np.int64)], values.shape,
                     values.ctypes.data_as(ctypes.c_void_p), None, **kwargs)
    h.wait()
    ptr, shape = h.output()
    out = np.empty(shape, np.int64)
    if out.size:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
    return tuple(int(v) for v in out)


def _code(dtype):
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":  # ml_dtypes' type, as JAX uses
        return _capi.BFLOAT16
    return _capi.DTYPES[dtype]


def _contiguous(x):
    x = np.asarray(x)  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    return x if x.flags.c_contiguous else x.copy()


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p) if a.size else None


def run_host(op, name, inputs, out_shapes, group=False, owned=False,
             **kwargs):
    """Runs one collective on host numpy arrays through the core and waits.

    Args:
        op: a `_capi.OP_*` value.
        name: the collective's name; with `group`, the inputs are members
            `<name>.<i>` of the group `name` (as the op libraries name them).
        inputs: numpy arrays (one unless `group`).
        out_shapes: the result shape for each input.
        group: enqueue the inputs as one group, all before any wait.
        owned: the core allocates the result (its size depends on the other
            ranks); it is copied out after its shape is checked.
        **kwargs: more `_capi.Handle` arguments (reduce_op, root_rank...).

    Returns:
        A list of numpy arrays.
    """
    inputs = [_contiguous(x) for x in inputs]
    outs = [np.empty(s, x.dtype) for s, x in zip(out_shapes, inputs)]
    members = [(_code(x.dtype), x.shape, _ptr(x),
                None if owned else _ptr(out)) for x, out in zip(inputs, outs)]
    if group:
        handles = _capi.start_group(
            op, name, [m + (-1,) for m in members], **kwargs)
    else:
        handles = [_capi.Handle(op, name, *m, **kwargs) for m in members]
    for h in handles:
        h.wait()
    if owned:
        for h, out in zip(handles, outs):
            ptr, shape = h.output()
            if tuple(shape) != out.shape:
                raise _capi.KerasdistError(
                    f"collective '{name}' produced shape {list(shape)}, "
                    f"expected {list(out.shape)}.")
            if out.size:
                ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
    return outs


# ---- small host collectives on numpy (any Keras backend) ---------------------


def host_allreduce(array, op, name):
    """Allreduces a numpy array (any shape) through the core; returns the
    result as a numpy array. For small control values (step counts, flags)
    that every Keras backend exchanges the same way."""
    require_init()
    x = np.asarray(array)
    return run_host(_capi.OP_ALLREDUCE, name, [x], [x.shape],
                    reduce_op=int(op))[0]


def host_allgather(array, name):
    """Allgathers a numpy array whose first dimension is the same on every
    rank; returns the `[size() * rows, ...]` result as a numpy array."""
    require_init()
    x = np.asarray(array)
    if x.ndim == 0:
        raise ValueError("host_allgather needs an array with a first "
                         "dimension, got a scalar.")
    n = basics.size()
    if _capi.current_process_set():
        n = len(_capi.process_set_ranks(_capi.current_process_set()) or ())
    shape = (x.shape[0] * n,) + x.shape[1:]
    return run_host(_capi.OP_ALLGATHER, name, [x], [shape], owned=True)[0]


def host_broadcast(array, root_rank, name):
    """Every rank gets `root_rank`'s numpy array (same shape everywhere)."""
    require_init()
    x = np.asarray(array)
    return run_host(_capi.OP_BROADCAST, name, [x], [x.shape],
                    root_rank=int(root_rank))[0]


def host_join(name="kerasdist.join"):
    """This rank has no more data: takes part in the other ranks' allreduces
    with zeros until every rank has joined; returns the last rank to join."""
    require_init()
    out = np.zeros((), np.int32)
    _capi.Handle(_capi.OP_JOIN, name, _capi.DTYPES[np.dtype(np.int32)],
                 (), None, out.ctypes.data).wait()
    restart_names_after_join()
    return int(out)


def host_barrier(name):
    """Returns once every rank has called it."""
    require_init()
    _capi.Handle(_capi.OP_BARRIER, name, _capi.DTYPES[np.dtype(np.uint8)],
                 (), None, None).wait()


def check_shared_directory(directory, what, name):
    """Raises RuntimeError on every rank (one line naming the directory
    and the ranks) unless `directory` is one directory that every rank can
    create, write and see the others' files in: each rank writes a probe
    file there, and each checks that rank 0's is there. A collective: every
    rank calls it with the same `name`. For the directories the ranks write
    to together (a sharded optimizer's checkpoints, an elastic commit's
    shard files), before the first write is due: otherwise rank 0 waits for
    files that went to another disk until its deadline, and its line blames
    the wait, not the directory."""
    require_init()
    n = basics.size()
    if n == 1:
        return
    rank = basics.rank()
    nonce = np.frombuffer(os.urandom(8), np.int64) % (2 ** 62)
    nonce = int(host_broadcast(nonce, 0, f"{name}.nonce")[0])
    path = os.path.abspath(os.fspath(directory))

    def probe(r):
        return os.path.join(path, f".kerasdist-shared-{nonce}-{r}")

    why = ""
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe(rank), "w"):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
    wrote = host_allgather(np.array([0 if why else 1], np.int64),
                           f"{name}.wrote")
    sees = int(bool(wrote[0]) and os.path.exists(probe(0)))
    seen = host_allgather(np.array([sees], np.int64), f"{name}.seen")
    try:
        os.remove(probe(rank))
    except OSError:
        pass
    cannot_write = [r for r in range(n) if not wrote[r]]
    cannot_see = [r for r in range(n) if wrote[0] and wrote[r]
                  and not seen[r]]
    if not (cannot_write or cannot_see):
        return
    parts = []
    if cannot_write:
        parts.append(f"{_ranks(cannot_write)} cannot write it"
                     + (f" ({why})" if why and rank in cannot_write
                        else ""))
    if cannot_see:
        parts.append(f"{_ranks(cannot_see)} cannot see rank 0's files in "
                     f"it (another disk under the same path)")
    raise RuntimeError(
        f"{what} {os.fspath(directory)!r} is not shared by every rank: "
        f"{'; '.join(parts)}. Every rank writes there: put it on a file "
        f"system that every host mounts at the same path (an absolute "
        f"path, the same on every rank).")


def _ranks(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(
        str(r) for r in ranks)
