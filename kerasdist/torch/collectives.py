"""The PyTorch side of the public collectives (`kerasdist/collectives.py`):
`torch.library` custom ops with autograd, as the TF ops have. The public
functions check the arguments and resolve the names first.

The ops call the core through its C API (ctypes): each enqueues its tensor,
which the core negotiates by name with the other ranks and fuses with what
else is in flight, and waits for it. The wait is the handle API's: one
blocking C call with the GIL released (a completion callback would only
run Python on the core's thread). No C++ extension is compiled. CPU tensors
take every collective; CUDA tensors (a core built with KERASDIST_WITH_NCCL)
take allreduce, grouped_allreduce and broadcast, whose results have the
input's shape and so can be allocated on the GPU first.
"""

import contextlib
import ctypes

import numpy as np
import torch

from kerasdist import basics
from kerasdist import build_probes
from kerasdist._core import capi as _capi
from kerasdist._core import host as _host

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32,
          torch.float64: np.float64, torch.int8: np.int8,
          torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint8: np.uint8,
          torch.uint16: np.uint16, torch.bool: np.bool_}


def _code(t):
    if t.dtype == torch.bfloat16:
        return _capi.BFLOAT16
    if t.dtype not in _NUMPY:
        raise TypeError(f"kerasdist: unsupported dtype {t.dtype}; expected "
                        "float16, bfloat16, float32, float64, int8, int16, "
                        "int32, int64, uint8, uint16 or bool.")
    return _capi.DTYPES[np.dtype(_NUMPY[t.dtype])]


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t.numel() else None


def _device(t, what):
    """The core's device index for `t` (-1: host memory)."""
    if t.device.type == "cpu":
        return -1
    if t.device.type != "cuda":
        raise ValueError(f"kerasdist {what}: tensors on {t.device.type} are "
                         "not supported; use CPU or CUDA tensors.")
    if not build_probes.nccl_built():
        raise RuntimeError(f"kerasdist {what}: a CUDA tensor needs kerasdist "
                           "built with KERASDIST_WITH_NCCL=1 (this build has "
                           "no GPU backend); move the tensor to the CPU.")
    # The core reads the input on its own stream: what torch queued on the
    # current stream to produce it must be finished first.
    torch.cuda.current_stream(t.device).synchronize()
    return t.device.index


def _start(op, name, x, out, **kwargs):
    return _capi.Handle(op, name, _code(x), tuple(x.shape), _ptr(x),
                        None if out is None else _ptr(out), **kwargs)


def _owned(handle, like):
    """Copies a result the core allocated into a new tensor."""
    ptr, shape = handle.output()
    out = torch.empty(shape, dtype=like.dtype)
    if out.numel() and ptr:
        ctypes.memmove(out.data_ptr(), ptr, out.numel() * out.element_size())
    return out


def _host_only(x, what):
    if _device(x, what) >= 0:
        raise NotImplementedError(
            f"kerasdist {what} of a CUDA tensor is not supported (its result "
            "size depends on the other ranks); move the tensor to the CPU.")


# ---- the ops (positional, typed arguments: torch.library's schema) ----------


@torch.library.custom_op("kerasdist::allreduce", mutates_args=())
def _allreduce(x: torch.Tensor, name: str, op: int, prescale: float,
               postscale: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    _start(_capi.OP_ALLREDUCE, name, x, out, reduce_op=op, prescale=prescale,
           postscale=postscale, device=_device(x, "allreduce")).wait()
    return out


class PendingAllreduce:
    """A grouped allreduce enqueued in the core and not yet waited for:
    `wait()` returns the reduced tensors (`inplace`: the contiguous inputs
    themselves). The inputs are kept alive until then."""

    def __init__(self, xs, name, op, prescale, postscale, process_set=None,
                 inplace=False):
        # Every member is enqueued before any is waited for, so the core
        # sees the whole group at once and fuses it.
        xs = [x.contiguous() for x in xs]
        outs = xs if inplace else [torch.empty_like(x) for x in xs]
        # Checked before anything is enqueued: a group short of a member
        # would keep the other ranks waiting for it.
        devices = [_device(x, "grouped_allreduce") for x in xs]
        for x in xs:
            _code(x)
        self._inputs, self._outputs = xs, outs
        self._handles = _capi.start_group(
            _capi.OP_ALLREDUCE, name,
            [(_code(x), tuple(x.shape), _ptr(x), _ptr(out), device)
             for x, out, device in zip(xs, outs, devices)],
            reduce_op=op, prescale=prescale, postscale=postscale,
            process_set=process_set)

    def settle(self):  # every member ended; `wait` raises a failure
        for h in self._handles:
            with contextlib.suppress(_capi.KerasdistError):
                h.wait()

    def wait(self):
        try:
            for h in self._handles:
                h.wait()
        finally:
            self._handles, self._inputs = [], []
        return self._outputs


def start_grouped_allreduce(xs, name, op, prescale=1.0, postscale=1.0,
                            process_set=None, inplace=False):
    """Enqueues a grouped allreduce of torch tensors without waiting for
    it (the gradient buckets' overlap); returns a `PendingAllreduce`."""
    return PendingAllreduce(list(xs), name, int(op), float(prescale),
                            float(postscale), process_set, inplace)


class PendingReducescatter:
    """A reducescatter of a 2-D torch tensor (one row a rank) enqueued in
    the core and not yet waited for: `done()` says whether it finished,
    `wait()` returns this rank's row, flat. The input is kept alive (the
    core reads it in place) until then."""

    def __init__(self, x, name, op, prescale, postscale, process_set):
        _host_only(x, "reducescatter")
        self._input = x.contiguous()
        # This rank's row goes straight into our tensor (no copy out of
        # the core); a result of another shape stays the core's (`wait`).
        self._output = x.new_empty((1, *x.shape[1:]))
        self._handle = _start_into(
            _capi.OP_REDUCESCATTER, name, self._input, self._output,
            reduce_op=op, prescale=prescale, postscale=postscale,
            process_set=process_set)

    def done(self):
        """Whether the core has finished it (never blocks; a failure is
        raised by `wait`)."""
        try:
            self._handle.wait(timeout=0)
        except TimeoutError:
            return False
        except _capi.KerasdistError:
            pass
        return True

    def wait(self):
        try:
            self._handle.wait()
            out = self._output
            if tuple(self._handle.output()[1]) != out.shape:
                out = _owned(self._handle, self._input)
            return out.reshape(-1)
        finally:
            self._input = self._output = None


def start_reducescatter(x, name, op, prescale=1.0, postscale=1.0,
                        process_set=None):
    """Enqueues a reducescatter of `x` (rows: one per rank) without
    waiting for it (the sharded optimizer's overlap); returns a
    `PendingReducescatter`."""
    return PendingReducescatter(x, name, int(op), float(prescale),
                                float(postscale), process_set)


@torch.library.custom_op("kerasdist::grouped_allreduce", mutates_args=())
def _grouped(xs: list[torch.Tensor], name: str, op: int, prescale: float,
             postscale: float) -> list[torch.Tensor]:
    return PendingAllreduce(xs, name, op, prescale, postscale).wait()


def _start_into(op, name, x, out, **kwargs):
    """Enqueues `op` of `x` to write its result into `out` (its shape)."""
    return _start(op, name, x, out, into_shape=tuple(out.shape), **kwargs)


def _finish_into(handle, out, name):
    """Waits for `handle` (`_start_into`) and returns `out`; fails where the
    result had another shape (the core then wrote elsewhere)."""
    handle.wait()
    _, shape = handle.output()
    if tuple(shape) != tuple(out.shape):
        raise RuntimeError(
            f"kerasdist: the sharded state's collective '{name}' gave "
            f"{shape[0] if shape else 0} row(s) where its layout expects "
            f"{out.shape[0]}: the ranks disagree on the layout (this "
            f"rank's is for {basics.size()} rank(s) now). A step compiled "
            "before the job changed size must be compiled again.")
    return out


class PendingAllgather:
    """An allgather of a 1-D CPU tensor as long on each of `size` ranks,
    enqueued, not yet waited for (the sharded optimizer's, several in
    flight): `wait()` returns the tensors concatenated. The input and
    output live (the core reads and writes them in place) until then."""

    def __init__(self, x, name, size, process_set=None):
        _host_only(x, "allgather")
        self._name = name
        self._input = x.contiguous()
        self._output = x.new_empty((size * x.shape[0],))
        self._handle = _start_into(_capi.OP_ALLGATHER, name, self._input,
                                   self._output, process_set=process_set)

    def wait(self):
        try:
            return _finish_into(self._handle, self._output, self._name)
        finally:
            self._input = self._output = None


@torch.library.custom_op("kerasdist::allgather", mutates_args=())
def _allgather(x: torch.Tensor, name: str) -> torch.Tensor:
    _host_only(x, "allgather")
    x = x.contiguous()
    h = _start(_capi.OP_ALLGATHER, name, x, None)
    h.wait()
    return _owned(h, x)


@torch.library.custom_op("kerasdist::broadcast", mutates_args=())
def _broadcast(x: torch.Tensor, name: str, root: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    _start(_capi.OP_BROADCAST, name, x, out, root_rank=root,
           device=_device(x, "broadcast")).wait()
    return out


@torch.library.custom_op("kerasdist::alltoall", mutates_args=())
def _alltoall(x: torch.Tensor, name: str,
              splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    _host_only(x, "alltoall")
    x = x.contiguous()
    h = _start(_capi.OP_ALLTOALL, name, x, None, splits=splits)
    h.wait()
    recv = h.recv_splits(basics.size())
    return _owned(h, x), torch.tensor(recv, dtype=torch.int64)


@torch.library.custom_op("kerasdist::reducescatter", mutates_args=())
def _reducescatter(x: torch.Tensor, name: str, op: int, prescale: float,
                   postscale: float) -> torch.Tensor:
    _host_only(x, "reducescatter")
    x = x.contiguous()
    h = _start(_capi.OP_REDUCESCATTER, name, x, None, reduce_op=op,
               prescale=prescale, postscale=postscale)
    h.wait()
    return _owned(h, x)


# Sharded weights' collectives (kerasdist/keras/sharding/views.py, through
# the Keras layer's Torch framework): a gather of every rank's row and its
# gradient's reduce-scatter, as ops torch.compile (Keras' jit_compile=True)
# traces: their shapes follow from the shards' layout, the same on every
# rank, so they have fake implementations, which allgather and
# reducescatter (sized by the other ranks) cannot have. A result of another
# shape (a step compiled before the job changed size) is an error, never
# a tensor of a shape the compiled code did not expect.
@torch.library.custom_op("kerasdist::shard_gather", mutates_args=())
def shard_gather(row: torch.Tensor, name: str, size: int) -> torch.Tensor:
    _host_only(row, "allgather")
    row = row.contiguous()
    out = row.new_empty((size * row.shape[0],) + tuple(row.shape[1:]))
    return _finish_into(_start_into(_capi.OP_ALLGATHER, name, row, out),
                        out, name)


@torch.library.custom_op("kerasdist::shard_scatter", mutates_args=())
def shard_scatter(rows: torch.Tensor, name: str) -> torch.Tensor:
    _host_only(rows, "reducescatter")
    rows = rows.contiguous()
    out = rows.new_empty((1,) + tuple(rows.shape[1:]))
    return _finish_into(_start_into(
        _capi.OP_REDUCESCATTER, name, rows, out,
        reduce_op=int(basics.Average), prescale=1.0, postscale=1.0), out,
        name)


# ---- shapes for torch.compile ------------------------------------------------
# The ops whose result has the input's shape can be traced by torch.compile
# (Keras' `jit_compile=True` on torch); the others' result sizes depend on
# the other ranks, so a compiled function falls back to eager around them.


@_allreduce.register_fake
def _(x, name, op, prescale, postscale):
    return torch.empty_like(x)


@_grouped.register_fake
def _(xs, name, op, prescale, postscale):
    return [torch.empty_like(x) for x in xs]


@_broadcast.register_fake
def _(x, name, root):
    return torch.empty_like(x)


@shard_gather.register_fake
def _(row, name, size):
    return row.new_empty((size * row.shape[0],) + tuple(row.shape[1:]))


@shard_scatter.register_fake
def _(rows, name):
    return rows.new_empty((1,) + tuple(rows.shape[1:]))


# ---- gradients (as the TF ops': kerasdist/tensorflow/collectives.py) -------


def _keep_args(ctx, inputs, output):
    ctx.args = inputs[1:]


def _differentiable(op):
    if op not in (basics.Average, basics.Sum):
        raise NotImplementedError(
            "Only Sum and Average allreduces are differentiable.")


def _allreduce_grad(ctx, grad):
    name, op, prescale, postscale = ctx.args
    _differentiable(op)
    return _allreduce(grad, name + ".grad", op, prescale, postscale), *(
        None,) * 4


def _grouped_grad(ctx, grads):
    name, op, prescale, postscale = ctx.args
    _differentiable(op)
    return _grouped(list(grads), name + ".grad", op, prescale,
                    postscale), *(None,) * 4


def _allgather_context(ctx, inputs, output):
    ctx.args = inputs[1:]
    ctx.rows = inputs[0].shape[0]


def _allgather_grad(ctx, grad):
    # Every rank's output holds this rank's rows: their gradient is the
    # average of every rank's cotangent for them (Horovod's convention).
    (name,) = ctx.args
    summed = _allreduce(grad.contiguous(), name + ".grad", basics.Average,
                        1.0, 1.0)
    rows = _host.host_int64(_capi.OP_ALLGATHER, [ctx.rows],
                                name + ".grad.rows")
    start = sum(rows[:basics.rank()])
    return summed[start:start + ctx.rows], None


def _broadcast_grad(ctx, grad):
    name, root = ctx.args
    summed = _allreduce(grad.contiguous(), name + ".grad", basics.Average,
                        1.0, 1.0)
    return (summed if basics.rank() == root else torch.zeros_like(summed),
            None, None)


def _alltoall_context(ctx, inputs, output):
    ctx.args = inputs[1:]
    ctx.recv = output[1].tolist()


def _alltoall_grad(ctx, grad, _splits_grad):
    # The rows go back where they came from.
    name, _ = ctx.args
    back, _ = _alltoall(grad.contiguous(), name + ".grad", ctx.recv)
    return back, None, None


def _reducescatter_grad(ctx, grad):
    name, op, prescale, postscale = ctx.args
    _differentiable(op)
    gathered = _allgather(grad.contiguous(), name + ".grad")
    scale = prescale * postscale * (basics.size() if op == basics.Sum
                                    else 1)
    return gathered * scale, None, None, None, None


for _op, _grad, _setup in (
        ("allreduce", _allreduce_grad, _keep_args),
        ("grouped_allreduce", _grouped_grad, _keep_args),
        ("allgather", _allgather_grad, _allgather_context),
        ("broadcast", _broadcast_grad, _keep_args),
        ("alltoall", _alltoall_grad, _alltoall_context),
        ("reducescatter", _reducescatter_grad, _keep_args)):
    torch.library.register_autograd(f"kerasdist::{_op}", _grad,
                                    setup_context=_setup)


# ---- what the public collectives call ---------------------------------------

FRAMEWORK = "torch"

# Plain Python checks (ctypes calls into the core): torch.compile runs them
# as they are instead of tracing them.
require_init = torch.compiler.disable(_host.require_init)
check_op = torch.compiler.disable(_host.check_op)
auto_name = _host.eager_name
no_grad = torch.no_grad


def tensor(x, what):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def variable_value(variable):
    return variable.value.detach()


def _rows(x, what):
    if x.dim() == 0:
        raise ValueError(f"{what} needs a tensor with a first dimension, got "
                         "a scalar; reshape it to [1].")
    return x.shape[0]


def allreduce(tensor, op, name, prescale_factor, postscale_factor):
    return _allreduce(tensor, name, int(op), float(prescale_factor),
                      float(postscale_factor))


def grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor):
    return list(_grouped(tensors, name, int(op), float(prescale_factor),
                         float(postscale_factor)))


def allgather(tensor, name):
    _rows(tensor, "allgather")
    return _allgather(tensor, name)


def broadcast(tensor, root_rank, name):
    return _broadcast(tensor, name, root_rank)


def alltoall(tensor, splits, name):
    rows = _rows(tensor, "alltoall")
    n = basics.size()
    if splits is None:
        splits = []
    else:
        splits = [int(s) for s in torch.as_tensor(splits).reshape(-1).tolist()]
        if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"alltoall: splits must be {n} non-negative row "
                             f"counts summing to the first dimension ({rows});"
                             f" got {splits}.")
    return _alltoall(tensor, name, splits)


def reducescatter(tensor, op, name, prescale_factor, postscale_factor):
    _rows(tensor, "reducescatter")
    return _reducescatter(tensor, name, int(op), float(prescale_factor),
                          float(postscale_factor))


def barrier(name):
    _capi.Handle(_capi.OP_BARRIER, name, _capi.DTYPES[np.dtype(np.uint8)],
                 (), None, None).wait()


def join(name):
    return _host.host_join(name)
