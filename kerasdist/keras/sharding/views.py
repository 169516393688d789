"""The whole views of sharded weights (kerasdist/keras/sharding/weights.py):
`gather`, the allgather of a weight's shards whose gradient is one
reduce-scatter into the shard; `gather_layer`, the same for all of one
layer's sharded weights at once (one allgather and one reduce-scatter a
dtype, FSDP's flat parameter), which the views read while the layer's call
runs (`FRAMES`); `view_class`, the variable class whose value is that
gather; `own_piece`, this rank's shard of a whole value."""

import numpy as np

from kerasdist.keras import framework as _framework
from kerasdist.keras.sharding.layout import itemsize
from kerasdist.keras.sharding.layout import owned


def gather(weight, shard_value):
    """The whole weight from every rank's shard (`shard_value` this
    rank's, a tensor of the running backend): one allgather, whose
    gradient is one reduce-scatter averaging the whole gradient over the
    ranks into this rank's shard (`_gather_group` for a group of one)."""
    return _gather_group([weight], [shard_value])[0]


# A layer's weights this many bytes or more whole gather alone, where
# they are read (see gather_layer).
ALONE_BYTES = 1 << 20


def gather_layer(weights):
    """{id(weight): its whole value} for one layer's sharded `weights`
    (their `WeightShard`s), gathered together when the layer's call
    begins: the shards' values (as the call reads them: the running
    step's, autocast) concatenated, one allgather of that row, split and
    reshaped; its gradient concatenates the whole gradients into one
    (size, sum of the chunks) buffer and reduce-scatters it once. Grouped
    by dtype and by trainable (a frozen weight's gradient, never asked
    for, is never computed): one collective a group.

    A weight of ALONE_BYTES or more whole is left out: the view gathers
    it alone where the call reads it, as any read outside a call. Taken
    out of a group it would be copied whole (its block of every rank's
    row is not contiguous), one layer more in flight, to save a
    collective whose own cost is small beside its transfer; and a large
    weight a call may not read (keras-hub's untied ReversibleEmbedding
    reads one of its two tables a call) is never gathered for nothing."""
    import keras

    groups = {}
    for weight in weights:
        if weight.numel * itemsize(weight.dtype) >= ALONE_BYTES:
            continue
        value = weight.shard.value
        key = (keras.backend.standardize_dtype(value.dtype),
               bool(weight.shard.trainable))
        groups.setdefault(key, []).append((weight, value))
    out = {}
    for members in groups.values():
        group = [w for w, _ in members]
        values = [v for _, v in members]
        wholes = _gather_group(group, values)
        out.update({id(w): x for w, x in zip(group, wholes)})
    return out


def _gather_group(weights, values):
    """The whole values of `weights` (`WeightShard`s of one dtype) from
    every rank's shards (`values`, this rank's): the shards concatenated
    into one row, one allgather of it, every weight's column block of
    the (size, sum of the chunks) result reshaped; its gradient is the
    whole gradients in one such buffer, reduce-scattered once (the
    average over the ranks) into this rank's row."""
    import keras
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    ops = keras.ops
    if in_symbolic_scope():
        # Keras infers shapes (compute_output_spec; on PyTorch it runs the
        # call eagerly where meta tensors fail): nothing to gather, and a
        # rank that joined a grown job builds alone.
        return [ops.zeros(w.shape, dtype=w.dtype) for w in weights]
    framework = _framework.get()
    size = weights[0].size
    chunks = [w.chunk for w in weights]
    # Named here, in the program that reads the weights: a weight read
    # twice in one program (tied embeddings: keras-hub's token embedding,
    # reversed for the logits) gets two names. Inside the custom gradient
    # JAX traces each gather as a program of its own, where every read
    # would be numbered 0 and two could meet in flight.
    name = "kerasdist.w." + weights[0].path
    if len(weights) > 1:
        name += f"+{len(weights) - 1}"
    gather_name = framework.unique_name(name)
    grad_name = framework.unique_name(name + ".grad")
    # Shards are 1-D already (weights.py makes them so): no reshape, each
    # a node more in a traced step (TensorFlow keeps every node's graph,
    # a cost a layer).
    flat = values[0] if len(values) == 1 else ops.concatenate(values)
    if ANCHORS:
        flat = framework.after(flat, ANCHORS[-1])
    return framework.gather_whole(
        flat, [w.shape for w in weights], [w.numel for w in weights],
        chunks, size, gather_name, grad_name)


# The inputs of the layer calls running now, innermost last: a gather
# inside one waits for its layer's input (see KerasFramework.after).
ANCHORS = []

# The whole weights of the sharded layers whose calls run now, innermost
# last ({id(WeightShard): value}, from gather_layer): a view reads its
# value from the innermost only, so a layer whose call is rematerialized
# never reads a tensor of a call around it (its recomputation could not
# differentiate it); a weight read anywhere else gathers alone.
FRAMES = []


def call_in_frame(weights, call, args, kwargs):
    """`call(*args, **kwargs)` with `weights` (`WeightShard`s) gathered
    together first (gather_layer) as the innermost frame."""
    FRAMES.append(gather_layer(weights))
    try:
        return call(*args, **kwargs)
    finally:
        FRAMES.pop()


_VIEW_CLASSES = {}


def view_class(base):
    klass = _VIEW_CLASSES.get(base)
    if klass is not None:
        return klass

    class WholeView(base):
        """A whole weight read from its shards (see the module)."""

        # TensorFlow: a view is no resource variable (it has no handle of
        # its own); ops take its value.
        _should_act_as_resource_variable = False

        @property
        def value(self):
            weight = self._kerasdist_weight
            if FRAMES:
                whole = FRAMES[-1].get(id(weight))
                if whole is not None:
                    return whole
            return gather(weight, weight.shard.value)

        def assign(self, value):
            weight = self._kerasdist_weight
            weight.shard.assign(own_piece(weight, value))
            return value

        def numpy(self):
            return _framework.get().to_numpy(self.value)

        def __array__(self, dtype=None, copy=None):
            out = self.numpy()
            return out.astype(dtype) if dtype else out

        def __repr__(self):
            chunk = self._kerasdist_weight.chunk
            return (f"<WholeView path={self.path}, shape={self.shape}, "
                    f"dtype={self.dtype}, a shard of {chunk} elements on "
                    "this rank>")

    WholeView.__name__ = f"WholeView{base.__name__}"
    _VIEW_CLASSES[base] = WholeView
    return WholeView


def own_piece(weight, value):
    """This rank's shard (padded) of a whole value (any array-like)."""
    import keras

    sliced = getattr(value, "kerasdist_own_piece", None)
    if sliced is not None:  # a saved value read by slice (loading.Lazy)
        return sliced(weight)
    whole = np.asarray(keras.ops.convert_to_numpy(value))
    if whole.size != weight.numel:
        raise ValueError(
            f"kerasdist: cannot assign a value of shape {whole.shape} to "
            f"the sharded weight {weight.path} of shape {weight.shape}.")
    lo, hi = owned(weight.numel, weight.chunk, weight.rank)
    piece = np.zeros((weight.chunk,), whole.dtype)
    piece[:hi - lo] = whole.reshape(-1)[lo:hi]
    return piece
