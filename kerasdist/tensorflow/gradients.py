"""TensorFlow helpers shared by DistributedOptimizer and
DistributedGradientTape: naming gradients identically on every rank, and
reducing a gradient list of TF tensors."""

import tensorflow as tf

from kerasdist import _buckets
from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist.collectives import bound
from kerasdist._core.gradients import (label_members, source_label,
                                       split_groups)


def in_xla_context():
    """True while tracing a function compiled with XLA (jit_compile=True)."""
    if tf.executing_eagerly():
        return False
    # Private, but the only way to ask; guarded so a TF change degrades to
    # TF's own (cryptic) error instead of breaking every graph trace.
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def gradient_names(prefix, sources):
    """One collective name per source, identical on every rank.

    Names come from the variables' paths (Keras) or names (tf.Variable), so
    they depend only on how the model was built, not on call order. Sources
    without a name fall back to their position.
    """
    names = [f"{prefix}.{source_label(s, i)}" for i, s in enumerate(sources)]
    if len(set(names)) != len(names):
        names = [f"{n}.{i}" for i, n in enumerate(names)]
    if not tf.executing_eagerly():
        # Two reductions of the same variables inside one tf.function (a
        # second tape.gradient call) must not collide; the graph's unique
        # naming is deterministic, so it is identical on every rank.
        graph = tf.compat.v1.get_default_graph()
        names = [graph.unique_name(n, mark_as_used=True) for n in names]
    return names


def reduce_gradients(grads, sources, prefix, compression=None,
                     op=basics.Average, sparse_as_dense=False,
                     gradient_predivide_factor=1.0, num_groups=0,
                     bucket_bytes=None):
    """Allreduces `grads` (a flat list, `None` entries kept) over all ranks.

    Dense gradients are allreduced; `tf.IndexedSlices` are allgathered
    unless `sparse_as_dense`. With a predivide factor f the runtime
    multiplies by 1/f before summing and by f/size after, which equals
    Average. The dense gradients are split, in order, into `num_groups`
    groups of nearly equal count (0 means one group), each reduced by one
    `grouped_allreduce`; the runtime fuses each group up to the threshold.

    `bucket_bytes` (with `num_groups=0`, inside a `tf.function`, op not
    Adasum): the dense gradients go in buckets of up to that many bytes
    (`kerasdist._buckets.variable_buckets`: backprop order, the last
    layer's first, dtypes apart), one grouped allreduce each. TF's executor
    runs an op as soon as its inputs exist and the collective ops are
    asynchronous (they return their thread at once), so a bucket's
    allreduce runs in the runtime while TF still computes the gradients of
    earlier layers. The result is the same. Eagerly every op waits for its
    result, so there the gradients stay in one group.

    With one rank nothing is communicated: every supported reduction of one
    rank is the identity, so only compression (and `sparse_as_dense`) is
    applied, keeping its rounding, and no collective op is created.

    Returns:
        A list like `grads` holding the reduced gradients.
    """
    compression = compression or _none()
    if _process_sets.current_size() == 1:
        return [_local_only(g, compression, sparse_as_dense) for g in grads]
    names = gradient_names(prefix, sources)
    if gradient_predivide_factor != 1.0:
        dense_op = basics.Sum
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor / _process_sets.current_size()
    else:
        dense_op, prescale, postscale = op, 1.0, 1.0

    out = [None] * len(grads)
    dense = []  # (index, name, wire tensor, ctx)
    for i, (grad, name) in enumerate(zip(grads, names)):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            if sparse_as_dense:
                grad = tf.convert_to_tensor(grad)
            else:
                values, ctx = compression.compress(grad.values)
                gathered = bound("tensorflow").allreduce(
                    tf.IndexedSlices(values, grad.indices, grad.dense_shape),
                    op=op, name=name)
                out[i] = tf.IndexedSlices(
                    compression.decompress(gathered.values, ctx),
                    gathered.indices, gathered.dense_shape)
                continue
        wire, ctx = compression.compress(tf.convert_to_tensor(grad))
        dense.append((i, name, wire, ctx))

    wires = [wire for _, _, wire, _ in dense]
    # One grouped op per group: TF dispatches and completes one op instead of
    # one per gradient (at 42 gradients that per-op cost dominated the MLP-20
    # step), and member names are positions within the group, so they do not
    # depend on Keras' auto-generated layer names, which can differ between
    # ranks that built a different number of models before.
    reduced = [None] * len(dense)
    if dense:
        buckets = _buckets_of(wires, bucket_bytes, num_groups, op)
        if buckets is not None:
            names = [_group_name(prefix, b, len(buckets), "bucket")
                     for b in range(len(buckets))]
        else:
            groups = num_groups if num_groups > 0 else 1
            buckets = split_groups(len(dense), groups)
            names = [_group_name(prefix, g, groups)
                     for g in range(len(buckets))]
        for group, members in zip(names, buckets):
            label_members(group, [source_label(sources[dense[j][0]],
                                               dense[j][0]) for j in members])
            outs = bound("tensorflow").grouped_allreduce(
                [wires[j] for j in members], op=dense_op, name=group,
                prescale_factor=prescale, postscale_factor=postscale)
            for j, r in zip(members, outs):
                reduced[j] = r
    for (i, _, _, ctx), r in zip(dense, reduced):
        out[i] = compression.decompress(r, ctx)
    return out


def _buckets_of(wires, bucket_bytes, num_groups, op):
    """The buckets of `wires` (lists of indices, in the order they become
    ready), or None where the gradients stay grouped: no `bucket_bytes`,
    `num_groups` given, Adasum (whose result depends on what is reduced
    together), eagerly, a single gradient, or a shape unknown when
    tracing."""
    if (bucket_bytes is None or num_groups > 0 or op == basics.Adasum
            or tf.executing_eagerly() or len(wires) < 2):
        return None
    sizes = []
    for w in wires:
        n = w.shape.num_elements()
        if n is None:
            return None
        sizes.append(n * w.dtype.size)
    buckets = _buckets.variable_buckets(
        sizes, [w.dtype.name for w in wires], bucket_bytes)
    return buckets if len(buckets) > 1 else None


def _group_name(prefix, index, num_groups, kind="group"):
    name = f"{prefix}.{kind}{index}of{num_groups}"
    if tf.executing_eagerly():
        return name
    # Unique within the graph (a second reduction in one tf.function), and
    # deterministic, so identical on every rank.
    graph = tf.compat.v1.get_default_graph()
    return graph.unique_name(name, mark_as_used=True)


def _local_only(grad, compression, sparse_as_dense):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices) and not sparse_as_dense:
        values, ctx = compression.compress(grad.values)
        return tf.IndexedSlices(compression.decompress(values, ctx),
                                grad.indices, grad.dense_shape)
    wire, ctx = compression.compress(tf.convert_to_tensor(grad))
    return compression.decompress(wire, ctx)


def _none():
    from kerasdist.compression import Compression
    return Compression.none
