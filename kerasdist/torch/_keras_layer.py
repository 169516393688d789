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
from kerasdist.torch import _shard_overlap
from kerasdist.torch import collectives as _torch_collectives

# The most bytes of gathered results the sharded optimizer's allgathers
# may have in flight at once (`Torch.gather_each`).
GATHER_AHEAD_BYTES = 16 << 20


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

    def eager(self, fn):
        return torch.compiler.disable(fn)

    def nbytes(self, x):
        return x.numel() * x.element_size()

    def gather_rows(self, row, size, name):
        return _torch_collectives.shard_gather(row, name, size)

    def scatter_rows(self, rows, name):
        return _torch_collectives.shard_scatter(rows, name)

    def gather_whole(self, flat, shapes, numels, chunks, size, gather_name,
                     grad_name):
        # The Keras-ops form's steps in torch's own ops, about a tenth of
        # their Python each (a dozen a layer and step).
        every = _WholeRows.apply(flat, size, gather_name, grad_name)
        pieces = ([every] if len(chunks) == 1
                  else torch.split(every, list(chunks), dim=1))
        wholes = []
        for piece, shape, numel, chunk in zip(pieces, shapes, numels,
                                              chunks):
            if size * chunk != numel:  # padded
                piece = piece.reshape(-1)[:numel]
            wholes.append(piece.reshape(tuple(shape)))
        return wholes

    def put(self, variable, value):
        # Keras' own assign ends in this copy (its _direct_assign), after
        # a conversion and checks that a tensor of the variable's shape
        # and dtype does not need: a tenth of a millisecond a variable.
        # Inside a StatelessScope (`stateless_apply`) the scope takes the
        # value, as Keras' assign has it.
        from keras.src.backend.common.stateless_scope import in_stateless_scope

        if in_stateless_scope():
            variable.assign(value)
            return
        with torch.no_grad():
            variable.value.copy_(value)

    def gather_each(self, rows, names, size):
        # Started ahead, up to GATHER_AHEAD_BYTES of results in flight
        # (each is as large as the weights it covers): the core negotiates
        # and runs them back to back while this thread assigns the ones
        # that have arrived, not one round trip each. Eager only (a
        # compiled step calls the ops one at a time).
        if torch.compiler.is_compiling():
            yield from super().gather_each(rows, names, size)
            return
        pending, waiting = [], 0
        try:
            for row, name in zip(rows, names):
                nbytes = size * self.nbytes(row)
                while pending and waiting + nbytes > GATHER_AHEAD_BYTES:
                    handle, held = pending.pop(0)
                    waiting -= held
                    yield handle.wait()
                pending.append(
                    (_torch_collectives.PendingAllgather(row, name, size),
                     nbytes))
                waiting += nbytes
            while pending:
                yield pending.pop(0)[0].wait()
        finally:
            # Left early (the caller failed): the core still reads the
            # inputs of what was started; they live until it is done.
            for handle, _ in pending:
                try:
                    handle.wait()
                except Exception:  # noqa: BLE001 - the caller's error wins
                    pass


class _WholeRows(torch.autograd.Function):
    """Every rank's row of sharded weights (`Torch.gather_whole`): one
    allgather forward, one reduce-scatter (the average) of the whole
    gradients' buffer backward."""

    @staticmethod
    def forward(ctx, flat, size, gather_name, grad_name):
        ctx.size, ctx.grad_name = size, grad_name
        return _torch_collectives.shard_gather(flat.reshape(1, -1),
                                               gather_name, size)

    @staticmethod
    def backward(ctx, upstream):
        mine = _torch_collectives.shard_scatter(
            upstream.reshape(ctx.size, -1), ctx.grad_name)
        return mine.reshape(-1), None, None, None


class Overlap:
    """An optimizer's PyTorch overlap state: `buckets`, the
    `kerasdist.torch._overlap.GradientBuckets` whose hooks act on its
    variables (None until installed)."""

    def __init__(self):
        self.buckets = None
        self.shards = None

    def reset(self):
        """Removes the hooks: the next `take` (or `take_shards`) installs
        them again, for the backward pass after it (as at the first
        step)."""
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None
        if self.shards is not None:
            self.shards.remove()
            self.shards = None

    def take_shards(self, grads, variables, layout, settings):
        """The sharded optimizer's (`kerasdist.keras.sharding.optimizer`):
        what the hooks reduce-scattered of `grads` (one per variable of
        `layout`, None where a variable has none) during backprop, as
        `(shards, rest)`: `shards` holds this rank's reduced shard where
        the hooks served, `rest` the indices the optimizer reduce-scatters
        synchronously (all of them at first). Installed at the first call
        (or when the variables or the layout change), to act from the
        next backward pass on, where they can serve: several ranks, not
        inside `torch.compile`, one backward pass a step, and gradients
        that are the variables' `.grad` (Keras' torch `fit`, or a loop
        that calls `loss.backward()` then `apply` with them)."""
        everything = [i for i, g in enumerate(grads) if g is not None]
        shards = self.shards
        key = (tuple(id(v) for v in variables), id(layout))
        if torch.compiler.is_compiling():
            if shards is not None:
                shards.drain()
            return [None] * len(grads), everything
        if shards is not None and shards.key != key:
            shards.remove()
            shards = self.shards = None
        if shards is None:
            self.shards = _install_shards(grads, variables, key, layout,
                                          settings)
            return [None] * len(grads), everything
        return shards.collect(grads)

    def install_shards(self, variables, layout, settings):
        """Installs the sharded optimizer's hooks when it is built, before
        the first backward pass (`model.fit` builds it first): so the
        first step releases the whole gradients too (see `take_shards`)."""
        if self.shards is None and not torch.compiler.is_compiling():
            self.shards = _install_shards(
                None, variables, (tuple(id(v) for v in variables),
                                  id(layout)), layout, settings)

    def take(self, grads, variables, prefix, compression, op, predivide,
             bucket_bytes):
        """PyTorch: what the hooks reduced of `grads` (of `variables`)
        during backprop, as `(out, rest)`: `out` is `grads` with the
        reduced ones in place, `rest` the positions still to reduce (the
        optimizer reduces them synchronously). At the first call, or when
        the variables change, the hooks are (re)installed, to act from the
        next backward pass on, and that call's gradients go through their
        buckets, started there (every rank alike). Hooks are
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
            self.buckets = buckets = _install(
                grads, variables, key, prefix, compression, op, predivide,
                bucket_bytes)
            if buckets is None:
                return list(grads), everything
            # This step's backward ran before the hooks: its buckets start
            # now, as the hooks would have started them (in place where
            # they reduce in place: no second copy of the gradients).
            buckets.start_all([grads[j] for j in buckets.where])
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
    cannot serve (see `Overlap.take`)."""
    from kerasdist.keras.compression import Compression

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
        compression, capi.current_process_set(),
        inplace=op == basics.Average and compression is Compression.none)
    buckets.key, buckets.where = key, where
    return buckets


def _install_shards(grads, variables, key, layout, settings):
    """The ShardBuckets for a sharded optimizer's variables, or None where
    hooks cannot serve (see `Overlap.take_shards`); `grads` None: at
    build, before any gradient."""
    from kerasdist.keras.compression import Compression

    params = [v.value for v in variables]
    if grads is None:  # at build: every trainable parameter
        grads = [p if p.requires_grad else None for p in params]
    elif not all(g is None or (g is p.grad and p.is_leaf)
                 for g, p in zip(grads, params)):
        return None
    if (layout.size == 1 or settings.backward_passes_per_step > 1
            or not all(p.is_leaf for p in params)
            or not any(g is not None for g in grads)):
        return None
    shards = _shard_overlap.ShardBuckets(
        [p if g is not None else None for g, p in zip(grads, params)],
        layout, settings.prefix, settings.compression or Compression.none,
        settings.op, settings.gradient_predivide_factor,
        settings.process_set_id, release=settings.shard == "gradients")
    shards.key = key
    return shards


FRAMEWORK = Torch()
