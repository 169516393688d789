"""DistributedOptimizer's classes: what a wrapped Keras optimizer does,
written once for every Keras backend.

Where the allreduce goes. On Keras 3 every path that updates weights goes
through `Optimizer.apply(grads, trainable_variables)`:

- `model.fit` (TF trainer `train_step`) and custom loops call
  `apply_gradients` (which calls `apply`) or `apply`;
- `LossScaleOptimizer.apply` checks finiteness and calls its inner
  optimizer's `apply`;
- Keras' JAX train step calls `stateless_apply` (which calls `apply`,
  except a `LossScaleOptimizer`'s): the wrapper reduces there too, once.

`apply` then filters empty gradients, unscales, and calls
`_backend_apply_gradients`, which clips (`clipnorm`, `clipvalue`,
`global_clipnorm`), applies weight decay and runs `update_step`. Horovod's
Keras wrapper hooked `_compute_gradients`/`get_gradients`, which Keras 3
never calls, so it trained without averaging. Reducing at the top of `apply`
means that clipping, loss-scale finiteness checks and every update see the
averaged gradient, identically on every rank.

The classes, as Keras chooses one optimizer class per backend and each
overrides a few hooks: `DistributedBase` holds what both modes share (the
settings, local variables, the overlap state, mixed precision's agreed
finiteness check); `ReplicatedStep` (here) and `ShardedStep`
(kerasdist/keras/sharding/optimizer.py) are its two steps, siblings.
`DistributedOptimizer()` (kerasdist/keras/distributed_optimizer.py)
combines one of them with the user's optimizer class, so that the result
is an instance of that class and saves under its name.

The reduction (`kerasdist.keras.reduction`, written once) runs on the
Keras backend's own tensors through the backend's `KerasFramework`
(`kerasdist.keras.framework.get()`): TF ops on TensorFlow, XLA custom
calls in JAX's jitted step, `kerasdist.torch`'s custom ops in PyTorch's
eager step. Nothing here asks which framework runs.
"""

import sys

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist.keras import framework as _framework
from kerasdist.keras import reduced as _reduced
from kerasdist.keras import reduction as _reduction

# The most bytes of variables one call of the Keras optimizer's update
# takes (see DistributedBase._backend_update_step).
UPDATE_BYTES = 16 << 20


def _nbytes(variable):
    import math

    from kerasdist.keras.sharding.layout import itemsize
    return math.prod(variable.shape) * itemsize(
        str(variable.dtype).replace("torch.", ""))


class _UpdateGroups:
    """The bounds [start, stop) of the groups of `variables` (in order)
    that `DistributedBase._backend_update_step` updates one call each:
    each closes once it holds UPDATE_BYTES or more, the last at the end.
    Computed once for a list of variables (the same every step). A plain
    object: Keras' optimizer tracks lists and tuples set on it, and would
    take these variables for its own."""

    def __init__(self, variables):
        self.variables = list(variables)
        self.bounds, start, size = [], 0, 0
        for i, v in enumerate(self.variables):
            size += _nbytes(v)
            if size >= UPDATE_BYTES or i == len(self.variables) - 1:
                self.bounds.append((start, i + 1))
                start, size = i + 1, 0

    def of(self, variables):
        """Whether these groups are those of `variables`."""
        return len(variables) == len(self.variables) and all(
            a is b for a, b in zip(variables, self.variables))


def _large_blocks_from_mmap():
    """Has glibc return a step's large freed blocks at once
    (kerasdist.keras.sharding.malloc.return_large_blocks): PyTorch's
    replicated resident set, 25M MLP at np=2, stays at 16.8 bytes a
    parameter between steps instead of growing to 31.9 over 3 steps. Not
    on JAX: XLA's CPU step allocates its temporaries anew each step, and
    each one of 1 MiB or more then comes from mmap, page-faulted again:
    the W3 MLP-20's replicated step took 1.3-1.4x as long at np=1 (1.1x
    at np=2). `kd.shard_weights` sets it on every backend."""
    from kerasdist.keras.sharding.malloc import return_large_blocks

    if _framework.get().mmap_large_blocks:
        return_large_blocks()


class DistributedBase:
    """What a DistributedOptimizer of either mode adds to the user's Keras
    optimizer class, placed before it in the combined class's bases.

    Attributes:
        _kerasdist_settings: the wrapper's arguments, set on the combined
            class by `DistributedOptimizer()`.
    """

    _kerasdist_settings = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _large_blocks_from_mmap()
        self._kerasdist_accum = None
        self._kerasdist_reduced = False
        self._kerasdist_local = _reduction.LocalVariables()
        self._kerasdist_overlap = _framework.get().overlap()

    def register_local_var(self, var):
        """Keeps `var`'s gradient on this rank: it is not reduced
        (divided by `size()` unless `scale_local_gradients=False`).
        Every rank must register the same variables."""
        self._kerasdist_local.add_variable(var, "register_local_var")
        restart_overlap(self)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "loss_scale_factor":
            # `LossScaleOptimizer.__init__` sets this on its inner
            # optimizer: the only moment Keras shows us the wrapper.
            # A guarded frame lookup, never an error if it changes.
            try:
                caller = sys._getframe(1).f_locals.get("self")
            except (AttributeError, ValueError):  # pragma: no cover
                caller = None
            _adopt_loss_scale_optimizer(caller, self)

    def _backend_update_step(self, grads, trainable_variables,
                             learning_rate):
        # The update in groups of at most UPDATE_BYTES of variables:
        # Keras' PyTorch optimizers update a whole list at once
        # (torch._foreach), with several temporaries of the list's size
        # alive together (Adam: 16 bytes a parameter of float32 for the
        # whole model); in groups the temporaries are one group's. Every
        # backend's update is per variable, so the groups change nothing
        # else. Computed once per list of variables (the same each step).
        grads, variables = list(grads), list(trainable_variables)
        groups = getattr(self, "_kerasdist_update_groups", None)
        if groups is None or not groups.of(variables):
            groups = _UpdateGroups(variables)
            self._kerasdist_update_groups = groups
        for start, stop in groups.bounds:
            super()._backend_update_step(grads[start:stop],
                                         variables[start:stop],
                                         learning_rate)


class ReplicatedStep(DistributedBase):
    """The replicated step: every rank holds the whole optimizer state;
    `apply` reduces the gradients over the ranks, then runs the user's
    optimizer's own `apply` on them."""

    def build(self, variables):
        from kerasdist.keras.sharding import weights as _weights
        _weights.check_mode(variables, None)
        super().build(variables)
        settings = self._kerasdist_settings
        # Once, as Keras' own state: a LossScaleOptimizer builds its
        # inner optimizer again, and new sums would drop a partial one.
        if (settings.backward_passes_per_step > 1
                and self._kerasdist_accum is None):
            self._kerasdist_accum = _framework.get().accumulators(
                self._trainable_variables)

    def apply(self, grads, trainable_variables=None):
        settings = self._kerasdist_settings
        framework = _framework.get()
        framework.check_apply()
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        elif self.built:
            variables = self._trainable_variables
        else:  # let Keras raise its own error
            return super().apply(grads, trainable_variables)
        if not grads or self._kerasdist_reduced:
            return super().apply(grads, trainable_variables)
        if settings.backward_passes_per_step == 1:
            reduced = self._kerasdist_reduce(grads, variables)
            return super().apply(reduced, trainable_variables)

        if not self.built:
            framework.build_optimizer(self, variables)
        acc = self._kerasdist_accum
        # super() needs the enclosing method's frame; bind it here.
        parent_apply = super().apply
        return _reduction.accumulate(
            framework,
            [acc.grads[self._get_variable_index(v)] for v in variables],
            acc.count, grads, settings.backward_passes_per_step,
            settings.average_aggregated_gradients,
            lambda summed: self._kerasdist_reduce(summed, variables),
            lambda reduced: parent_apply(reduced, trainable_variables))

    def stateless_apply(self, optimizer_variables, grads,
                        trainable_variables):
        # JAX's train step comes here, not to `apply`; and a
        # LossScaleOptimizer's stateless_apply never calls `apply`.
        # Reduce once, here, whatever the class does next.
        if not self.built or self._kerasdist_reduced:
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables)
        grads = self._kerasdist_reduce(list(grads),
                                       self._trainable_variables)
        self._kerasdist_reduced = True
        try:
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables)
        finally:
            self._kerasdist_reduced = False

    def _kerasdist_reduce(self, grads, variables):
        """`grads` reduced over the optimizer's ranks; the local
        variables' kept (or divided by `size()`)."""
        settings = self._kerasdist_settings
        ps = settings.process_set_id
        member = _capi.process_set_rank(ps) if ps else 0
        if member == -2:
            # Not a rank outside the set: a set that no longer exists.
            raise ValueError(
                f"DistributedOptimizer(process_set=...): process set {ps} "
                "does not exist any more (removed, or dropped when "
                "kerasdist shut down or the job re-formed in place after "
                "a lost rank); add the set again and wrap the optimizer "
                "again with the ProcessSet add_process_set returns.")
        if member < 0:
            return grads  # outside the set: its own gradients (Horovod)
        keep, local = self._kerasdist_local.split(variables)
        with _capi.process_set_scope(ps):
            reduced = self._kerasdist_reduce_all(
                [grads[i] for i in keep], [variables[i] for i in keep])
            return _reduction.with_local(grads, keep, reduced, local,
                                         settings.scale_local_gradients)

    def _kerasdist_reduce_all(self, grads, variables):
        settings = self._kerasdist_settings
        framework = _framework.get()
        overlap = self._kerasdist_overlap if settings.overlap else None
        if overlap is None:
            return _reduction.reduce_gradients(
                grads, variables, settings.prefix, framework,
                compression=settings.compression, op=settings.op,
                sparse_as_dense=settings.sparse_as_dense,
                gradient_predivide_factor=settings.gradient_predivide_factor,
                num_groups=settings.num_groups,
                bucket_bytes=framework.bucket_bytes(settings))
        # PyTorch: the buckets the autograd hooks started; the rest
        # reduced here.
        out, rest = overlap.take(
            grads, variables, settings.prefix, settings.compression,
            settings.op, settings.gradient_predivide_factor,
            settings.bucket_bytes)
        if rest:
            done = _reduction.reduce_gradients(
                [grads[j] for j in rest], [variables[j] for j in rest],
                settings.prefix, framework,
                compression=settings.compression, op=settings.op,
                sparse_as_dense=settings.sparse_as_dense,
                gradient_predivide_factor=settings.gradient_predivide_factor,
                num_groups=settings.num_groups,
                bucket_bytes=framework.bucket_bytes(settings))
            for j, g in zip(rest, done):
                out[j] = g
        return out


def add_local_layers(optimizer, layers):
    """Keeps the gradients of `layers`' trainable weights on each rank
    (`PartialDistributedOptimizer`'s `local_layers`)."""
    optimizer._kerasdist_local.add_layers(layers)
    restart_overlap(optimizer)


# ---- what other modules ask of an optimizer ----------------------------------


def restart_overlap(optimizer):
    """Drops `optimizer`'s reduction overlapped with backprop (PyTorch's
    autograd hooks): its next step installs it again, as a new optimizer's
    first does (after a grow in place, where the new ranks' optimizers are
    new; after the local variables changed: the hooks reduce in place).
    Nothing for other optimizers."""
    overlap = getattr(optimizer, "_kerasdist_overlap", None)
    if overlap is not None:
        overlap.reset()


def is_distributed(optimizer):
    """Whether `optimizer` averages gradients across ranks: a
    DistributedOptimizer, replicated or sharded, or a wrapper around one
    (a LossScaleOptimizer)."""
    return settings_of(optimizer) is not None


def settings_of(optimizer):
    """The settings of a DistributedOptimizer, or of the one inside a
    wrapper (a LossScaleOptimizer); None for any other optimizer."""
    while optimizer is not None:
        settings = getattr(optimizer, "_kerasdist_settings", None)
        if settings is not None:
            return settings
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def replicated(variables):
    """`variables` without the shards of sharded weights
    (`kerasdist.shard_weights`): each rank holds its own by design, so
    they are never broadcast, averaged or compared between ranks."""
    return [v for v in variables
            if getattr(v, "_kerasdist_weight", None) is None]


def whole_variables(optimizer):
    """`optimizer.variables` without those that hold only this rank's
    shard (a sharded optimizer's slots, its own or an inner optimizer's,
    as inside a LossScaleOptimizer): what every rank holds alike, to
    broadcast, average or compare."""
    skip, inner = set(), optimizer
    while inner is not None:
        skip.update(id(v) for v in
                    getattr(inner, "kerasdist_sharded_variables", ()))
        inner = getattr(inner, "inner_optimizer", None)
    return [v for v in optimizer.variables if id(v) not in skip]


def sharded_in(optimizer):
    """The sharded optimizer in `optimizer` (itself, or the inner optimizer
    of a LossScaleOptimizer), or None."""
    while optimizer is not None:
        if getattr(getattr(optimizer, "_kerasdist_settings", None), "shard",
                   None) is not None:
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def shard_state(optimizer):
    """The state of the sharded optimizer in `optimizer` (its `layout`,
    `rank` and `slot_index(variable)`), or None where there is none or it
    is not built yet."""
    sharded = sharded_in(optimizer)
    if sharded is None or not sharded.built:
        return None
    return sharded.kerasdist_shard_state


class whole_state:
    """A context in which a sharded optimizer in `optimizer` saves its
    state whole, in the plain optimizer's layout (`model.save`,
    `save_weights` on the `writer` rank): a collective, which every rank
    of the optimizer's set enters. The slots are allgathered one at a
    time: on the writer as Keras writes each (so it never holds the whole
    state at once: a save's peak stays below the replicated optimizer's),
    on the other ranks as they enter. Nothing for any other optimizer.

    Raises RuntimeError naming the cause when a gather fails, which is
    what a save called on some ranks only meets (the Horovod habit of
    saving under `if rank() == 0`). `writer=None`: every rank saves (and
    streams) alike, as with sharded weights (`kerasdist.shard_weights`),
    whose whole values every rank gathers in the order its save reads
    them."""

    def __init__(self, optimizer, writer=0, what="kerasdist.save_model"):
        self.sharded = sharded_in(optimizer)
        self.writer, self.what = writer, what
        self.values = None

    def __enter__(self):
        if self.sharded is None or not self.sharded.built:
            return self
        self.values = _Streamed(self.sharded.kerasdist_whole_values(),
                                self.what)
        if self.writer is None or basics.rank() == self.writer:
            self.sharded.kerasdist_shard_state.whole = self.values
        else:
            self.values.drain()
        return self

    def __exit__(self, exc_type, *exc):
        if self.values is None:
            return False
        self.sharded.kerasdist_shard_state.whole = None
        # The writer's save may have stopped before the optimizer (or
        # written a format that does not ask for it): the other ranks
        # still wait in the remaining gathers.
        try:
            self.values.drain()
        except RuntimeError:
            if exc_type is None:
                raise
        return False


class _Streamed:
    """The whole values, gathered as they are iterated; a failed gather
    raises one RuntimeError naming the likely cause."""

    def __init__(self, values, what):
        self._values, self._what = values, what

    def __iter__(self):
        while True:
            try:
                value = next(self._values)
            except StopIteration:
                return
            except Exception as e:
                cause = str(e).strip().splitlines()[0] if str(e) else ""
                raise RuntimeError(
                    f"{self._what}: with a sharded optimizer (shard=...) "
                    "every rank must call it: each holds a shard of the "
                    "optimizer's state, gathered here, and rank 0 writes "
                    "the file. Call it on every rank, not under `if "
                    f"kd.rank() == 0`. (The gather failed: "
                    f"{type(e).__name__}: {cause[:300]})") from e
            yield value

    def drain(self):
        for _ in self:
            pass


# ---- mixed precision: LossScaleOptimizer around a DistributedOptimizer ------

_synced_classes = {}


def _adopt_loss_scale_optimizer(wrapper, inner):
    """Gives a LossScaleOptimizer built around `inner` a rank-agreed
    finiteness check (see DistributedOptimizer's docstring)."""
    import keras

    if not isinstance(wrapper, keras.optimizers.LossScaleOptimizer):
        return
    if getattr(wrapper, "inner_optimizer", None) is not inner:
        return
    # No backprop hooks releasing the gradients it unscales (sharding).
    inner._kerasdist_loss_scaled = True
    restart_overlap(inner)
    base = type(wrapper)
    if getattr(base, "_kerasdist_synced", False):
        return
    if base not in _synced_classes:
        _synced_classes[base] = combined(SyncedLossScale, base)
    wrapper.__class__ = _synced_classes[base]


class SyncedLossScale:
    """What a LossScaleOptimizer around a DistributedOptimizer gets: a
    finiteness check agreed over the ranks (one allreduce Min), so every
    rank skips or applies a step together."""

    _kerasdist_synced = True

    def apply(self, grads, trainable_variables=None):
        # A DistributedGradientTape's gradients stay known as reduced
        # once unscaled, so a sharded inner optimizer slices them
        # rather than reducing them again (kerasdist.keras.reduced).
        grads = list(grads)
        sets = [_reduced.process_set_of(g) for g in grads]
        if all(s is None for s in sets):
            return super().apply(grads, trainable_variables)
        _reduced.pass_on(sets)
        try:
            return super().apply(grads, trainable_variables)
        finally:
            _reduced.pass_on(None)

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        if basics.size() == 1:
            return finite
        # Min over ranks: finite only if every rank's gradients are.
        prefix = settings_of(self.inner_optimizer).prefix
        return _framework.get().agree_finite(finite, prefix)


def combined(step, base, settings=None):
    """The class `step` placed before `base` (the user's optimizer class),
    with `settings` (a DistributedOptimizer's), named as `base`: instances
    are `base`'s (`isinstance` holds) and a saved file names `base`, so it
    loads without kerasdist."""

    class Combined(step, base):
        if settings is not None:
            _kerasdist_settings = settings

    Combined.__name__ = base.__name__
    Combined.__qualname__ = base.__qualname__
    Combined.__module__ = base.__module__
    return Combined
