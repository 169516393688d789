"""Reducing a list of gradients over the ranks, written once for every
framework: DistributedOptimizer (on each Keras backend) and TensorFlow's
DistributedGradientTape come here with their gradients and the running
framework's `kerasdist.keras.framework.KerasFramework`.

The steps: compress each gradient; allgather sparse ones (TensorFlow's
`tf.IndexedSlices`) unless `sparse_as_dense`; put the dense ones in groups
(`num_groups`) or buckets (`bucket_bytes`, in the order backprop produces
them); one grouped allreduce per group, named identically on every rank,
with a predivide factor as the runtime's prescale and postscale; then
decompress. With one rank nothing is communicated.
"""

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist.keras import buckets as _buckets
from kerasdist.keras.compression import Compressor


def reduce_gradients(grads, sources, prefix, framework=None,
                     compression=None, op=basics.Average,
                     sparse_as_dense=False, gradient_predivide_factor=1.0,
                     num_groups=0, bucket_bytes=None):
    """Allreduces `grads` (a flat list, `None` entries kept) over the ranks
    of the current process set.

    Dense gradients are allreduced; sparse ones are allgathered unless
    `sparse_as_dense`. With a predivide factor f the runtime multiplies by
    1/f before summing and by f/size after, which equals Average. The dense
    gradients are split, in order, into `num_groups` groups of nearly equal
    count (0 means one group), each reduced by one `grouped_allreduce`; the
    runtime fuses each group up to the fusion threshold.

    `bucket_bytes` (with `num_groups=0`, op not Adasum, whose result
    depends on what is reduced together): the dense gradients go in
    buckets of up to that many bytes (`buckets.variable_buckets`:
    backprop order, the last layer's first, dtypes apart), one grouped
    allreduce each, so that each bucket's allreduce depends only on its own
    gradients and can start as soon as they exist (TensorFlow's executor
    runs a graph op as soon as its inputs exist; XLA may schedule a custom
    call early). The result is the same.

    With one rank nothing is communicated: every supported reduction of one
    rank is the identity, so only compression (and `sparse_as_dense`) is
    applied, keeping its rounding, and no collective is created.

    Args:
        grads: the gradients (`None` where a source has none).
        sources: what they are gradients of (variables), one per gradient,
            for names and the timeline's labels; None: positions only.
        prefix: the first part of every collective's name.
        framework: a `KerasFramework`; None: the Keras backend's.
        The others: DistributedOptimizer's arguments of the same names.

    Returns:
        A list like `grads` holding the reduced gradients.
    """
    if framework is None:
        from kerasdist.keras import framework as _framework
        framework = _framework.get()
    if compression is None:
        from kerasdist.keras.compression import Compression
        compression = Compression.none
    if _process_sets.current_size() == 1:
        return [_local_only(framework, g, compression, sparse_as_dense)
                for g in grads]
    out = [None] * len(grads)
    dense = []  # (index, wire tensor, ctx)
    sparse_names = None
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        if (framework.is_sparse(grad) and not sparse_as_dense
                and framework.gathers_sparse(
                    source_label(sources[i], i) if sources else str(i))):
            if sparse_names is None:
                sparse_names = framework.gradient_names(
                    prefix, sources or [None] * len(grads))
            out[i] = framework.reduce_sparse(grad, compression, op,
                                             sparse_names[i])
            continue
        wire, ctx = compression.compress(framework.dense(grad))
        dense.append((i, wire, ctx))
    if dense:
        wires = [w for _, w, _ in dense]
        labels = [source_label(sources[i], i) if sources else None
                  for i, _, _ in dense]
        # Buckets only where their allreduces can overlap backprop (not
        # eager TensorFlow, where every op waits for its result).
        can_bucket = bucket_bytes is not None and framework.can_bucket()
        sizes = [framework.nbytes(w) if can_bucket else None for w in wires]
        the_plan = plan(sizes, [framework.dtype_name(w) for w in wires],
                        prefix, op, gradient_predivide_factor, num_groups,
                        bucket_bytes if can_bucket else None, labels)
        reduced = execute(framework, the_plan, wires)
        for (i, _, ctx), r in zip(dense, reduced):
            out[i] = compression.decompress(r, ctx)
    return out


def scales(op, predivide):
    """(op, prescale, postscale) of a gradient allreduce with
    `gradient_predivide_factor`."""
    if predivide != 1.0:
        return (basics.Sum, 1.0 / predivide,
                predivide / _process_sets.current_size())
    return op, 1.0, 1.0


class Plan:
    """One reduction of a list of gradients, decided once and the same on
    every rank: which gradients travel together, under which names, with
    which scale factors. The replicated optimizer executes it with one
    grouped allreduce a bucket (`execute`), PyTorch's hooks start its
    buckets during backprop (kerasdist/torch/_overlap.py), and the sharded
    optimizer's layout reduce-scatters and allgathers by its buckets
    (kerasdist/keras/sharding/layout.py).

    Attributes:
        buckets: lists of positions in the gradients' list, in the order
            they are reduced (a bucket as soon as backprop completes it).
        names: one per bucket, identical on every rank; member k of
            bucket `name` is named `<name>.<k>`, a position, so names do
            not depend on Keras' auto-generated layer names (which can
            differ between ranks that built a different number of models).
        labels: one per gradient, its timeline row's name (None: none).
        op, prescale, postscale: the runtime's reduction (`scales`).
    """

    def __init__(self, buckets, names, labels, op, prescale, postscale):
        self.buckets = buckets
        self.names = names
        self.labels = labels
        self.op, self.prescale, self.postscale = op, prescale, postscale


def plan(sizes, kinds, prefix, op=basics.Average, predivide=1.0,
         num_groups=0, bucket_bytes=None, labels=None,
         first_bucket_bytes=_buckets.DEFAULT_FIRST_BUCKET_BYTES,
         one_bucket=False, kinds_apart=False):
    """The `Plan` of reducing gradients of `sizes` bytes (None: unknown
    while tracing) and `kinds` (dtypes, or what else may not share a
    bucket), given in the variables' order.

    Buckets where `bucket_bytes` is given, `num_groups` is 0, the op is
    not Adasum (whose result depends on what is reduced together) and
    every size is known: `buckets.variable_buckets` (backprop order, the
    last layer's first, kinds apart), named `<prefix>.bucket<k>of<n>`. A
    single bucket is one group instead, unless `one_bucket` (PyTorch's
    hooks, which start a bucket of their own). Otherwise `num_groups`
    groups of nearly equal count (0: one), in order, named
    `<prefix>.group<g>of<num_groups>`; with `kinds_apart` (a
    reduce-scatter, whose members share one buffer) one group a kind
    instead, in the order each kind first appears. The result is the same
    either way.
    """
    count = len(sizes)
    buckets = None
    if (bucket_bytes is not None and num_groups == 0 and count
            and op != basics.Adasum and None not in sizes):
        buckets = _buckets.variable_buckets(sizes, kinds, bucket_bytes,
                                            first_bucket_bytes)
        if len(buckets) < 2 and not one_bucket:
            buckets = None
    if buckets is not None:
        names = [f"{prefix}.bucket{k}of{len(buckets)}"
                 for k in range(len(buckets))]
    elif kinds_apart:
        by_kind = {}
        for i, kind in enumerate(kinds):
            by_kind.setdefault(kind, []).append(i)
        buckets = list(by_kind.values())
        names = [f"{prefix}.group{g}of{len(buckets)}"
                 for g in range(len(buckets))]
    else:
        groups = num_groups if num_groups > 0 else 1
        buckets = split_groups(count, groups) if count else []
        names = [f"{prefix}.group{g}of{groups}" for g in range(len(buckets))]
    return Plan(buckets, names, list(labels or [None] * count),
                *scales(op, predivide))


def execute(framework, plan, wires):
    """`wires` (the compressed dense gradients) reduced as `plan` says:
    one grouped allreduce a bucket, one op to dispatch and complete
    instead of one per gradient, on `framework`'s collectives."""
    reduced = [None] * len(wires)
    for base, members in zip(plan.names, plan.buckets):
        group = framework.unique_name(base)
        label_members(group, [plan.labels[j] for j in members])
        outs = framework.collectives.grouped_allreduce(
            [wires[j] for j in members], plan.op, group, plan.prescale,
            plan.postscale)
        for j, r in zip(members, outs):
            reduced[j] = r
    return reduced


def accumulate(framework, slots, count, grads, k, average, reduce, apply):
    """`backward_passes_per_step = k > 1`: adds `grads` to their `slots`
    (the framework's `accumulators`, densified) and counts the call in
    `count`; every k-th call reduces the sums (divided by k if `average`)
    with `reduce` and hands the result to `apply`, then zeroes the slots.
    In Keras ops, as Keras' own `gradient_accumulation_steps`.

    Returns a boolean tensor: True when the update ran.
    """
    import keras

    ops = keras.ops
    for g, slot in zip(grads, slots):
        if g is not None:
            slot.assign_add(ops.cast(framework.dense(g), slot.dtype))
    count = count.assign_add(1)

    def communicate():
        summed = [None if g is None else ops.copy(slot)
                  for g, slot in zip(grads, slots)]
        if average:
            summed = [None if s is None else s / k for s in summed]
        apply(reduce(summed))
        for slot in slots:
            slot.assign(ops.zeros_like(slot))
        return ops.convert_to_tensor(True)

    # Every rank counts the same calls, so all take the same branch and the
    # collectives inside stay matched.
    return ops.cond(ops.equal(count % k, 0), communicate,
                    lambda: ops.convert_to_tensor(False))


def _local_only(framework, grad, compression, sparse_as_dense):
    if grad is None:
        return None
    if framework.is_sparse(grad) and not sparse_as_dense:
        return framework.map_sparse_values(
            grad, lambda v: compression.decompress(*compression.compress(v)))
    return compression.decompress(
        *compression.compress(framework.dense(grad)))


def check_args(op, compression, gradient_predivide_factor, num_groups, what):
    """Validates the arguments both wrappers share; raises ValueError."""
    if op not in (basics.Average, basics.Sum, basics.Adasum):
        raise ValueError(f"{what}: op must be kerasdist.Average, "
                         f"kerasdist.Sum or kerasdist.Adasum; got {op!r}.")
    if not (isinstance(compression, type)
            and issubclass(compression, Compressor)) and not (
                hasattr(compression, "compress")
                and hasattr(compression, "decompress")):
        raise ValueError(f"{what}: compression must be a Compressor such as "
                         f"kerasdist.Compression.fp16; got {compression!r}.")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"{what}: gradient_predivide_factor must be > 0; "
                         f"got {gradient_predivide_factor!r}.")
    if gradient_predivide_factor != 1.0 and op != basics.Average:
        raise ValueError(f"{what}: gradient_predivide_factor needs "
                         "op=kerasdist.Average.")
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) \
            or num_groups < 0:
        raise ValueError(f"{what}: num_groups must be an int >= 0; got "
                         f"{num_groups!r}.")


def source_label(source, index):
    """A gradient source's name for people: a Keras variable's path, a
    tf.Variable's name (without ":0"), else `source<index>`."""
    for attr in ("path", "name"):
        try:
            value = getattr(source, attr, None)
        except (AttributeError, ValueError):  # eager tensors have no name
            value = None
        if value:
            return str(value).replace(":0", "")
    return f"source{index}"


def label_members(group_name, labels):
    """Names the timeline rows of a grouped collective's members
    (`<group_name>.<i>`) after `labels` (one per member; None: none)."""
    from kerasdist._core import capi
    capi.label_tensors((f"{group_name}.{k}", label)
                       for k, label in enumerate(labels) if label)


def split_groups(count, num_groups):
    """Splits range(count) into min(num_groups, count) contiguous lists
    whose lengths differ by at most one (longer ones first), like
    `numpy.array_split`. Pure, so every rank gets the same groups."""
    n = min(num_groups, count)
    base, extra = divmod(count, n)
    groups, start = [], 0
    for g in range(n):
        stop = start + base + (1 if g < extra else 0)
        groups.append(list(range(start, stop)))
        start = stop
    return groups


# ---- local variables ---------------------------------------------------------


class LocalVariables:
    """The variables whose gradients stay on their rank (Horovod's
    `register_local_var`, `register_local_source` and `local_layers`),
    matched by identity. Layers are read when gradients are reduced, so a
    layer built after wrapping counts with all its weights."""

    def __init__(self):
        self._variables = {}  # id -> variable (kept alive)
        self._layers = []

    def add_variable(self, var, what):
        """Registers `var`; TypeError unless it is a variable."""
        if not hasattr(var, "assign") or not hasattr(var, "shape"):
            raise TypeError(f"{what} takes a variable (a Keras variable, or "
                            "a tf.Variable on TensorFlow); got "
                            f"{type(var).__name__}.")
        self._variables[id(var)] = var

    def add_layers(self, layers):
        self._layers.extend(layers)

    def ids(self):
        ids = set(self._variables)
        for layer in self._layers:
            ids.update(id(v) for v in layer.trainable_weights)
        return ids

    def split(self, variables):
        """(keep, local): the positions in `variables` of those whose
        gradients are reduced, and of the local ones."""
        local = self.ids()
        keep = [i for i, v in enumerate(variables) if id(v) not in local]
        mine = [i for i, v in enumerate(variables) if id(v) in local]
        return keep, mine


def with_local(grads, keep, reduced, local, scale):
    """`grads` with the reduced gradients (`reduced`, one per position in
    `keep`) in place, and the local ones (positions `local`) as they are,
    or divided by `size()` if `scale` (as Horovod's
    `scale_local_gradients`)."""
    n = _process_sets.current_size() if scale and local else 1
    out = [None] * len(grads)
    for i in local:
        out[i] = scaled(grads[i], n)
    for i, g in zip(keep, reduced):
        out[i] = g
    return out


def scaled(grad, n):
    """`grad / n` (a `tf.IndexedSlices`' values); None stays None."""
    if grad is None or n == 1:
        return grad
    if all(hasattr(grad, a) for a in ("values", "indices", "dense_shape")):
        return type(grad)(grad.values / n, grad.indices, grad.dense_shape)
    return grad / n


def local_layers(layers, what):
    """`layers` (None, a Keras layer or an iterable of them) as a list;
    ValueError for anything else."""
    import keras
    if layers is None:
        return []
    if isinstance(layers, keras.layers.Layer):
        return [layers]
    layers = list(layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError(f"{what}: all local layers must be of "
                         "keras.layers.Layer type.")
    return layers
