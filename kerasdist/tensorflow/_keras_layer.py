"""The Keras layer's TensorFlow parts: the `KerasFramework` that
`kerasdist.keras.framework.get()` returns on the TensorFlow backend
(graph-unique names, `tf.IndexedSlices`, shapes known only when traced), the TF
variables that `backward_passes_per_step > 1` sums gradients in
(`kerasdist.keras.reduction.accumulate` does the summing), and XLA
(turned off, with a warning, where the TF ops have no XLA kernel:
`xla_unsupported`). Imported only when the Keras backend is TensorFlow, or
by DistributedGradientTape."""

import warnings

import tensorflow as tf

from kerasdist import basics
from kerasdist.keras import framework as _framework
from kerasdist.keras.reduction import source_label
from kerasdist.tensorflow import collectives as _tf_collectives

XLA_MESSAGE = (
    "kerasdist.DistributedOptimizer cannot run inside an XLA-compiled "
    "function here: its collectives have no XLA kernel {why}. Drop "
    "`jit_compile=True` from the tf.function around a custom train step, "
    "or compile the model with `model.compile(..., jit_compile=False)` "
    "(model.fit and "
    "train_on_batch turn XLA off by themselves, with a warning).")


in_xla_context = _tf_collectives.in_xla_context
xla_unsupported = _tf_collectives.xla_unsupported


def check_not_xla():
    """Raises RuntimeError while tracing an XLA-compiled function the
    collectives cannot run in (xla_unsupported)."""
    if in_xla_context():
        why = xla_unsupported()
        if why:
            raise RuntimeError(XLA_MESSAGE.format(why=why))


def _unique_in_graph(name):
    """`name`, unique within the graph being traced (a second reduction in
    one tf.function): the graph's naming is deterministic, so it is
    identical on every rank. Unchanged eagerly."""
    if tf.executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    return graph.unique_name(name, mark_as_used=True)


_DENSE_IN_XLA = (
    "kerasdist: the tf.IndexedSlices gradient of {label!r} (and any other) "
    "is allreduced as a dense tensor inside this XLA-compiled step: "
    "allgather has no XLA kernel {why}. Pass sparse_as_dense=True to "
    "silence this.")


class TensorFlow(_framework.KerasFramework):
    """The Keras layer on TensorFlow (see kerasdist/keras/framework.py)."""

    name = "tensorflow"
    collectives = _tf_collectives
    _said_dense = False

    def executing_eagerly(self):
        return tf.executing_eagerly()

    def assign_average(self, variables, name):
        @tf.function
        def average():
            values = _tf_collectives.grouped_allreduce(
                [tf.convert_to_tensor(v) for v in variables], basics.Average,
                name, 1.0, 1.0)
            for v, x in zip(variables, values):
                v.assign(x)

        return average

    def unique_name(self, base):
        return _unique_in_graph(base)

    def after(self, value, anchor):
        # In model.fit's graph TensorFlow's executor runs every ready op:
        # each gather reads only its shard, so all of them would run at
        # the step's start, and a rematerialized layer's second gather
        # long before its backward, every whole weight alive at once.
        if anchor is None or tf.executing_eagerly():
            return value
        with tf.control_dependencies([anchor]):
            return tf.identity(value)

    def wait_before(self, tensors, done):
        if tf.executing_eagerly() or in_xla_context():
            return  # ops run as called; XLA schedules its own
        gates = [d.op for d in done]
        behind = None
        for t in tensors:
            maker = _maker(t)
            # A stateful op on the way (the maker, or one its result
            # feeds: a finiteness check's allreduce, a print) is ordered
            # after the gates' stateful ops when the function is
            # finished (its automatic control dependencies), which a
            # wait could close into a cycle: no wait there.
            if maker is None or maker._is_stateful or _feeds_stateful(maker):
                continue
            behind = _behind(gates) if behind is None else behind
            if maker not in behind:  # else a gate needs it: a cycle
                maker._add_control_inputs(gates)

    def split_columns(self, x, sizes):
        # Sizes as ints: keras.ops.split passes tensors, and the blocks'
        # shapes would be known only when run.
        return tf.split(x, [int(n) for n in sizes], axis=1)

    def agree_finite(self, finite, prefix):
        check_not_xla()
        agreed = _tf_collectives.allreduce(
            tf.cast(finite, tf.int32), basics.Min,
            _unique_in_graph(f"{prefix}.loss_scale_finite"), 1.0, 1.0)
        return tf.greater(agreed, 0)

    # ---- gradients -----------------------------------------------------

    def is_sparse(self, grad):
        return isinstance(grad, tf.IndexedSlices)

    def dense(self, grad):
        return tf.convert_to_tensor(grad)

    def gathers_sparse(self, label):
        # Inside XLA where allgather has no kernel (a GPU): dense, said once.
        if not in_xla_context():
            return True
        why = _tf_collectives.xla_unsupported("allgather")
        if why is None:
            return True
        if not self._said_dense:
            self._said_dense = True
            warnings.warn(_DENSE_IN_XLA.format(label=label, why=why),
                          UserWarning, stacklevel=2)
        return False

    def nbytes(self, x):
        n = x.shape.num_elements()
        return None if n is None else n * x.dtype.size

    def dtype_name(self, x):
        return x.dtype.name

    def can_bucket(self):
        # Eagerly every op waits for its result: nothing to overlap.
        return not tf.executing_eagerly()

    def bucket_bytes(self, settings):
        # With backward_passes_per_step > 1 the summed gradients are all
        # ready at once.
        if getattr(settings, "overlap", False) and \
                settings.backward_passes_per_step == 1:
            return settings.bucket_bytes
        return None

    def gradient_names(self, prefix, sources):
        """One collective name per source, identical on every rank.

        Names come from the variables' paths (Keras) or names
        (tf.Variable), so they depend only on how the model was built, not
        on call order. Sources without a name fall back to their position.
        """
        names = [f"{prefix}.{source_label(s, i)}"
                 for i, s in enumerate(sources)]
        if len(set(names)) != len(names):
            names = [f"{n}.{i}" for i, n in enumerate(names)]
        return [_unique_in_graph(n) for n in names]

    def reduce_sparse(self, grad, compression, op, name):
        """A `tf.IndexedSlices` gradient allgathered (its values
        compressed)."""
        values, ctx = compression.compress(grad.values)
        gathered = _tf_collectives.allreduce(
            tf.IndexedSlices(values, grad.indices, grad.dense_shape), op,
            name, 1.0, 1.0)
        return tf.IndexedSlices(compression.decompress(gathered.values, ctx),
                                gathered.indices, gathered.dense_shape)

    def map_sparse_values(self, grad, fn):
        return tf.IndexedSlices(fn(grad.values), grad.indices,
                                grad.dense_shape)

    # ---- DistributedOptimizer ------------------------------------------

    def on_wrap(self, settings_of):
        install_train_function_hook(settings_of)

    def check_apply(self):
        check_not_xla()

    def check_passes(self, backward_passes_per_step):
        pass  # accumulated in TF variables (Accumulators)

    def accumulators(self, variables):
        return Accumulators(variables)

    def build_optimizer(self, optimizer, variables):
        build(optimizer, variables)


# Ops whose result is their input's buffer (or a view of it): the op that
# allocates a gradient is the first other one behind them.
_VIEWS = frozenset(("Identity", "IdentityN", "Reshape", "ExpandDims",
                    "Squeeze", "StopGradient"))


def _maker(tensor):
    """The op in the current graph that allocates `tensor`, or None."""
    op = getattr(tensor, "op", None)
    while op is not None and op.type in _VIEWS and op.inputs:
        op = op.inputs[0].op
    if op is None or not op.inputs or \
            op.graph is not tf.compat.v1.get_default_graph():
        return None
    return op


def _feeds_stateful(op):
    """Whether a stateful op uses `op`'s results, directly or not."""
    seen, todo = set(), [op]
    while todo:
        op = todo.pop()
        for out in op.outputs:
            for user in out.consumers():
                if user in seen:
                    continue
                if user._is_stateful:
                    return True
                seen.add(user)
                todo.append(user)
    return False


def _behind(ops_):
    """The ops `ops_` depend on, themselves included, through data and
    control edges."""
    seen, todo = set(), list(ops_)
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen


class Accumulators:
    """Local gradient sums for backward_passes_per_step > 1.

    Plain `tf.Variable`s held outside Keras tracking: they are not in
    `optimizer.variables`, so a saved model's optimizer state has the same
    layout as the unwrapped optimizer's and loads without kerasdist. The
    price: a partial accumulation is not checkpointed.
    """

    def __init__(self, variables):
        with tf.init_scope():
            self.grads = [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                            name="kerasdist_accum")
                for v in variables]
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="kerasdist_accum_count")


def build(optimizer, variables):
    """Builds `optimizer` on `variables` as Keras' `apply` would."""
    with tf.name_scope(optimizer.name):
        optimizer.build(variables)
    optimizer.built = True


# ---- XLA: turn it off for the train function, with one warning --------------

_XLA_WARNING = (
    "kerasdist: XLA was turned off for the train step of model {name!r} "
    "(model.jit_compile is now False): kerasdist's collectives have no XLA "
    "kernel {why}. Compile the model with jit_compile=False to silence this "
    "warning.")


def _xla_blocker(settings):
    """Why the collectives of the step of a DistributedOptimizer (its
    `settings`) cannot compile with XLA here, or None: a grouped
    allreduce, and for a sharded optimizer its reducescatter and allgather
    too (no XLA kernel on a GPU yet)."""
    shard = getattr(settings, "shard", None)
    why = xla_unsupported()
    if why is None and shard is not None:
        why = xla_unsupported("reducescatter") or \
            xla_unsupported("allgather")
        if why is not None:
            why += (f"; a sharded optimizer (shard={shard!r}) needs "
                    "reducescatter and allgather")
    return why


def _turn_off_xla(model, settings_of):
    """Before Keras builds a train function: no XLA with kerasdist inside,
    where the collectives its optimizer needs have no XLA kernel
    (xla_unsupported)."""
    settings = None if model.run_eagerly else settings_of(model.optimizer)
    if settings is None:
        return
    if not model.jit_compile:  # resolves "auto"
        return
    why = _xla_blocker(settings)
    if why is None:
        return  # XLA stays on: the collectives compile
    model.jit_compile = False
    model.train_function = None  # rebuilt without XLA
    if not getattr(model, "_kerasdist_xla_warned", False):
        model._kerasdist_xla_warned = True
        warnings.warn(_XLA_WARNING.format(name=model.name, why=why),
                      UserWarning,
                      stacklevel=3)


def install_train_function_hook(settings_of):
    """Wraps Keras's `make_train_function` (once per process).

    `fit` and `train_on_batch` call it before the first step is traced, so
    this is the last moment `jit_compile` can still be changed. Without the
    private class (a Keras change), the clear error in `apply` remains.
    """
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # pragma: no cover
        return
    original = TensorFlowTrainer.make_train_function
    if getattr(original, "_kerasdist_hook", False):
        return

    def make_train_function(self, force=False):
        _turn_off_xla(self, settings_of)
        return original(self, force=force)

    make_train_function._kerasdist_hook = True
    make_train_function.__doc__ = original.__doc__
    TensorFlowTrainer.make_train_function = make_train_function


FRAMEWORK = TensorFlow()
