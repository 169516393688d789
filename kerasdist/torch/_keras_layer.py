"""The Keras layer's PyTorch parts: the `KerasFramework` that
`kerasdist.keras.framework.get()` returns on the PyTorch backend (values
detached, assignments outside autograd), and the optimizer's reduction
overlapped with backprop: buckets started from autograd hooks
(kerasdist/torch/_overlap.py)."""

import torch

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist._core import capi
from kerasdist.keras import framework as _framework
from kerasdist.keras.reduction import source_label
from kerasdist.torch import _overlap
from kerasdist.torch import collectives as _torch_collectives


class Torch(_framework.KerasFramework):
    """The Keras layer on PyTorch (see kerasdist/keras/framework.py)."""

    name = "torch"
    collectives = _torch_collectives

    def value(self, variable):
        return variable.value.detach()

    def no_grad(self):
        return torch.no_grad()

    def overlap(self):
        return Overlap()

    def nbytes(self, x):
        return x.numel() * x.element_size()


class Overlap:
    """An optimizer's PyTorch overlap state: `buckets`, the
    `kerasdist.torch._overlap.GradientBuckets` whose hooks act on its
    variables (None until installed)."""

    def __init__(self):
        self.buckets = None

    def reset(self):
        """Removes the hooks: the next `take` installs them again, for
        the backward pass after it (as at the first step)."""
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None

    def take(self, grads, variables, prefix, compression, op, predivide,
             bucket_bytes):
        """PyTorch: what the hooks reduced of `grads` (of `variables`)
        during backprop, as `(out, rest)`: `out` is `grads` with the
        reduced ones in place, `rest` the positions still to reduce (the
        optimizer reduces them synchronously; all of them at first). At
        the first call, or when the variables change, the hooks are
        (re)installed, to act from the next backward pass on. Hooks are
        installed only where they can be used: several ranks, not inside
        `torch.compile`, not Adasum (whose result depends on what is
        reduced together), and gradients that are the variables' `.grad`
        tensors (Keras' torch `fit`, or a loop that calls
        `loss.backward()` then `apply` with them)."""
        if compression is None:
            from kerasdist.keras.compression import Compression
            compression = Compression.none
        everything = list(range(len(grads)))
        buckets = self.buckets
        if torch.compiler.is_compiling():
            if buckets is not None:
                buckets.drain()
            return list(grads), everything
        key = tuple(id(v) for v in variables)
        if buckets is not None and buckets.key != key:
            buckets.remove()
            buckets = self.buckets = None
        if buckets is None:
            self.buckets = _install(grads, variables, key, prefix,
                                    compression, op, predivide, bucket_bytes)
            return list(grads), everything
        where = buckets.where
        sub, redo = buckets.collect([grads[j] for j in where])
        out = list(grads)
        for j, g in zip(where, sub):
            out[j] = g
        rest = sorted({where[i] for i in redo} | (
            set(everything) - set(where)))
        return out, rest


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
    buckets = _overlap.GradientBuckets(
        params, _overlap.plan_for(
            params, f"{prefix}.overlap", op, predivide, bucket_bytes,
            labels=[source_label(variables[j], j) for j in where]),
        compression, capi.current_process_set())
    buckets.key, buckets.where = key, where
    return buckets


FRAMEWORK = Torch()
