"""The JAX side of the public collectives (`kerasdist/collectives.py`):
arrays in, results out, eagerly and inside `jax.jit`, differentiable
(`jax.custom_vjp`) as the TF ops are. The public functions check the
arguments and resolve the names first.

Inside `jax.jit` each collective is an XLA FFI custom call (ops/jax/ffi.cc)
that enqueues through the core, so it is negotiated by name and fused like
TF's; eager calls on concrete arrays go to the core directly. Inside
`jax.jit` an unnamed collective is named at trace time, from the traced
function and a counter that restarts with every trace; the ranks trace the
same code, so the names agree. Shapes inside `jax.jit` are fixed at trace
time, so there `allgather` needs the same first dimension on every rank and
`alltoall` an even split; eagerly both may differ per rank (the sizes are
exchanged first)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import host as _host
from kerasdist.jax import _dispatch
from kerasdist.jax._dispatch import call
from kerasdist.jax._dispatch import program_trace

FRAMEWORK = "jax"

require_init = _host.require_init
check_op = _host.check_op
auto_name = _dispatch.auto_name  # trace-time names inside jax.jit
no_grad = contextlib.nullcontext


_DTYPES = frozenset(np.dtype(t) for t in (
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.int8,
    jnp.int16, jnp.int32, jnp.int64, jnp.uint8, jnp.uint16, jnp.bool_))


def tensor(x, what):
    """`x` as a JAX array of a dtype the core reduces, else a TypeError."""
    x = jnp.asarray(x)
    if np.dtype(x.dtype) not in _DTYPES:
        raise TypeError(f"kerasdist {what}: unsupported dtype {x.dtype}; "
                        "expected float16, bfloat16, float32, float64, int8, "
                        "int16, int32, int64, uint8, uint16 or bool.")
    return x


def variable_value(variable):
    return variable.value


def _like(x, rows=None):
    shape = x.shape if rows is None else (rows,) + tuple(x.shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype)


def _reduce_attrs(op, prescale, postscale):
    return dict(reduce_op=np.int32(op),
                prescale_factor=np.float64(prescale),
                postscale_factor=np.float64(postscale))


def _set_size():
    """The size of the process set collectives run on here (the job's)."""
    ps = _capi.current_process_set()
    return len(_capi.process_set_ranks(ps)) if ps else basics.size()


def _set_rank():
    """This rank's index in that set."""
    ps = _capi.current_process_set()
    return _capi.process_set_rank(ps) if ps else basics.rank()


def _on_set(ps):
    """The scope of process set `ps`, for the primal and backward passes of
    a collective: the backward pass runs after the public call returned
    (and its scope ended), yet must run on the forward's set."""
    return _capi.process_set_scope(ps)


def _differentiable(op):
    if op not in (basics.Average, basics.Sum):
        raise NotImplementedError(
            "Only Sum and Average allreduces are differentiable.")


# ---- allreduce ---------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _allreduce(x, name, op, prescale, postscale, ps=0):
    with _on_set(ps):
        return call("allreduce", _like(x), x, tensor_name=name,
                    **_reduce_attrs(op, prescale, postscale))


def _allreduce_fwd(x, name, op, prescale, postscale, ps):
    return _allreduce(x, name, op, prescale, postscale, ps), None


def _allreduce_bwd(name, op, prescale, postscale, ps, _, grad):
    _differentiable(op)
    return (_allreduce(grad, name + ".grad", op, prescale, postscale, ps),)


_allreduce.defvjp(_allreduce_fwd, _allreduce_bwd)


def allreduce(tensor, op, name, prescale_factor, postscale_factor):
    return _allreduce(tensor, name, int(op), float(prescale_factor),
                      float(postscale_factor), _capi.current_process_set())


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _grouped(xs, name, op, prescale, postscale, ps=0):
    with _on_set(ps):
        return tuple(call("grouped_allreduce", [_like(x) for x in xs], *xs,
                          tensor_name=name,
                          **_reduce_attrs(op, prescale, postscale)))


def _grouped_fwd(xs, name, op, prescale, postscale, ps):
    return _grouped(xs, name, op, prescale, postscale, ps), None


def _grouped_bwd(name, op, prescale, postscale, ps, _, grads):
    _differentiable(op)
    return (_grouped(tuple(grads), name + ".grad", op, prescale, postscale,
                     ps),)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor):
    return list(_grouped(tuple(tensors), name, int(op),
                         float(prescale_factor), float(postscale_factor),
                         _capi.current_process_set()))


# ---- allgather ---------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _allgather(x, name, rows, ps=0):
    with _on_set(ps):
        return call("allgather", _like(x, sum(rows)), x, tensor_name=name)


def _allgather_fwd(x, name, rows, ps):
    return _allgather(x, name, rows, ps), None


def _allgather_bwd(name, rows, ps, _, grad):
    # Every rank's output holds this rank's rows: their gradient is the
    # average of every rank's cotangent for them (Horovod's convention).
    summed = _allreduce(grad, name + ".grad", basics.Average, 1.0, 1.0, ps)
    with _on_set(ps):
        r = _set_rank()
    start = sum(rows[:r])
    return (summed[start:start + rows[r]],)


_allgather.defvjp(_allgather_fwd, _allgather_bwd)


def allgather(tensor, name):
    if tensor.ndim == 0:
        raise ValueError("allgather needs an array with a first dimension, "
                         "got a scalar; reshape it to [1].")
    if program_trace() is None:
        rows = _host.host_int64(_capi.OP_ALLGATHER, [tensor.shape[0]],
                                name + ".rows")
    else:
        rows = (tensor.shape[0],) * _set_size()
    return _allgather(tensor, name, rows, _capi.current_process_set())


# ---- broadcast ---------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _broadcast(x, name, root, ps=0):
    with _on_set(ps):
        return call("broadcast", _like(x), x, tensor_name=name,
                    root_rank=np.int32(root))


def _broadcast_fwd(x, name, root, ps):
    return _broadcast(x, name, root, ps), None


def _broadcast_bwd(name, root, ps, _, grad):
    summed = _allreduce(grad, name + ".grad", basics.Average, 1.0, 1.0, ps)
    return (summed if basics.rank() == root else summed * 0,)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)


def broadcast(tensor, root_rank, name):
    return _broadcast(tensor, name, root_rank, _capi.current_process_set())


# ---- alltoall ----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _alltoall(x, name, splits, recv, ps=0):
    with _on_set(ps):
        return call("alltoall", _like(x, sum(recv)), x, tensor_name=name,
                    splits=np.asarray(splits, np.int64))


def _alltoall_fwd(x, name, splits, recv, ps):
    return _alltoall(x, name, splits, recv, ps), None


def _alltoall_bwd(name, splits, recv, ps, _, grad):
    # The rows go back where they came from.
    return (_alltoall(grad, name + ".grad", recv, splits, ps),)


_alltoall.defvjp(_alltoall_fwd, _alltoall_bwd)


def _concrete_splits(splits, rows, size):
    if isinstance(splits, jax.core.Tracer):
        raise ValueError("alltoall: splits must be concrete (a list or numpy "
                         "array), not a traced value.")
    splits = tuple(int(s) for s in np.asarray(splits).reshape(-1))
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"alltoall: splits must be {size} non-negative row "
                         f"counts summing to the first dimension ({rows}); got "
                         f"{list(splits)}.")
    return splits


def alltoall(tensor, splits, name):
    n = _set_size()
    if tensor.ndim == 0:
        raise ValueError("alltoall needs an array with a first dimension, got "
                         "a scalar.")
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits needs a first dimension "
                             f"divisible by size() ({n}), got {rows}.")
        splits = recv = (rows // n,) * n
    else:
        splits = _concrete_splits(splits, rows, n)
        if program_trace() is not None:
            raise ValueError(
                "alltoall inside jax.jit supports only splits=None (an even "
                "split): the received sizes would fix the result's shape. "
                "Call it outside jax.jit for explicit splits.")
        recv = _host.host_int64(_capi.OP_ALLTOALL, splits, name + ".splits")
    return (_alltoall(tensor, name, splits, recv, _capi.current_process_set()),
            jnp.asarray(np.asarray(recv, np.int32)))


# ---- reducescatter -----------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _reducescatter(x, name, op, prescale, postscale, counts, ps=0):
    with _on_set(ps):
        return call("reducescatter", _like(x, counts[_set_rank()]), x,
                    tensor_name=name, **_reduce_attrs(op, prescale, postscale))


def _reducescatter_fwd(x, name, op, prescale, postscale, counts, ps):
    return _reducescatter(x, name, op, prescale, postscale, counts, ps), None


def _reducescatter_bwd(name, op, prescale, postscale, counts, ps, _, grad):
    _differentiable(op)
    gathered = _allgather(grad, name + ".grad", counts, ps)
    scale = prescale * postscale * (len(counts) if op == basics.Sum else 1)
    return (gathered * jnp.asarray(scale, gathered.dtype),)


_reducescatter.defvjp(_reducescatter_fwd, _reducescatter_bwd)


def reducescatter(tensor, op, name, prescale_factor, postscale_factor):
    if tensor.ndim == 0:
        raise ValueError("reducescatter needs an array with a first "
                         "dimension, got a scalar.")
    counts = _host.scatter_rows(tensor.shape[0], _set_size())
    return _reducescatter(tensor, name, int(op), float(prescale_factor),
                          float(postscale_factor), counts,
                          _capi.current_process_set())


def barrier(name):
    token = call("barrier", jax.ShapeDtypeStruct((), jnp.int32),
                 tensor_name=name)
    if program_trace() is None:
        token.block_until_ready()


def join(name):
    if program_trace() is not None:
        raise RuntimeError(
            "kerasdist.jax.join() runs eagerly only: call it after the "
            "training loop, outside jax.jit (inside a traced function it "
            "would wait at trace time).")
    return _host.host_join(name)
