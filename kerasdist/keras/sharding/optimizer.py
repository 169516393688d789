"""The sharded optimizer (`DistributedOptimizer(opt, shard=...)`): each
rank keeps the optimizer state of its shard of every variable only
(ZeRO-1, `shard="optimizer_state"`), and with `shard="gradients"` the
averaged gradients too: the whole gradients a framework keeps between
steps (PyTorch's `.grad`) are dropped once reduced (ZeRO-2). Written once
for every Keras backend over `keras.ops` and the running framework's
collectives (`kerasdist.keras.framework`).

The sharding package, by job: `layout` (which elements each rank owns),
`step` (the reduce-scatter and allgather of one step), this module (the
sharded step's class), `files` (the shards in checkpoint files),
`buddies` (the shards of an in-memory commit, each also on another rank,
re-partitioned in memory after a recovery in place). What
other modules ask of a sharded optimizer (`shard_state`, `whole_state`,
`whole_variables`) they ask of kerasdist/keras/optimizer.py.

A step, in the sharded class's `apply`: the gradients reduce-scattered
into this rank's shards (`step.scatter`); the rank's shard of each weight
copied into a 1-D "shadow" variable, and the wrapped Keras optimizer,
built on the shadows, runs its usual `apply` on them: clipping (norms
summed over the ranks with one small allreduce), weight decay, the
update, EMA, gradient accumulation, all on the shards; then the updated
shards allgathered back into the weights (`step.gather`).

The optimizer's slots are shaped like the shards; its `iterations` and
learning rate are whole, as in the plain optimizer. The update must be
elementwise: optimizers that look at a whole variable (Lamb's trust ratio,
Adafactor's factored moments, Muon's matrices) are refused.
"""

from kerasdist._core import capi as _capi
from kerasdist.keras import framework as _framework
from kerasdist.keras import reduced as _reduced
from kerasdist.keras import reduction as _reduction
from kerasdist.keras.compression import Compression
from kerasdist.keras.optimizer import DistributedBase
from kerasdist.keras.optimizer import restart_overlap
from kerasdist.keras.sharding import step as _step
from kerasdist.keras.sharding import summary as _summary
from kerasdist.keras.sharding import weights as _weights
from kerasdist.keras.sharding.layout import Layout
from kerasdist.keras.sharding.layout import ShardState
from kerasdist.keras.sharding.layout import size_and_rank


class ShardedStep(DistributedBase):
    """The sharded step (see the module docstring): the sibling of
    `kerasdist.keras.optimizer.ReplicatedStep`, combined with the user's
    optimizer class by `DistributedOptimizer(opt, shard=...)`. Its `apply`
    reduce-scatters, runs the user's class's own `apply` on the shards
    (`super().apply`) and allgathers."""

    def build(self, variables):
        import keras

        settings = self._kerasdist_settings
        if self.built and getattr(self, "_kerasdist_shard", None):
            # Built once, as Keras' optimizers: a LossScaleOptimizer
            # builds its inner optimizer again when it is built itself
            # (the Trainer builds this one before a mixed_float16
            # model's fit builds the wrapper). New shadows would not
            # be the variables the slots were made for.
            return
        variables = list(variables)
        weights = _weights.check_mode(variables, settings.shard)
        size, rank = size_and_rank(settings.process_set_id)
        if rank < 0:
            raise ValueError(
                "DistributedOptimizer(shard=...): this rank is not in the "
                "optimizer's process set; only its members may train "
                "with it.")
        framework = _framework.get()
        if weights:
            # The variables are the shards of the model's weights (1-D):
            # the layout is that of the whole weights, and the optimizer
            # updates the shards themselves.
            layout = Layout([w.shape for w in weights],
                            [w.dtype for w in weights], size,
                            settings.bucket_bytes)
        else:
            layout = Layout([v.shape for v in variables],
                            [keras.backend.standardize_dtype(v.dtype)
                             for v in variables], size,
                            settings.bucket_bytes)
        shadows = list(variables) if weights else []
        for i, v in enumerate([] if weights else variables):
            name = (getattr(v, "path", None) or v.name).replace("/", "_")
            shadow = keras.Variable(
                initializer="zeros", shape=(layout.chunks[i],),
                dtype=layout.dtypes[i], trainable=False,
                name=f"{name}_shard")
            shadow.constraint = None
            shadows.append(shadow)
        self._kerasdist_shard = ShardState(variables, shadows, layout, rank,
                                           framework)
        super().build(shadows)
        _summary.install()
        overlap = self._kerasdist_overlap if settings.overlap else None
        if (overlap is not None and not weights
                and not getattr(self, "_kerasdist_loss_scaled", False)):
            # PyTorch: the backward's hooks from the first step on.
            overlap.install_shards(variables, self._kerasdist_shard.layout,
                                   settings)
        if settings.backward_passes_per_step > 1:
            # The local sums are of the whole gradients.
            self._kerasdist_accum = framework.accumulators(variables)

    def kerasdist_rebuild(self):
        """Builds the optimizer again for the job's size now (after a
        recovery in place re-formed it at another size): new shards and
        slots of the new layout, zero, in the same places among
        `self.variables`; the variables every rank shares (iterations,
        the learning rate) are kept as they are. The caller assigns the
        slots (kerasdist/keras/sharding/buddies.py `recover`). With
        shard="weights" the model's weight shards are laid out at the new
        size first (`buddies.resize_weights`)."""
        state = self._kerasdist_shard
        # PyTorch's backprop hooks work on the old layout: the new build
        # installs them again.
        restart_overlap(self)
        shared = [v for v in self.variables if state.slot_index(v) is None]
        # Keras' tracked list (the Tracker holds it): emptied in place of
        # the old slots, which the new build adds again.
        self._variables[:] = shared
        self._trainable_variables_indices = {}
        self._kerasdist_shard = None
        self.built = False
        self.build(state.variables)

    def add_variable_from_reference(self, reference_variable, *args,
                                    **kwargs):
        # Every slot Keras makes for a shard (moments, momentum, EMA,
        # accumulators) is a shard too: note whose.
        slot = super().add_variable_from_reference(
            reference_variable, *args, **kwargs)
        state = getattr(self, "_kerasdist_shard", None)
        if state is not None:
            state.note_slot(slot, reference_variable)
        return slot

    @property
    def kerasdist_shard_state(self):
        """The `layout.ShardState` (layout, rank, shadows, which optimizer
        variables are slots of which shard), None until built."""
        return getattr(self, "_kerasdist_shard", None)

    @property
    def kerasdist_sharded_variables(self):
        """The optimizer variables that hold only this rank's shard."""
        state = getattr(self, "_kerasdist_shard", None)
        if not self.built or state is None:
            return []
        return [v for v in self.variables
                if state.slot_index(v) is not None]

    def apply(self, grads, trainable_variables=None):
        # PyTorch: outside torch.compile (Keras' jit_compile=True), whose
        # tracing cannot size an allgather's result.
        return _framework.get().eager(self._kerasdist_apply)(
            grads, trainable_variables)

    def _kerasdist_apply(self, grads, trainable_variables):
        settings = self._kerasdist_settings
        framework = _framework.get()
        framework.check_apply()
        grads = list(grads)
        # A LossScaleOptimizer's unscaled tape gradients (pass_on).
        _reduced.take_passed(grads)
        if not self.built:
            if trainable_variables is None:
                return super().apply(grads, trainable_variables)
            self.build(list(trainable_variables))
        state = self._kerasdist_shard
        variables = (state.variables if trainable_variables is None
                     else list(trainable_variables))
        active = state.positions(variables)
        if len(active) < len(state.variables):
            if settings.backward_passes_per_step > 1:
                state.check_variables(variables)  # raises
            # Some of its variables (the Trainer's fine_tune(freeze=),
            # layers made untrainable): the others take no update.
            full = [None] * len(state.variables)
            for k, i in enumerate(active):
                full[i] = grads[k]
            return self._kerasdist_step(full, active)
        if self._kerasdist_local.ids():
            raise ValueError(
                "DistributedOptimizer(shard=...) cannot keep local "
                "variables (register_local_var, local_layers): every "
                "variable's update is split over the ranks.")
        if settings.backward_passes_per_step == 1:
            return self._kerasdist_step(grads)
        acc = self._kerasdist_accum
        return _reduction.accumulate(
            framework, acc.grads, acc.count, grads,
            settings.backward_passes_per_step,
            settings.average_aggregated_gradients,
            lambda summed: summed, self._kerasdist_step)

    def _kerasdist_step(self, grads, active=None):
        import keras

        ops = keras.ops
        settings = self._kerasdist_settings
        state = self._kerasdist_shard
        framework = state.framework
        compression = settings.compression or Compression.none
        layout = state.layout
        if settings.shard == "weights":
            # Reduce-scattered by the backward pass already (the views'
            # gradient, kerasdist.keras.sharding.weights).
            grads = [None if g is None else framework.dense(g)
                     for g in grads]
            if active is None:
                super().apply(grads, state.shadows)
            else:
                super().apply([grads[i] for i in active],
                              [state.shadows[i] for i in active])
            # PyTorch keeps each shard's .grad until the next step.
            state.release(grads, "gradients")
            return
        with _capi.process_set_scope(settings.process_set_id):
            # What a DistributedGradientTape reduced over these ranks
            # each rank slices (no wire, so no compression); the rest
            # is reduce-scattered.
            local = _step.reduced_already(
                grads, settings.process_set_id, settings.op)
            rest = list(grads)
            for i in local:
                rest[i] = None
            # PyTorch: what the backward's hooks reduce-scattered (and,
            # with shard="gradients", released); the rest here.
            early = self._kerasdist_backprop_shards(rest, local)
            for i, shard in enumerate(early):
                if shard is not None:
                    rest[i] = None
            chunks = _step.scatter(
                framework, layout, rest, settings.prefix, compression,
                settings.op, settings.gradient_predivide_factor)
            for i, shard in enumerate(early):
                if shard is not None:
                    chunks[i] = shard
            for i in local:
                chunks[i] = _step.own_shard(
                    ops, framework.dense(grads[i]), layout.numels[i],
                    layout.chunks[i], state.rank)
            state.release(grads, settings.shard)
            with framework.no_grad():
                for i, (v, s) in enumerate(zip(state.variables,
                                               state.shadows)):
                    framework.put(s, _step.shard_of(
                        framework, state.layout, v, i, state.rank))
            # The user's optimizer class's own apply, on the shards.
            if active is None:
                super().apply(chunks, state.shadows)
            else:
                super().apply(
                    [chunks[i] for i in active],
                    [state.shadows[i] for i in active])
            _step.gather(framework, state.layout,
                         [s.value for s in state.shadows], state.variables,
                         settings.prefix)
            for v in state.variables:
                if v.constraint is not None:
                    v.assign(v.constraint(v))

    def _kerasdist_backprop_shards(self, grads, local):
        """This rank's shards that PyTorch's backward hooks reduced, one
        per variable (None where they did not: the synchronous step
        reduces those); all None elsewhere."""
        settings = self._kerasdist_settings
        overlap = self._kerasdist_overlap if settings.overlap else None
        if overlap is None or local:
            return [None] * len(grads)
        state = self._kerasdist_shard
        if getattr(self, "_kerasdist_loss_scaled", False):
            # A LossScaleOptimizer hands on its own (unscaled) copies of
            # the gradients: no hooks (kerasdist.keras.optimizer's
            # `_adopt_loss_scale_optimizer` removed them).
            return [None] * len(grads)
        shards, _ = overlap.take_shards(grads, state.variables,
                                        state.layout, settings)
        return shards

    def stateless_apply(self, optimizer_variables, grads,
                        trainable_variables):
        # Keras' JAX train step: the model's variables' values and the
        # optimizer's come in, their new values go out.
        from keras.src import backend as _backend

        state = self._kerasdist_shard
        mapping = (list(zip(state.variables, trainable_variables))
                   + list(zip(self.variables, optimizer_variables)))
        with _backend.StatelessScope(state_mapping=mapping) as scope:
            self.apply(list(grads), state.variables)
        return ([scope.get_current_value(v) for v in state.variables],
                [scope.get_current_value(v) for v in self.variables])

    def _clip_gradients(self, grads):
        import keras

        ops = keras.ops
        settings = self._kerasdist_settings
        # The norms of whole gradients, from every rank's shard.
        if not ((self.clipnorm and self.clipnorm > 0) or
                (self.global_clipnorm and self.global_clipnorm > 0)):
            return super()._clip_gradients(grads)
        where = [i for i, g in enumerate(grads) if g is not None]
        squares = _step.global_square_sums(
            self._kerasdist_shard.framework, [grads[i] for i in where],
            settings.prefix)
        out = list(grads)
        if self.clipnorm and self.clipnorm > 0:
            for j, i in enumerate(where):
                out[i] = _step.clip_by_norm(ops, grads[i], squares[j],
                                            self.clipnorm)
            return out
        norm = ops.sqrt(ops.sum(squares))
        clip = self.global_clipnorm
        scale = clip * ops.minimum(1.0 / norm, 1.0 / clip)
        scale = scale + (norm - norm)
        for i in where:
            out[i] = grads[i] * ops.cast(scale, grads[i].dtype)
        return out

    def _use_weight_decay(self, variable):
        # Decided by the model's variable (its name, its exclusion).
        state = getattr(self, "_kerasdist_shard", None)
        model_variable = state.model_variable(variable) if state else None
        return super()._use_weight_decay(
            variable if model_variable is None else model_variable)

    def finalize_variable_values(self, var_list):
        settings = self._kerasdist_settings
        if not self.use_ema:
            return
        state = self._kerasdist_shard
        if settings.shard == "weights":
            for s, a in zip(state.shadows,
                            self._model_variables_moving_average):
                s.assign(a)
            return
        with _capi.process_set_scope(settings.process_set_id):
            _step.gather(state.framework, state.layout,
                         [a.value for a in
                          self._model_variables_moving_average],
                         state.variables, f"{settings.prefix}.ema")

    def save_own_variables(self, store):
        import keras

        # A file in the plain optimizer's layout. The slots are spread
        # over the ranks: whole only inside `whole_state` (every rank
        # gathers, one slot at a time as it is written); otherwise what
        # one rank can write is the state every rank shares (step,
        # learning rate), which Keras skips on load with a warning.
        whole = self._kerasdist_shard.whole
        if whole is not None:
            for i, value in enumerate(whole):
                store[str(i)] = value
            return
        _warn_save_once()
        shared = [v for v in self.variables
                  if self._kerasdist_shard.slot_index(v) is None]
        for i, v in enumerate(shared):
            store[str(i)] = keras.ops.convert_to_numpy(v)

    def load_own_variables(self, store):
        # A file in the plain optimizer's layout (written by plain Keras,
        # the replicated optimizer, or a sharded one at any size): each
        # slot takes this rank's shard of the whole value.
        if len(store.keys()) != len(self.variables):
            return super().load_own_variables(store)  # Keras' warning
        self.kerasdist_assign_whole(
            [store[str(i)] for i in range(len(self.variables))])

    def kerasdist_assign_whole(self, values):
        """Assigns the plain optimizer's variable values (`values`, one
        per variable of `self.variables`, whole) to this sharded
        optimizer: its shard of each slot, the shared ones whole."""
        import numpy as np

        state = self._kerasdist_shard
        layout = state.layout
        for v, value in zip(self.variables, values):
            value = np.asarray(value)
            j = state.slot_index(v)
            if j is None:
                v.assign(value)
                continue
            if value.size != layout.numels[j]:
                raise ValueError(
                    f"DistributedOptimizer(shard=...): the saved value of "
                    f"{v.path} has {value.size} elements, but its "
                    f"variable has {layout.numels[j]}: the file is of "
                    "another model.")
            flat = np.zeros(layout.size * layout.chunks[j], value.dtype)
            flat[:value.size] = value.ravel()
            c = layout.chunks[j]
            v.assign(flat[state.rank * c:(state.rank + 1) * c])

    def kerasdist_whole_values(self):
        """The plain optimizer's variable values, whole (numpy), one at a
        time: each slot is allgathered from its shards when the next
        value is asked for, so that a writer holds one whole slot at a
        time, never the whole state. A collective: every rank of the
        optimizer's set asks for every value, in order."""
        import keras

        ops = keras.ops
        settings = self._kerasdist_settings
        state = self._kerasdist_shard
        layout, framework = state.layout, state.framework
        for i, v in enumerate(self.variables):
            j = state.slot_index(v)
            if j is None:
                yield keras.ops.convert_to_numpy(v)
                continue
            with _capi.process_set_scope(settings.process_set_id):
                every = framework.collectives.allgather(
                    ops.reshape(framework.value(v), (1, -1)),
                    name=f"{settings.prefix}.whole_state.{i}")
            flat = keras.ops.convert_to_numpy(every).reshape(-1)
            del every
            yield flat[:layout.numels[j]].reshape(layout.shapes[j])


_warned = []


def _warn_save_once():
    if _warned:
        return
    _warned.append(True)
    import warnings
    warnings.warn(
        "kerasdist: model.save() with a sharded optimizer (shard=...) "
        "keeps the weights but loses the whole optimizer: each rank holds "
        "only a shard of its state, so the file holds fewer optimizer "
        "variables than the optimizer has, and Keras skips all of them on "
        "load (iterations start at 0: learning-rate schedules and warmup "
        "restart, every moment starts afresh). To save it whole, call "
        "kerasdist.save_model(model, path) on every rank.", UserWarning,
        stacklevel=3)
