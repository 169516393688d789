"""Collectives on TensorFlow tensors: usable eagerly, inside `tf.function` and
under `tf.GradientTape` (gradients are registered for each op)."""

import itertools
import threading

import tensorflow as tf

from kerasdist._core import host as _host
from kerasdist import basics
from kerasdist.tensorflow._native import ops as _ops

_counters = {}
_counter_lock = threading.Lock()


_check_op = _host.check_op


def _auto_name(kind, name):
    """The name the ranks negotiate by; identical on every rank.

    Explicit names win. Eagerly, unnamed calls are numbered in call order (the
    ranks must make them in the same order). Inside a tf.function the graph's
    own unique naming is used, which is the same on every rank that traces the
    same function.
    """
    if name is not None:
        return str(name)
    if tf.executing_eagerly():
        with _counter_lock:
            counter = _counters.setdefault(kind, itertools.count())
            return f"{kind}.noname.{next(counter)}"
    graph = tf.compat.v1.get_default_graph()
    return f"{kind}.{graph.unique_name('noname', mark_as_used=True)}"


def _require_init():
    if not basics.is_initialized():
        raise RuntimeError("kerasdist is not initialized; call kerasdist.init() "
                           "first.")


def allreduce(tensor, op=basics.Average, name=None, prescale_factor=1.0,
              postscale_factor=1.0):
    """Reduces a tensor over all ranks; every rank gets the result.

    Args:
        tensor: a tf.Tensor, variable or array-like (float16, bfloat16,
            float32, float64, int32, int64, uint8), or a `tf.IndexedSlices`
            (its values and indices are allgathered; Average divides by
            `size()`).
        op: `kerasdist.Average` (default), `Sum`, `Min`, `Max` or `Product`.
            Average of integers divides with truncation toward zero.
        name: the name ranks match this collective by. Give one when ranks
            may issue collectives in different orders outside a tf.function.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.

    Returns:
        A tensor of the same shape and dtype.

    Raises:
        tf.errors.InvalidArgumentError: if ranks disagree about the tensor
            (shape, dtype, op); the message names the ranks.

    Example:
    >>> total = kerasdist.allreduce(tf.constant([1.0, 2.0]), op=kerasdist.Sum)
    """
    _require_init()
    _check_op(op, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, name)
    tensor = tf.convert_to_tensor(tensor)
    return _ops().kerasdist_allreduce(
        tensor, tensor_name=_auto_name("allreduce", name), reduce_op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def _allreduce_sparse(slices, op, name):
    if op not in (basics.Average, basics.Sum):
        raise ValueError("allreduce of tf.IndexedSlices supports only Sum and "
                         "Average.")
    base = _auto_name("allreduce", name)
    values = allgather(slices.values, name=base + ".values")
    indices = allgather(slices.indices, name=base + ".indices")
    if op == basics.Average:
        values = values / tf.cast(basics.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors, op=basics.Average, name=None,
                      prescale_factor=1.0, postscale_factor=1.0):
    """Reduces a list of tensors together (they run in one fused collective
    when they fit the fusion threshold and share a dtype).

    Returns:
        A list of reduced tensors, in the input order.
    """
    _require_init()
    _check_op(op, "grouped_allreduce")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    # One op for the whole list: members are named `<name>.<i>`.
    return list(_ops().kerasdist_grouped_allreduce(
        tensors, tensor_name=_auto_name("grouped_allreduce", name),
        reduce_op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor))


def allgather(tensor, name=None):
    """Concatenates every rank's tensor along the first dimension (which may
    differ between ranks; the other dimensions must agree)."""
    _require_init()
    tensor = tf.convert_to_tensor(tensor)
    return _ops().kerasdist_allgather(tensor,
                                      tensor_name=_auto_name("allgather", name))


def broadcast(tensor, root_rank, name=None):
    """Every rank receives `root_rank`'s tensor (any dtype, also bool/uint8)."""
    _require_init()
    size = basics.size()
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be an int in [0, {size}), got "
                         f"{root_rank!r}.")
    tensor = tf.convert_to_tensor(tensor)
    return _ops().kerasdist_broadcast(
        tensor, tensor_name=_auto_name("broadcast", name), root_rank=root_rank)


def _variable_name(v):
    return getattr(v, "path", None) or v.name


def broadcast_variables(variables, root_rank=0, name_prefix="broadcast"):
    """Assigns `root_rank`'s values to `variables` on every rank.

    Names derive from the variables' paths, so every rank must pass the same
    variables (in any order).
    """
    _require_init()
    variables = list(variables)
    names = [f"{name_prefix}.{_variable_name(v)}" for v in variables]
    if len(set(names)) != len(names):
        names = [f"{n}.{i}" for i, n in enumerate(names)]
    values = [broadcast(tf.convert_to_tensor(v), root_rank, name=n)
              for v, n in zip(variables, names)]
    for v, value in zip(variables, values):
        v.assign(value)


def alltoall(tensor, splits=None, name=None):
    """Sends `splits[r]` rows of `tensor` to rank r and returns what arrived.

    Without `splits` the first dimension is divided evenly.

    Returns:
        (received, received_splits): rows from every rank in rank order, and
        how many rows came from each rank.
    """
    _require_init()
    tensor = tf.convert_to_tensor(tensor)
    if splits is None:
        splits = tf.zeros([0], tf.int64)
    splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)
    return _ops().kerasdist_alltoall(tensor, splits,
                                     tensor_name=_auto_name("alltoall", name))


def reducescatter(tensor, op=basics.Average, name=None, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduces over all ranks; rank r keeps its slice of the first dimension
    (earlier ranks get one extra row when it does not divide evenly)."""
    _require_init()
    _check_op(op, "reducescatter")
    tensor = tf.convert_to_tensor(tensor)
    return _ops().kerasdist_reducescatter(
        tensor, tensor_name=_auto_name("reducescatter", name), reduce_op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def barrier(name=None):
    """Returns once every rank has called it."""
    _require_init()
    _ops().kerasdist_barrier(tensor_name=_auto_name("barrier", name))


# ---- gradients -------------------------------------------------------------


def _attr(op, key):
    return op.get_attr(key)


def _name(op):
    n = _attr(op, "tensor_name")
    return (n.decode() if isinstance(n, bytes) else n) + ".grad"


@tf.RegisterGradient("KerasdistAllreduce")
def _allreduce_grad(op, grad):
    reduce_op = _attr(op, "reduce_op")
    if reduce_op not in (basics.Average, basics.Sum):
        raise NotImplementedError(
            "Only Sum and Average allreduces are differentiable.")
    return _ops().kerasdist_allreduce(
        grad, tensor_name=_name(op), reduce_op=reduce_op,
        prescale_factor=_attr(op, "prescale_factor"),
        postscale_factor=_attr(op, "postscale_factor"))


@tf.RegisterGradient("KerasdistGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    reduce_op = _attr(op, "reduce_op")
    if reduce_op not in (basics.Average, basics.Sum):
        raise NotImplementedError(
            "Only Sum and Average allreduces are differentiable.")
    grads = [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
             for g, x in zip(grads, op.inputs)]
    return list(_ops().kerasdist_grouped_allreduce(
        grads, tensor_name=_name(op), reduce_op=reduce_op,
        prescale_factor=_attr(op, "prescale_factor"),
        postscale_factor=_attr(op, "postscale_factor")))


@tf.RegisterGradient("KerasdistAllgather")
def _allgather_grad(op, grad):
    summed = _ops().kerasdist_allreduce(grad, tensor_name=_name(op),
                                        reduce_op=basics.Sum)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    all_rows = _ops().kerasdist_allgather(rows, tensor_name=_name(op) + ".rows")
    offsets = tf.concat([[0], tf.cumsum(all_rows)], 0)
    me = basics.rank()
    return summed[offsets[me]:offsets[me + 1]]


@tf.RegisterGradient("KerasdistBroadcast")
def _broadcast_grad(op, grad):
    summed = _ops().kerasdist_allreduce(grad, tensor_name=_name(op),
                                        reduce_op=basics.Sum)
    if basics.rank() != _attr(op, "root_rank"):
        return summed * 0
    return summed


@tf.RegisterGradient("KerasdistReducescatter")
def _reducescatter_grad(op, grad):
    gathered = _ops().kerasdist_allgather(grad, tensor_name=_name(op))
    if _attr(op, "reduce_op") == basics.Average:
        gathered = gathered / tf.cast(basics.size(), gathered.dtype)
    return gathered * tf.cast(_attr(op, "prescale_factor") *
                              _attr(op, "postscale_factor"), gathered.dtype)


@tf.RegisterGradient("KerasdistAlltoall")
def _alltoall_grad(op, grad, _splits_grad):
    back, _ = _ops().kerasdist_alltoall(grad, op.outputs[1],
                                        tensor_name=_name(op))
    return back, None
