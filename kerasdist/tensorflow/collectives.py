"""The TF ops behind the public collectives (`kerasdist/collectives.py`):
tensors in, the ops' results out, usable eagerly, inside `tf.function` and
under `tf.GradientTape` (gradients are registered for each op). The public
functions check the arguments and resolve the names first."""

import contextlib

import tensorflow as tf

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import host as _host
from kerasdist.tensorflow._native import ops as _ops

FRAMEWORK = "tensorflow"

_ps = _capi.current_process_set


def _set_size(process_set):
    if not process_set:
        return basics.size()
    from kerasdist import process_sets
    return process_sets.set_size(process_set)


def _set_rank(process_set):
    if not process_set:
        return basics.rank()
    from kerasdist import process_sets
    return process_sets.set_rank(process_set)


def in_xla_context():
    """True while tracing a function compiled with XLA (jit_compile=True)."""
    if tf.executing_eagerly():
        return False
    # Private, but the only way to ask; guarded so a TF change degrades to
    # TF's own error instead of breaking every graph trace.
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def refuse_in_xla(what, why, instead):
    """Raises tf.errors.UnimplementedError while tracing an XLA-compiled
    function: `what` has no XLA kernel (`why`), `instead` says what to do.
    TF's own error there names an op kernel, not the call or the fix."""
    if in_xla_context():
        raise tf.errors.UnimplementedError(
            None, None,
            f"kerasdist: {what} cannot run inside "
            f"tf.function(jit_compile=True): {why}. {instead}")


# The collectives with XLA kernels on a GPU (CUDA handlers): those whose
# result has the input's shape.
_GPU_XLA = ("allreduce", "grouped_allreduce", "broadcast", "barrier")


def xla_unsupported(collective=None):
    """Why `collective` ("allreduce", ...; None: what the gradients need, a
    grouped allreduce) cannot run inside XLA here, or None when it can.
    The op library has XLA kernels (ops/tf/xla_kernels.cc) for TensorFlow's
    XLA on the CPU, and, built with the core's GPU backend, on a GPU for
    `_GPU_XLA`."""
    from kerasdist.tensorflow import _native
    if not _native.xla_kernels():
        return "in this build (built with TF_XLA=0)"
    if tf.config.list_physical_devices("GPU"):
        if not _native.xla_gpu_kernels():
            return ("for GPUs in this build (built without the GPU "
                    "backend)")
        if collective is not None and collective not in _GPU_XLA:
            return ("for GPUs yet (there " + ", ".join(_GPU_XLA[:-1])
                    + f" and {_GPU_XLA[-1]} have one)")
    return None


def _check_compiles(collective, name):
    """While tracing an XLA-compiled function where `collective` has no
    XLA kernel (xla_unsupported): the error that says so, instead of TF's
    "No registered 'KerasdistAllgather' OpKernel for XLA_GPU_JIT"."""
    if in_xla_context():
        why = xla_unsupported(collective)
        if why:
            hint = (" (a tf.IndexedSlices gradient is allgathered: "
                    "sparse_as_dense=True allreduces it instead)"
                    if collective == "allgather" else "")
            refuse_in_xla(f"{collective} {name!r}",
                          f"its TF op has no XLA kernel {why}",
                          "Drop jit_compile=True from the enclosing "
                          f"tf.function{hint}.")


require_init = _host.require_init
check_op = _host.check_op


def auto_name(kind, name):
    """The name the ranks negotiate by; identical on every rank.

    Explicit names win. Eagerly, unnamed calls are numbered in call order (the
    ranks must make them in the same order). Inside a tf.function the graph's
    own unique naming is used, which is the same on every rank that traces the
    same function.
    """
    if name is not None:
        return str(name)
    if tf.executing_eagerly():
        return _host.eager_name(kind, None)
    graph = tf.compat.v1.get_default_graph()
    return f"{kind}.{graph.unique_name('noname', mark_as_used=True)}"


def tensor(x, what):
    """`x` as the ops take it (allreduce and grouped_allreduce keep a
    `tf.IndexedSlices`)."""
    if what in ("allreduce", "grouped_allreduce") and isinstance(
            x, tf.IndexedSlices):
        return x
    return tf.convert_to_tensor(x)


def variable_value(variable):
    return tf.convert_to_tensor(variable)


no_grad = contextlib.nullcontext


def allreduce(tensor, op, name, prescale_factor, postscale_factor):
    _check_compiles("allreduce", name)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return _allreduce_sparse(tensor, op, name)
    return _ops().kerasdist_allreduce(
        tensor, tensor_name=name, reduce_op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=_ps())


def _check_sparse(op, prescale_factor, postscale_factor):
    """Horovod's errors (NotImplementedError) for what an allreduce of
    `tf.IndexedSlices`, which is two allgathers, cannot do."""
    if op == basics.Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not support tf.IndexedSlices; pass "
            "sparse_as_dense=True to DistributedOptimizer, or a dense "
            "tensor (tf.convert_to_tensor).")
    if op not in (basics.Average, basics.Sum):
        raise NotImplementedError(
            "allreduce of tf.IndexedSlices supports only kerasdist.Sum and "
            "kerasdist.Average; pass the gradient as a dense tensor "
            "(tf.convert_to_tensor) for other ops.")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(
            "allreduce of tf.IndexedSlices does not take prescale_factor or "
            "postscale_factor; scale the values yourself, or pass a dense "
            "tensor.")


def _allreduce_sparse(slices, op, base):
    values = allgather(tf.convert_to_tensor(slices.values), base + ".values")
    indices = allgather(tf.convert_to_tensor(slices.indices),
                        base + ".indices")
    if op == basics.Average:
        values = values / tf.cast(_set_size(_ps()), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor):
    _check_compiles("grouped_allreduce", name)
    # One op for the dense tensors: members are named `<name>.<i>`. Each
    # tf.IndexedSlices is allgathered (`<name>.sparse.<i>.values`, ...), as
    # allreduce does.
    sparse = [i for i, t in enumerate(tensors)
              if isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
    dense = [i for i in range(len(tensors)) if i not in sparse]
    out = [None] * len(tensors)
    if dense:
        reduced = _ops().kerasdist_grouped_allreduce(
            [tensors[i] for i in dense], tensor_name=name, reduce_op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=_ps())
        for i, t in zip(dense, reduced):
            out[i] = t
    for i in sparse:
        out[i] = _allreduce_sparse(tensors[i], op, f"{name}.sparse.{i}")
    return out


def allgather(tensor, name):
    _check_compiles("allgather", name)
    return _ops().kerasdist_allgather(tensor, tensor_name=name,
                                      process_set=_ps())


def broadcast(tensor, root_rank, name):
    _check_compiles("broadcast", name)
    return _ops().kerasdist_broadcast(tensor, tensor_name=name,
                                      root_rank=root_rank, process_set=_ps())


def alltoall(tensor, splits, name):
    _check_compiles("alltoall", name)
    if splits is None:
        splits = tf.zeros([0], tf.int64)
    splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)
    return _ops().kerasdist_alltoall(tensor, splits, tensor_name=name,
                                     process_set=_ps())


def reducescatter(tensor, op, name, prescale_factor, postscale_factor):
    _check_compiles("reducescatter", name)
    return _ops().kerasdist_reducescatter(
        tensor, tensor_name=name, reduce_op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=_ps())


def barrier(name):
    _check_compiles("barrier", name)
    _ops().kerasdist_barrier(tensor_name=name, process_set=_ps())


def join(name):
    refuse_in_xla(
        "join()", "it has no XLA kernel (a joined rank answers the other "
        "ranks' allreduces for as long as they go on, which a compiled "
        "program cannot)",
        "Call it outside the compiled function, e.g. after the loop over "
        "this rank's batches.")
    last = _ops().kerasdist_join(tensor_name=name)
    if tf.executing_eagerly():
        _host.restart_names_after_join()
    return last


# ---- gradients -------------------------------------------------------------


def _attr(op, key):
    return op.get_attr(key)


def _set(op):
    try:
        return int(op.get_attr("process_set"))
    except ValueError:
        return 0


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
        postscale_factor=_attr(op, "postscale_factor"), process_set=_set(op))


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
        postscale_factor=_attr(op, "postscale_factor"), process_set=_set(op)))


# The gradients of allgather, broadcast and reducescatter follow Horovod's
# (horovod/tensorflow/mpi_ops.py), not the gradient of the sum of every
# rank's loss: allgather and broadcast average the incoming gradients over
# the ranks (1/size() of that sum), a reducescatter's is size() times it.
@tf.RegisterGradient("KerasdistAllgather")
def _allgather_grad(op, grad):
    ps = _set(op)
    summed = _ops().kerasdist_allreduce(grad, tensor_name=_name(op),
                                        reduce_op=basics.Average,
                                        process_set=ps)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    all_rows = _ops().kerasdist_allgather(rows, tensor_name=_name(op) + ".rows",
                                          process_set=ps)
    offsets = tf.concat([[0], tf.cumsum(all_rows)], 0)
    me = _set_rank(ps)
    return summed[offsets[me]:offsets[me + 1]]


@tf.RegisterGradient("KerasdistBroadcast")
def _broadcast_grad(op, grad):
    summed = _ops().kerasdist_allreduce(grad, tensor_name=_name(op),
                                        reduce_op=basics.Average,
                                        process_set=_set(op))
    if basics.rank() != _attr(op, "root_rank"):
        return summed * 0
    return summed


@tf.RegisterGradient("KerasdistReducescatter")
def _reducescatter_grad(op, grad):
    gathered = _ops().kerasdist_allgather(grad, tensor_name=_name(op),
                                          process_set=_set(op))
    scale = _attr(op, "prescale_factor") * _attr(op, "postscale_factor")
    if _attr(op, "reduce_op") == basics.Sum:
        scale *= _set_size(_set(op))
    return gathered * tf.cast(scale, gathered.dtype)


@tf.RegisterGradient("KerasdistAlltoall")
def _alltoall_grad(op, grad, _splits_grad):
    back, _ = _ops().kerasdist_alltoall(grad, op.outputs[1],
                                        tensor_name=_name(op),
                                        process_set=_set(op))
    return back, None


# ---- Horovod's process ops and in-place broadcasts (kerasdist/collectives.py)


def topology_op(query, name, what="rank_op"):
    """A scalar int32 tensor holding `query()` (rank, size...), read when
    the op runs: eagerly at once, in a graph or `tf.function` at every
    run, so a graph built before `init()` reads the job it runs in. Not
    inside XLA (`what`, the public function, names it in the error)."""
    import numpy as np

    refuse_in_xla(
        f"{what}()", "it reads the value when it runs, through a Python "
        "call (tf.numpy_function) XLA cannot compile",
        "Read it outside the compiled function and pass it in as a "
        "tensor argument, or drop jit_compile=True.")

    def value():
        return np.int32(query())

    out = tf.numpy_function(value, [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


def global_variables():
    """TF1's global variables in graph mode; None eagerly (there are
    none)."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.global_variables()


def assign(variables, values):
    """Assigns `values` to `variables` and returns the new values: eagerly
    read back; in a graph, tensors that depend on the assignments (so
    running them runs the assignments)."""
    if tf.executing_eagerly():
        for v, x in zip(variables, values):
            v.assign(x)
        return [tf.convert_to_tensor(v) for v in variables]
    updates = [v.assign(x, read_value=False) if isinstance(v, tf.Variable)
               else v.assign(x) for v, x in zip(variables, values)]
    ops = [u for u in updates if isinstance(u, (tf.Operation, tf.Tensor))]
    with tf.control_dependencies(ops):
        return [tf.identity(x) for x in values]


def group(tensors):
    """One op that runs all of `tensors`."""
    return tf.group(*tensors)
