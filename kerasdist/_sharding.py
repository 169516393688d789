"""The sharded optimizer (`DistributedOptimizer(opt, shard=...)`): each
rank keeps the optimizer state of its shard of every variable only
(ZeRO-1, `shard="optimizer_state"`), and with `shard="gradients"` the
averaged gradients too: the whole gradients a framework keeps between
steps (PyTorch's `.grad`) are dropped once reduced (ZeRO-2). Both reduce
in buckets as backprop produces them. Written once for every Keras
backend over `keras.ops` and the running framework's collectives
(`kerasdist._framework`).

The layout (`Layout`, a pure function of the variables' shapes and dtypes
and the number of ranks): variable i of n_i elements is padded to
N * c_i elements, c_i = ceil(n_i / N), and rank r owns elements
[r * c_i, (r + 1) * c_i). Every rank thus owns 1/N of every variable (the
shards are balanced by bytes to within N - 1 elements a variable), and
every rank's shard of a variable has the same shape, so every rank builds
the same optimizer slots and traces the same program. A padded element
has a zero gradient and a zero weight, which every elementwise optimizer
leaves at zero.

A step, in the sharded class's `apply`:

1. Each gradient, padded, is an N x c_i matrix whose row r is rank r's
   shard; one `reducescatter` leaves each rank its row of the average.
   Gradients of the same bucket (`bucket_bytes`, in backprop order, one
   dtype) whose shards are small (under `ALONE_BYTES`) go side by side in
   one matrix and one `reducescatter`. A gradient that a
   DistributedGradientTape returned, reduced over the same ranks
   (`kerasdist._reduced` knows it by identity), is the same on every rank
   already: each rank slices its row (`own_shard`), with no collective.
2. The rank's shard of each weight is copied into a 1-D "shadow"
   variable, and the wrapped Keras optimizer, built on the shadows, runs
   its usual `apply` on them: clipping (norms summed over the ranks with
   one small allreduce), weight decay, the update, EMA, gradient
   accumulation, all on the shards.
3. `allgather` brings every rank's updated shard back (one per large
   shard, one per bucket of small ones), and each weight is assigned from
   it: identical bits on every rank.

The optimizer's slots are shaped like the shards; its `iterations` and
learning rate are whole, as in the plain optimizer. The update must be
elementwise: optimizers that look at a whole variable (Lamb's trust ratio,
Adafactor's factored moments, Muon's matrices) are refused.

Over 500 lines: the layout, the reduction into shards, the sharded optimizer
class and its shard files all rest on one invariant (which elements each rank
owns, `Layout`); each part is a few short functions, and the class is the one
place Keras' `apply` meets them.
"""

import math
import os

import numpy as np

from kerasdist import _buckets
from kerasdist import _gradient_reduction
from kerasdist import _reduced
from kerasdist import basics
from kerasdist import process_sets as _process_sets

SHARD_MODES = (None, "optimizer_state", "gradients")

# Optimizers whose update of a variable depends on more than each of its
# elements alone: they cannot run on shards.
_WHOLE_VARIABLE = ("Lamb", "Adafactor", "Muon")


def check_shard(shard, base, settings):
    """Raises ValueError for a `shard=` that cannot work with the other
    arguments (`settings`) or the optimizer class `base`."""
    if shard not in SHARD_MODES:
        raise ValueError(
            f"DistributedOptimizer: shard must be None, 'optimizer_state' "
            f"or 'gradients'; got {shard!r}.")
    if shard is None:
        return
    import keras

    if issubclass(base, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "DistributedOptimizer(shard=...) takes the optimizer that "
            "updates the weights, not a LossScaleOptimizer: write "
            "LossScaleOptimizer(DistributedOptimizer(opt, shard=...)), or "
            "use the mixed_float16 policy, which wraps it so by itself.")
    for klass in base.__mro__:
        if klass.__name__ in _WHOLE_VARIABLE:
            raise ValueError(
                f"DistributedOptimizer(shard={shard!r}): {klass.__name__}'s "
                "update of a variable depends on the whole variable, so it "
                "cannot run on shards; use shard=None with it.")
    if settings.op == basics.Adasum:
        raise ValueError(
            f"DistributedOptimizer(shard={shard!r}) cannot use Adasum: its "
            "result depends on whole gradients; use op=Average or Sum.")


def partition(numels, size):
    """The shard length of each variable: ceil(numel / size), at least 1.
    Rank r owns elements [r * c, (r + 1) * c) of the variable flattened and
    zero-padded to size * c elements (a pure function: the same on every
    rank, for a given model and size)."""
    if size < 1:
        raise ValueError(f"partition: size must be >= 1; got {size}.")
    return [max(1, math.ceil(int(n) / size)) for n in numels]


def owned(numel, chunk, rank):
    """The elements [lo, hi) of a variable that `rank` owns (hi == lo
    where its shard is all padding)."""
    lo = min(rank * chunk, numel)
    return lo, min(lo + chunk, numel)


def pieces(numel, chunk, lo, hi):
    """Where elements [lo, hi) of a variable of `numel` elements lie in
    shards of length `chunk` (rank k's shard holds elements
    [k * chunk, (k + 1) * chunk)): a list of (k, start, stop, at), element
    `at + j` of the range being element `start + j` of rank k's shard.
    Re-partitioning a checkpoint written at one size for another reads
    only these pieces (a pure function of the two layouts)."""
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"pieces: bad range [{lo}, {hi}) of {numel}.")
    if chunk < 1:
        raise ValueError(f"pieces: chunk must be >= 1; got {chunk}.")
    out = []
    at = lo
    while at < hi:
        k = at // chunk
        stop = min(hi, (k + 1) * chunk)
        out.append((k, at - k * chunk, stop - k * chunk, at - lo))
        at = stop
    return out


def flat_range(dataset, lo, hi):
    """Elements [lo, hi) of `dataset` (an array-like with a shape, such as
    an h5py dataset) flattened in C order, reading only the rows of its
    first axis that hold them: a rank loads its shard of a whole saved
    variable without reading the rest."""
    import numpy as np

    shape = tuple(dataset.shape)
    if len(shape) <= 1:
        return np.asarray(dataset[lo:hi]).reshape(-1)
    row = math.prod(shape[1:])
    if row == 0 or hi <= lo:
        return np.zeros((0,), dataset.dtype)
    first, last = lo // row, -(-hi // row)
    block = np.asarray(dataset[first:last]).reshape(-1)
    return block[lo - first * row:hi - first * row]


class Layout:
    """Where each variable's shard lies, for `size` ranks.

    Attributes:
        shapes, numels, dtypes: the variables'.
        chunks: each variable's shard length (`partition`).
        buckets: lists of variable indices, one dtype each, reduced and
            gathered together (`bucket_bytes` of them in backprop order,
            or one bucket a dtype).
    """

    def __init__(self, shapes, dtypes, size, bucket_bytes=None):
        self.size = size
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.dtypes = [str(d) for d in dtypes]
        self.chunks = partition(self.numels, size)
        if bucket_bytes:
            sizes = [n * _itemsize(d)
                     for n, d in zip(self.numels, self.dtypes)]
            self.buckets = _buckets.variable_buckets(
                sizes, self.dtypes, bucket_bytes)
        else:
            self.buckets = _dtype_groups(self.dtypes)

    def shard_bytes(self):
        """Bytes of one rank's shards (padding included)."""
        return sum(c * _itemsize(d) for c, d in zip(self.chunks, self.dtypes))


def _itemsize(dtype):
    import numpy as np
    if dtype == "bfloat16":
        return 2
    return np.dtype(dtype).itemsize


def _dtype_groups(dtypes):
    groups = {}
    for i, d in enumerate(dtypes):
        groups.setdefault(d, []).append(i)
    return list(groups.values())


def _size_and_rank(process_set_id):
    if process_set_id:
        return (_process_sets.set_size(process_set_id),
                _process_sets.set_rank(process_set_id))
    return basics.size(), basics.rank()


# ---- the step ---------------------------------------------------------------


# A shard at least this large is reduced and gathered alone: its N x chunk
# rows are the variable itself (padded), so neither side copies a strided
# block, and each collective's output is freed once used. Smaller shards
# share one collective per bucket, their rows side by side.
ALONE_BYTES = 1 << 16


def _rows(ops, tensor, numel, chunk, size):
    """`tensor` flattened, zero-padded and shaped (size, chunk)."""
    flat = ops.reshape(tensor, (-1,))
    pad = size * chunk - numel
    if pad:
        flat = ops.pad(flat, [[0, pad]])
    return ops.reshape(flat, (size, chunk))


def scatter(framework, layout, grads, prefix, compression, op, predivide):
    """This rank's shard of each gradient averaged (or summed) over the
    ranks: one reducescatter per large gradient (its N x chunk rows are
    the gradient itself, padded), one per bucket for the small ones (their
    rows side by side). None where a gradient is None."""
    import keras

    ops = keras.ops
    op, prescale, postscale = _gradient_reduction.scales(op, predivide)
    out = [None] * len(grads)
    count = len(layout.buckets)

    def reduce(matrix, name):
        wire, ctx = compression.compress(matrix)
        mine = framework.collectives.reducescatter(
            wire, op=op, name=framework.unique_name(name),
            prescale_factor=prescale, postscale_factor=postscale)
        return ops.reshape(compression.decompress(mine, ctx), (-1,))

    for k, bucket in enumerate(layout.buckets):
        small = []
        for i in bucket:
            if grads[i] is None:
                continue
            if layout.chunks[i] * _itemsize(layout.dtypes[i]) < ALONE_BYTES:
                small.append(i)
                continue
            out[i] = reduce(_rows(ops, framework.dense(grads[i]),
                                  layout.numels[i], layout.chunks[i],
                                  layout.size), f"{prefix}.shard.v{i}")
        if not small:
            continue
        rows = [_rows(ops, framework.dense(grads[i]), layout.numels[i],
                      layout.chunks[i], layout.size) for i in small]
        matrix = rows[0] if len(rows) == 1 else ops.concatenate(rows, axis=1)
        mine = reduce(matrix, f"{prefix}.shard{k}of{count}")
        start = 0
        for i in small:
            out[i] = mine[start:start + layout.chunks[i]]
            start += layout.chunks[i]
    return out


def gather(framework, layout, shards, targets, prefix):
    """Assigns to each of `targets` (the model's variables) the
    concatenation of every rank's shard (`shards`, this rank's, one per
    variable): one allgather per large shard, one per bucket for the small
    ones."""
    import keras

    ops = keras.ops
    count = len(layout.buckets)
    with framework.no_grad():
        for k, bucket in enumerate(layout.buckets):
            small = []
            for i in bucket:
                if layout.chunks[i] * _itemsize(layout.dtypes[i]) < \
                        ALONE_BYTES:
                    small.append(i)
                    continue
                everyone = framework.collectives.allgather(
                    ops.reshape(shards[i], (1, -1)),
                    name=framework.unique_name(f"{prefix}.gather.v{i}"))
                _assign_whole(ops, layout, i, ops.reshape(everyone, (-1,)),
                              targets[i])
            if not small:
                continue
            parts = [shards[i] for i in small]
            row = parts[0] if len(parts) == 1 else ops.concatenate(parts)
            everyone = framework.collectives.allgather(
                ops.reshape(row, (1, -1)),
                name=framework.unique_name(f"{prefix}.gather{k}of{count}"))
            start = 0
            for i in small:
                chunk = layout.chunks[i]
                block = everyone[:, start:start + chunk]
                start += chunk
                _assign_whole(ops, layout, i, ops.reshape(block, (-1,)),
                              targets[i])


def _assign_whole(ops, layout, i, flat, target):
    if layout.size * layout.chunks[i] != layout.numels[i]:
        flat = flat[:layout.numels[i]]
    target.assign(ops.reshape(flat, layout.shapes[i]))


def shard_of(framework, layout, variable, i, rank):
    """This rank's shard of `variable` (index i), padded."""
    import keras

    return own_shard(keras.ops, framework.value(variable),
                     layout.numels[i], layout.chunks[i], rank)


def own_shard(ops, tensor, numel, chunk, rank):
    """Rank `rank`'s shard of `tensor` (`numel` elements, shards of
    `chunk`), padded: row `rank` of `_rows(ops, tensor, numel, chunk,
    size)`, which a reducescatter of identical tensors would give it,
    sliced without padding the rest."""
    lo, hi = owned(numel, chunk, rank)
    piece = ops.reshape(tensor, (-1,))[lo:hi]
    if hi - lo < chunk:  # the last ranks' shards end in padding
        piece = ops.pad(piece, [[0, chunk - (hi - lo)]])
    return piece


def reduced_already(grads, process_set_id, op):
    """The indices of `grads` that need no reduction: the tensors a
    DistributedGradientTape returned reduced over the optimizer's process
    set (the same ranks; `kerasdist._reduced`), identical on every rank,
    so each rank slices its shard. A gradient reduced over another set
    is not one of them: reduced again, with a warning (a rank outside the
    tape's set cannot know, and every rank must take the same path).

    Raises:
        ValueError: for such gradients with `op` not Average: an
            optimizer with op=Sum would sum the tape's result again.
    """
    from kerasdist._core import capi as _capi

    mine, other = [], None
    for i, g in enumerate(grads):
        ps = _reduced.process_set_of(g)
        if ps is None:
            continue
        if _reduced.same_set(ps, process_set_id, _capi.process_set_ranks):
            mine.append(i)
        else:
            other = ps
    if other is not None:
        _warn_other_set_once(other, process_set_id)
    if mine and op != basics.Average:
        raise ValueError(
            "DistributedOptimizer(shard=..., op=Sum) got gradients that a "
            "DistributedGradientTape has already reduced over the same "
            "ranks; summing them again would multiply them by the number "
            "of ranks. The tape's op decides the reduction: give the "
            "optimizer op=Average (the default), which then uses them as "
            "they are, or hand it a plain tf.GradientTape's gradients.")
    return mine


_warned_sets = []


def _warn_other_set_once(tape_set, optimizer_set):
    if _warned_sets:
        return
    _warned_sets.append(True)
    import warnings
    warnings.warn(
        f"kerasdist: a DistributedGradientTape reduced these gradients over "
        f"process set {tape_set}, but the sharded DistributedOptimizer "
        f"reduces over process set {optimizer_set}: it reduce-scatters "
        "them again (the communication twice over). Give both the same "
        "process_set to skip the second reduction.", UserWarning,
        stacklevel=4)


def global_square_sums(framework, grads, prefix):
    """Each gradient's sum of squares over every rank's shard: one small
    allreduce (Sum) of this rank's partial sums."""
    import keras

    ops = keras.ops
    # float32 at least (half precision sums overflow), float64 where given.
    wide = ("float64" if any(keras.backend.standardize_dtype(g.dtype) ==
                             "float64" for g in grads) else "float32")
    partial = ops.stack([ops.sum(ops.square(ops.cast(g, wide)))
                         for g in grads])
    return framework.collectives.allreduce(
        partial, basics.Sum, framework.unique_name(f"{prefix}.shard_norms"),
        1.0, 1.0)


def sharded_class(base, settings):
    """A subclass of `base` (a DistributedOptimizer class) that shards the
    optimizer state (see the module docstring)."""
    import keras

    ops = keras.ops

    class _ShardedOptimizer(base):

        def build(self, variables):
            from kerasdist import _framework

            if self.built and getattr(self, "_kerasdist_shard", None):
                # Built once, as Keras' optimizers: a LossScaleOptimizer
                # builds its inner optimizer again when it is built itself
                # (the Trainer builds this one before a mixed_float16
                # model's fit builds the wrapper). New shadows would not
                # be the variables the slots were made for.
                return
            variables = list(variables)
            size, rank = _size_and_rank(settings.process_set_id)
            if rank < 0:
                raise ValueError(
                    "DistributedOptimizer(shard=...): this rank is not in the "
                    "optimizer's process set; only its members may train "
                    "with it.")
            framework = _framework.get()
            layout = Layout([v.shape for v in variables],
                            [keras.backend.standardize_dtype(v.dtype)
                             for v in variables], size, settings.bucket_bytes)
            shadows = []
            for i, v in enumerate(variables):
                name = (getattr(v, "path", None) or v.name).replace("/", "_")
                shadow = keras.Variable(
                    initializer="zeros", shape=(layout.chunks[i],),
                    dtype=layout.dtypes[i], trainable=False,
                    name=f"{name}_shard")
                shadow.constraint = None
                shadows.append(shadow)
            self._kerasdist_shard = _Shard(variables, shadows, layout, rank,
                                           framework)
            super().build(shadows)
            if settings.backward_passes_per_step > 1:
                # The local sums are of the whole gradients.
                self._kerasdist_accum = framework.accumulators(variables)

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
        def kerasdist_sharded_variables(self):
            """The optimizer variables that hold only this rank's shard."""
            state = getattr(self, "_kerasdist_shard", None)
            if not self.built or state is None:
                return []
            return [v for v in self.variables
                    if state.slot_index(v) is not None]

        def apply(self, grads, trainable_variables=None):
            from kerasdist import _framework

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
            return _gradient_reduction.accumulate(
                framework, acc.grads, acc.count, grads,
                settings.backward_passes_per_step,
                settings.average_aggregated_gradients,
                lambda summed: summed, self._kerasdist_step)

        def _kerasdist_step(self, grads, active=None):
            from kerasdist._core import capi as _capi
            from kerasdist.compression import Compression

            state = self._kerasdist_shard
            framework = state.framework
            compression = settings.compression or Compression.none
            layout = state.layout
            with _capi.process_set_scope(settings.process_set_id):
                # What a DistributedGradientTape reduced over these ranks
                # each rank slices (no wire, so no compression); the rest
                # is reduce-scattered.
                local = reduced_already(grads, settings.process_set_id,
                                        settings.op)
                rest = list(grads)
                for i in local:
                    rest[i] = None
                chunks = scatter(framework, layout, rest,
                                 settings.prefix, compression, settings.op,
                                 settings.gradient_predivide_factor)
                for i in local:
                    chunks[i] = own_shard(ops, framework.dense(grads[i]),
                                          layout.numels[i], layout.chunks[i],
                                          state.rank)
                state.release(grads, settings.shard)
                with framework.no_grad():
                    for i, (v, s) in enumerate(zip(state.variables,
                                                   state.shadows)):
                        s.assign(shard_of(framework, state.layout, v, i,
                                          state.rank))
                # The user's optimizer class's own apply, on the shards.
                if active is None:
                    super(base, self).apply(chunks, state.shadows)
                else:
                    super(base, self).apply(
                        [chunks[i] for i in active],
                        [state.shadows[i] for i in active])
                gather(framework, state.layout,
                       [s.value for s in state.shadows], state.variables,
                       settings.prefix)
                for v in state.variables:
                    if v.constraint is not None:
                        v.assign(v.constraint(v))

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
            # The norms of whole gradients, from every rank's shard.
            if not ((self.clipnorm and self.clipnorm > 0) or
                    (self.global_clipnorm and self.global_clipnorm > 0)):
                return super()._clip_gradients(grads)
            where = [i for i, g in enumerate(grads) if g is not None]
            squares = global_square_sums(
                self._kerasdist_shard.framework, [grads[i] for i in where],
                settings.prefix)
            out = list(grads)
            if self.clipnorm and self.clipnorm > 0:
                for j, i in enumerate(where):
                    out[i] = _clip_by_norm(ops, grads[i], squares[j],
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
            if not self.use_ema:
                return
            state = self._kerasdist_shard
            from kerasdist._core import capi as _capi
            with _capi.process_set_scope(settings.process_set_id):
                gather(state.framework, state.layout,
                       [a.value for a in
                        self._model_variables_moving_average],
                       state.variables, f"{settings.prefix}.ema")

        def save_own_variables(self, store):
            # A file in the plain optimizer's layout. The slots are spread
            # over the ranks: whole only inside `whole_state` (every rank
            # gathers); otherwise what one rank can write is the state every
            # rank shares (step, learning rate), which Keras skips on load
            # with a warning, starting the slots afresh.
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

        def kerasdist_gather_whole(self):
            """The plain optimizer's variable values, whole (numpy), on
            every rank: each slot allgathered from its shards. A
            collective: every rank of the optimizer's set calls it."""
            from kerasdist._core import capi as _capi

            state = self._kerasdist_shard
            layout, framework = state.layout, state.framework
            out = []
            with _capi.process_set_scope(settings.process_set_id):
                for i, v in enumerate(self.variables):
                    j = state.slot_index(v)
                    if j is None:
                        out.append(keras.ops.convert_to_numpy(v))
                        continue
                    every = framework.collectives.allgather(
                        ops.reshape(framework.value(v), (1, -1)),
                        name=f"{settings.prefix}.whole_state.{i}")
                    flat = keras.ops.convert_to_numpy(every).reshape(-1)
                    out.append(flat[:layout.numels[j]].reshape(
                        layout.shapes[j]))
            return out

    return _ShardedOptimizer


_warned = []


def _warn_save_once():
    if _warned:
        return
    _warned.append(True)
    import warnings
    warnings.warn(
        "kerasdist: a sharded optimizer's state (shard=...) is spread over "
        "the ranks; a saved model holds its weights, and of the optimizer "
        "only what every rank shares, not its slots: loading it starts "
        "them afresh.", UserWarning, stacklevel=3)


def _clip_by_norm(ops, grad, square_sum, clipnorm):
    """Keras' `_clip_by_norm` with the whole gradient's sum of squares."""
    square_sum = ops.cast(square_sum, grad.dtype)
    positive = square_sum > 0
    safe = ops.where(positive, square_sum, ops.ones_like(square_sum))
    norm = ops.where(positive, ops.sqrt(safe), square_sum)
    return ops.convert_to_tensor(grad * clipnorm) / ops.maximum(
        norm, clipnorm)


class _Shard:
    """A sharded optimizer's state outside Keras' tracking: the model's
    variables, their shadows and the layout."""

    def __init__(self, variables, shadows, layout, rank, framework):
        self.variables = variables
        self.shadows = shadows
        self.layout = layout
        self.rank = rank
        self.framework = framework
        self._ids = [id(v) for v in variables]
        self._model_of = {id(s): v for s, v in zip(shadows, variables)}
        self._index_of = {id(s): j for j, s in enumerate(shadows)}
        self._slots = {}  # id(slot) -> index of its variable
        self.whole = None  # whole_state's gathered values while saving

    def note_slot(self, slot, reference):
        j = self._index_of.get(id(reference))
        if j is not None:
            self._slots[id(slot)] = j

    def slot_index(self, variable):
        """The index of the variable whose shard `variable` is a slot of,
        or None for a shared optimizer variable."""
        return self._slots.get(id(variable))

    def model_variable(self, shadow):
        return self._model_of.get(id(shadow))

    def positions(self, variables):
        """The indices of `variables` among the optimizer's, which they
        must be all of or some of, in the same order."""
        where = {vid: i for i, vid in enumerate(self._ids)}
        out = [where.get(id(v)) for v in variables]
        if None in out or out != sorted(set(out)):
            self.check_variables(variables)  # raises
        return out

    def check_variables(self, variables):
        if [id(v) for v in variables] != self._ids:
            raise ValueError(
                "DistributedOptimizer(shard=...): apply() got other "
                f"variables ({len(variables)}) than the optimizer was built "
                f"with ({len(self._ids)}); a sharded optimizer updates the "
                "variables it was built with (all or some of them, with "
                "backward_passes_per_step=1), in one order.")

    def release(self, grads, mode):
        """With shard="gradients", drops the whole gradients the framework
        keeps between steps once they are reduce-scattered (PyTorch's
        `.grad`)."""
        if mode != "gradients":
            return
        for v in self.variables:
            tensor = getattr(v, "value", None)
            if getattr(tensor, "grad", None) is not None:
                tensor.grad = None


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
    return sharded._kerasdist_shard


class whole_state:
    """A context in which a sharded optimizer in `optimizer` saves its
    state whole, in the plain optimizer's layout (`model.save`,
    `save_weights`): entering gathers every slot from its shards, on every
    rank (a collective: every rank enters). Nothing for any other
    optimizer."""

    def __init__(self, optimizer):
        self.sharded = sharded_in(optimizer)

    def __enter__(self):
        if self.sharded is not None and self.sharded.built:
            self.sharded._kerasdist_shard.whole = \
                self.sharded.kerasdist_gather_whole()
        return self

    def __exit__(self, *exc):
        if self.sharded is not None and self.sharded.built:
            self.sharded._kerasdist_shard.whole = None
        return False


# ---- saving and loading the shards (Trainer checkpoints, hvd.elastic) ----


def slot_variables(optimizer):
    """[(i, variable, j)] for each optimizer variable (index i in
    `optimizer.variables`) that holds only this rank's shard of model
    variable j; [] for a replicated optimizer."""
    state = shard_state(optimizer)
    if state is None:
        return []
    out = []
    for i, v in enumerate(optimizer.variables):
        j = state.slot_index(v)
        if j is not None:
            out.append((i, v, j))
    return out


def take_shard(optimizer):
    """This rank's shard of every slot, copied to host memory:
    {optimizer variable index: 1-D array}."""
    import keras
    import numpy as np

    return {i: np.array(keras.ops.convert_to_numpy(v), copy=True)
            for i, v, _ in slot_variables(optimizer)}


def write_shard_file(path, values, **attrs):
    """Writes a shard file (HDF5): one 1-D dataset a slot, named by its
    index in the optimizer's variables (`values`, from `take_shard`), and
    `attrs` (the write's token, rank, size). Not atomic: the caller
    writes a temporary file and renames it."""
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for i, value in values.items():
            if value.dtype.name == "bfloat16":
                f.create_dataset(str(i), data=value.view(np.uint16))
                f[str(i)].attrs["dtype"] = "bfloat16"
            else:
                f.create_dataset(str(i), data=value)


# ---- a sharded optimizer's saved slots, read at another size ----------


class ShardFiles:
    """The slots of a sharded checkpoint, read piece by piece from its
    shard files."""

    def __init__(self, directory, record):
        self.directory = directory
        self.record = record
        self.entries = {int(e["index"]): e for e in record["variables"]}
        self._open = {}

    def _file(self, k):
        import h5py
        f = self._open.get(k)
        if f is None:
            name = self.record["files"][k]["name"]
            path = os.path.join(self.directory, name)
            try:
                f = h5py.File(path, "r")
            except OSError as e:
                raise ValueError(
                    f"shard file {path} is unreadable: {e}") from None
            self._open[k] = f
        return f

    def read(self, i, lo, hi):
        """Elements [lo, hi) of optimizer variable i, flattened."""
        e = self.entries[i]
        out = None
        for k, start, stop, at in pieces(int(e["numel"]),
                                                   int(e["chunk"]), lo, hi):
            dataset = self._file(k)[str(i)]
            part = _decode(dataset, np.asarray(dataset[start:stop]))
            if out is None:
                out = np.zeros(hi - lo, part.dtype)
            out[at:at + stop - start] = part
        return np.zeros(0) if out is None else out

    def close(self):
        for f in self._open.values():
            f.close()
        self._open = {}


class PlainFile:
    """The slots of a replicated checkpoint (a Keras weight file holding
    the whole optimizer state), read by slices."""

    def __init__(self, path):
        import h5py
        self._file = h5py.File(path, "r")
        self._vars = self._file["optimizer/vars"]

    def read(self, i, lo, hi):
        dataset = self._vars[str(i)]
        return _decode(dataset, flat_range(dataset, lo, hi))

    def close(self):
        self._file.close()


def _decode(dataset, values):
    if dataset.attrs.get("dtype") == "bfloat16":
        import ml_dtypes
        return np.asarray(values).view(ml_dtypes.bfloat16)
    return values


def load_slots(optimizer, source, numels):
    """Assigns each slot of `optimizer` from `source` (ShardFiles or
    PlainFile): a sharded optimizer's rank takes its own shard only, a
    replicated optimizer each slot whole. `numels`: {optimizer variable
    index: element count} of the checkpoint's slots."""
    state = shard_state(optimizer)
    if state is not None:
        layout, rank = state.layout, state.rank
        slots = slot_variables(optimizer)
        if sorted(i for i, _, _ in slots) != sorted(numels):
            raise ValueError(
                "the checkpoint's optimizer state is laid out for other "
                "variables than this optimizer's: another optimizer.")
        for i, v, j in slots:
            n, c = layout.numels[j], layout.chunks[j]
            _check_numel(v, numels[i], n)
            lo, hi = owned(n, c, rank)
            value = np.zeros(c, numpy_dtype(layout.dtypes[j]))
            value[:hi - lo] = source.read(i, lo, hi)
            v.assign(value)
        return
    variables = optimizer.variables
    for i, n in numels.items():
        v = variables[i]
        _check_numel(v, n, int(np.prod(v.shape)))
        v.assign(source.read(i, 0, n).reshape(tuple(v.shape)))


def numpy_dtype(name):
    """The numpy dtype of a layout's dtype name (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _check_numel(variable, saved, wanted):
    if saved != wanted:
        raise ValueError(
            f"the checkpoint's value of optimizer variable "
            f"{getattr(variable, 'path', variable.name)} has {saved} "
            f"elements, this one {wanted}: another model.")


def shard_index(optimizer):
    """The layout of a sharded optimizer's saved slots, for an index
    (a Trainer checkpoint's `optimizer_shards`, an hvd.elastic commit's
    `shards`; the writer adds the files): the number of ranks, and each
    slot's index in `optimizer.variables`, shape, element count and
    shard length."""
    layout = shard_state(optimizer).layout
    return {
        "format": 1,
        "size": int(layout.size),
        "optimizer_variables": len(optimizer.variables),
        "variables": [
            {"index": i, "path": str(getattr(v, "path", v.name)),
             "shape": list(layout.shapes[j]), "numel": layout.numels[j],
             "chunk": layout.chunks[j], "dtype": layout.dtypes[j]}
            for i, v, j in slot_variables(optimizer)],
    }
