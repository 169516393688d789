"""A sharded optimizer's communication, one step: each gradient
reduce-scattered into this rank's shard, the updated shards allgathered
back into the weights, and the clipping norms summed over the ranks.

1. Each gradient, padded, is an N x c_i matrix whose row r is rank r's
   shard; one `reducescatter` leaves each rank its row of the average.
   Gradients of the same bucket (`bucket_bytes`, in backprop order, one
   dtype) whose shards are small (under `ALONE_BYTES`) go side by side in
   one matrix and one `reducescatter`. A gradient that a
   DistributedGradientTape returned, reduced over the same ranks
   (`kerasdist.keras.reduced` knows it by identity), is the same on every
   rank already: each rank slices its row (`own_shard`), with no
   collective.
2. (The optimizer class runs the user's Keras optimizer on the shards.)
3. `allgather` brings every rank's updated shard back (one per large
   shard, one per bucket of small ones), and each weight is assigned from
   it: identical bits on every rank.
"""

import collections
import contextlib

from kerasdist import basics
from kerasdist.keras import reduced as _reduced
from kerasdist.keras import reduction as _reduction
from kerasdist.keras.sharding.layout import itemsize
from kerasdist.keras.sharding.layout import owned

# A shard at least this large is reduced and gathered alone: its N x chunk
# rows are the variable itself (padded), so neither side copies a strided
# block, and each collective's output is freed once used. Smaller shards
# share one collective per bucket, their rows side by side.
ALONE_BYTES = 1 << 16
# Whole gradients a step may hold while their reduce-scatters run: in a
# TensorFlow graph (`scatter`) and in PyTorch's backward hooks
# (kerasdist/torch/_shard_overlap.py).
IN_FLIGHT_BYTES = 64 << 20


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
    rows side by side). None where a gradient is None.

    Paced where a traced graph runs every ready op (TensorFlow's
    executor, `framework.wait_before`): a gradient reduced alone is made
    only once the reduce-scatters that leave at most `IN_FLIGHT_BYTES` of
    whole gradients before it have ended, as PyTorch's backward hooks
    wait (kerasdist/torch/_shard_overlap.py); else backprop, far quicker
    than the wire, makes every whole gradient before the first
    reduce-scatter ends, and they all live at once."""
    import keras

    ops = keras.ops
    op, prescale, postscale = _reduction.scales(op, predivide)
    out = [None] * len(grads)
    flight = collections.deque()  # (bytes, reducescatter's result)
    flying = 0  # their bytes

    def reduce(matrix, name):
        wire, ctx = compression.compress(matrix)
        mine = framework.collectives.reducescatter(
            wire, op=op, name=framework.unique_name(name),
            prescale_factor=prescale, postscale_factor=postscale)
        return ops.reshape(compression.decompress(mine, ctx), (-1,)), mine

    # The plan's names (kerasdist.keras.reduction.Plan): bucket k is
    # <prefix><names[k]>, its member at position p, reduced alone,
    # <prefix><names[k]>.<p>.
    for k, bucket in enumerate(layout.buckets):
        name = prefix + layout.names[k]
        small = []
        for p, i in enumerate(bucket):
            if grads[i] is None:
                continue
            if layout.chunks[i] * itemsize(layout.dtypes[i]) < ALONE_BYTES:
                small.append(i)
                continue
            whole = framework.dense(grads[i])
            nbytes = framework.nbytes(whole) or 0
            gates = []
            while flight and flying + nbytes > IN_FLIGHT_BYTES:
                b, gate = flight.popleft()
                flying -= b
                gates.append(gate)
            if gates:
                framework.wait_before([whole], gates)
            out[i], done = reduce(_rows(ops, whole, layout.numels[i],
                                        layout.chunks[i], layout.size),
                                  f"{name}.{p}")
            flight.append((nbytes, done))
            flying += nbytes
        if not small:
            continue
        # Small shards together (not paced: a few KiB a rank each).
        rows = [_rows(ops, framework.dense(grads[i]), layout.numels[i],
                      layout.chunks[i], layout.size) for i in small]
        matrix = rows[0] if len(rows) == 1 else ops.concatenate(rows, axis=1)
        mine, _ = reduce(matrix, name)
        start = 0
        for i in small:
            out[i] = mine[start:start + layout.chunks[i]]
            start += layout.chunks[i]
    return out


def gather(framework, layout, shards, targets, prefix):
    """Assigns to each of `targets` (the model's variables) the
    concatenation of every rank's shard (`shards`, this rank's, one per
    variable): one allgather per large shard, one per bucket for the small
    ones. They are started together where the framework can
    (`gather_each`: PyTorch keeps several in flight), each variable
    assigned as its own arrives."""
    import keras

    ops = keras.ops
    rows, names, members = [], [], []
    for k, bucket in enumerate(layout.buckets):
        name = f"{prefix}{layout.names[k]}.gather"
        small = []
        for p, i in enumerate(bucket):
            if layout.chunks[i] * itemsize(layout.dtypes[i]) < ALONE_BYTES:
                small.append(i)
                continue
            rows.append(shards[i])
            names.append(f"{name}.{p}")
            members.append([i])
        if not small:
            continue
        parts = [shards[i] for i in small]
        rows.append(parts[0] if len(parts) == 1 else ops.concatenate(parts))
        names.append(name)
        members.append(small)
    # A shard is 1-D: its allgather is the variable flattened (and
    # padded); a bucket's, one row a rank of its members side by side.
    every = framework.gather_each(
        rows, [framework.unique_name(n) for n in names], layout.size)
    with framework.no_grad(), contextlib.closing(every):
        for everyone, group in zip(every, members):
            if len(group) == 1:
                _assign_whole(framework, layout, group[0], everyone,
                              targets[group[0]])
                continue
            everyone = ops.reshape(everyone, (layout.size, -1))
            start = 0
            for i in group:
                chunk = layout.chunks[i]
                block = everyone[:, start:start + chunk]
                start += chunk
                _assign_whole(framework, layout, i,
                              ops.reshape(block, (-1,)), targets[i])


def _assign_whole(framework, layout, i, flat, target):
    import keras

    if layout.size * layout.chunks[i] != layout.numels[i]:
        flat = flat[:layout.numels[i]]
    framework.put(target, keras.ops.reshape(flat, layout.shapes[i]))


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
    set (the same ranks; `kerasdist.keras.reduced`), identical on every rank,
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


def clip_by_norm(ops, grad, square_sum, clipnorm):
    """Keras' `_clip_by_norm` with the whole gradient's sum of squares."""
    square_sum = ops.cast(square_sum, grad.dtype)
    positive = square_sum > 0
    safe = ops.where(positive, square_sum, ops.ones_like(square_sum))
    norm = ops.where(positive, ops.sqrt(safe), square_sum)
    return ops.convert_to_tensor(grad * clipnorm) / ops.maximum(
        norm, clipnorm)
