"""What the Keras layer (DistributedOptimizer, the callbacks, data, the
Trainer) does differently on each framework Keras runs on, in one place.

- Gradients: on TensorFlow the TF ops reduce them
  (`kerasdist.tensorflow.gradients`); on JAX and PyTorch the collectives of
  `kerasdist.jax` / `kerasdist.torch` do, on the framework's own arrays:
  inside JAX's jitted, stateless train step as XLA custom calls on tracers,
  in PyTorch's eager step as custom ops.
- Variables (broadcast, model averaging) go through the framework's
  collectives too, so a GPU tensor stays where it is.
- Small control values (metrics, step counts, flags, fingerprints) go
  through the core as numpy arrays on every framework (`_host.host_*`).

Nothing here imports TensorFlow unless the Keras backend is TensorFlow.
"""

import keras
import numpy as np

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist import collectives as _collectives



def current():
    """The framework the Keras backend runs on ("tensorflow", "jax" or
    "torch"); ValueError if kerasdist does not support it."""
    return _collectives.keras_framework()


def jit_compile():
    """The `jit_compile` that fits a train step with kerasdist inside:
    True on JAX (its collectives are XLA custom calls), False elsewhere
    (TensorFlow's ops have no XLA kernel; PyTorch runs eagerly)."""
    return current() == "jax"


def collectives():
    """The public collectives on the running framework's tensors (the
    functions `kerasdist.allreduce`... are)."""
    return _collectives.bound(current())


def value(variable):
    """A Keras variable's current value as the front end takes it."""
    if current() == "torch":
        return variable.value.detach()
    return variable.value


def _no_grad():
    if current() == "torch":
        import torch
        return torch.no_grad()
    import contextlib
    return contextlib.nullcontext()


def assign_broadcast(variables, root_rank, names):
    """Assigns `root_rank`'s value of each variable to it, on every rank
    (one broadcast per variable, named by `names`)."""
    front = collectives()
    with _no_grad():
        for v, n in zip(variables, names):
            v.assign(front.broadcast(value(v), root_rank, name=n))


def assign_average(variables, name):
    """Replaces each variable by its average over the ranks: one grouped
    allreduce, then the assignments. Returns a function that does it (on
    TensorFlow a `tf.function`, traced once)."""
    front = collectives()
    if current() == "tensorflow":
        import tensorflow as tf

        @tf.function
        def average_tf():
            values = front.grouped_allreduce(
                [tf.convert_to_tensor(v) for v in variables],
                op=basics.Average, name=name)
            for v, x in zip(variables, values):
                v.assign(x)

        return average_tf

    def average():
        with _no_grad():
            values = front.grouped_allreduce(
                [value(v) for v in variables], op=basics.Average,
                name=name)
            for v, x in zip(variables, values):
                v.assign(x)

    return average


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


# ---- gradients ---------------------------------------------------------------


def reduce_gradients(grads, variables, prefix, compression=None,
                     op=basics.Average, sparse_as_dense=False,
                     gradient_predivide_factor=1.0, num_groups=0,
                     bucket_bytes=None):
    """Allreduces a flat gradient list (`None` kept) on the running
    backend; see `_tf_gradients.reduce_gradients` (TensorFlow), which this
    mirrors for JAX and PyTorch arrays: one grouped allreduce per group,
    compression around it, predivide as prescale/postscale, nothing
    communicated at size 1. JAX and PyTorch gradients are dense, so
    `sparse_as_dense` changes nothing there. `bucket_bytes` (with
    `num_groups=0`): one grouped allreduce per gradient bucket
    (`kerasdist._buckets.variable_buckets`) instead of one for all, so that
    inside JAX's jitted step each bucket's custom call depends only on its
    own gradients and XLA can start it as soon as they exist."""
    if current() == "tensorflow":
        from kerasdist.tensorflow import gradients as _tf_gradients
        return _tf_gradients.reduce_gradients(
            grads, variables, prefix, compression=compression, op=op,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            num_groups=num_groups, bucket_bytes=bucket_bytes)
    if compression is None:
        from kerasdist.compression import Compression
        compression = Compression.none
    index = [i for i, g in enumerate(grads) if g is not None]
    wires = [compression.compress(grads[i]) for i in index]
    out = list(grads)
    if _process_sets.current_size() == 1 or not index:
        reduced = [w for w, _ in wires]
    else:
        from kerasdist._core.gradients import source_label
        labels = [source_label(variables[i], i) if variables else None
                  for i in index]
        reduced = _grouped([w for w, _ in wires], prefix, op,
                           gradient_predivide_factor, num_groups, labels,
                           bucket_bytes)
    for i, r, (_, ctx) in zip(index, reduced, wires):
        out[i] = compression.decompress(r, ctx)
    return out


def _scales(op, predivide):
    """(op, prescale, postscale) of a gradient allreduce with
    `gradient_predivide_factor`."""
    if predivide != 1.0:
        return (basics.Sum, 1.0 / predivide,
                predivide / _process_sets.current_size())
    return op, 1.0, 1.0


def nbytes(x):
    """A JAX or PyTorch array's size in bytes."""
    if hasattr(x, "element_size"):  # torch
        return x.numel() * x.element_size()
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _grouped(wires, prefix, op, predivide, num_groups, labels,
             bucket_bytes=None):
    from kerasdist._core.gradients import label_members, split_groups
    front = collectives()
    op, prescale, postscale = _scales(op, predivide)
    if bucket_bytes is not None and num_groups == 0:
        from kerasdist import _buckets
        members_list = _buckets.variable_buckets(
            [nbytes(w) for w in wires], [str(w.dtype) for w in wires],
            bucket_bytes)
        names = [f"{prefix}.bucket{k}of{len(members_list)}"
                 for k in range(len(members_list))]
    else:
        groups = num_groups if num_groups > 0 else 1
        members_list = split_groups(len(wires), groups)
        names = [f"{prefix}.group{g}of{groups}"
                 for g in range(len(members_list))]
    reduced = [None] * len(wires)
    for base, members in zip(names, members_list):
        group = unique_name(base)
        label_members(group, [labels[j] for j in members])
        outs = front.grouped_allreduce(
            [wires[j] for j in members], op=op, name=group,
            prescale_factor=prescale, postscale_factor=postscale)
        for j, r in zip(members, outs):
            reduced[j] = r
    return reduced


# ---- PyTorch: buckets started from autograd hooks ----------------------------


class Overlap:
    """An optimizer's PyTorch overlap state: `buckets`, the
    `kerasdist.torch._overlap.GradientBuckets` whose hooks act on its
    variables (None until installed)."""

    def __init__(self):
        self.buckets = None

    def reduce(self, grads, variables, plain, prefix, compression, op,
               predivide, bucket_bytes):
        """PyTorch: `grads` of `variables` reduced, taking the buckets that
        the hooks started during backprop, and `plain(grads, variables)`
        (the synchronous reduction) for the rest. At the first call, or
        when the variables change, the hooks are (re)installed, to act from
        the next backward pass on. Hooks are installed only where they can
        be used: several ranks, not inside `torch.compile`, not Adasum
        (whose result depends on what is reduced together), and gradients
        that are the variables' `.grad` tensors (Keras' torch `fit`, or a
        loop that calls `loss.backward()` then `apply` with them)."""
        import torch

        if compression is None:
            from kerasdist.compression import Compression
            compression = Compression.none
        buckets = self.buckets
        if torch.compiler.is_compiling():
            if buckets is not None:
                buckets.drain()
            return plain(grads, variables)
        key = tuple(id(v) for v in variables)
        if buckets is not None and buckets.key != key:
            buckets.remove()
            buckets = self.buckets = None
        if buckets is None:
            out = plain(grads, variables)
            self.buckets = _install(grads, variables, key, prefix,
                                    compression, op, predivide, bucket_bytes)
            return out
        where = buckets.where
        sub, redo = buckets.collect([grads[j] for j in where])
        out = list(grads)
        for j, g in zip(where, sub):
            out[j] = g
        rest = sorted({where[i] for i in redo} | (
            set(range(len(grads))) - set(where)))
        if rest:
            for j, g in zip(rest, plain([grads[j] for j in rest],
                                        [variables[j] for j in rest])):
                out[j] = g
        return out


def _install(grads, variables, key, prefix, compression, op, predivide,
             bucket_bytes):
    """The GradientBuckets for these variables, or None where hooks
    cannot serve (see `Overlap.reduce`)."""
    if _process_sets.current_size() == 1 or op == basics.Adasum:
        return None
    where = [j for j, g in enumerate(grads) if g is not None]
    params = [variables[j].value for j in where]
    if not where or not all(
            grads[j] is p.grad and p.is_leaf for j, p in zip(where, params)):
        return None
    from kerasdist._core import capi
    from kerasdist._core.gradients import source_label
    from kerasdist.torch import _overlap
    op, prescale, postscale = _scales(op, predivide)
    buckets = _overlap.GradientBuckets(
        params, f"{prefix}.overlap", op, prescale, postscale, compression,
        capi.current_process_set(), bucket_bytes,
        labels=[source_label(variables[j], j) for j in where])
    buckets.key, buckets.where = key, where
    return buckets


def unique_name(base):
    """`base`, made unique within the JAX program being traced (several
    collectives of one jitted step may run at once, so two must never
    share a name); unchanged eagerly and on the other backends, where
    collectives of one name run one after the other."""
    if current() != "jax":
        return base
    from kerasdist.jax._dispatch import program_trace, auto_name
    if program_trace() is None:
        return base
    return auto_name(base, None)


def agree_finite(finite, prefix):
    """A LossScaleOptimizer's finiteness flag, True only if it is True on
    every rank (one allreduce Min), as a tensor of the running backend."""
    if current() == "tensorflow":
        from kerasdist.tensorflow import optimizer as _optimizer_tf
        return _optimizer_tf.agree_finite(finite, prefix)
    front = collectives()
    flag = keras.ops.cast(finite, "int32")
    agreed = front.allreduce(flag, op=basics.Min,
                             name=unique_name(f"{prefix}.loss_scale_finite"))
    return keras.ops.greater(agreed, 0)
