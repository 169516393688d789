"""The Keras layer's seam: what DistributedOptimizer, the callbacks,
SyncBatchNormalization and the Trainer do differently on each framework
Keras runs on, chosen once.

`get()` returns the running backend's `KerasFramework`, from the
framework's own package (`kerasdist/tensorflow/_keras_layer.py`,
`kerasdist/jax/_keras_layer.py`, `kerasdist/torch/_keras_layer.py`), as Keras
chooses its backend's optimizer once and each backend overrides a few hooks.
The Keras layer calls its methods and never asks which framework runs:

- Gradients: `kerasdist.keras.reduction` reduces them, written once;
  the framework object says what a gradient is (sparse or dense, its size
  in bytes), how a collective is named uniquely in the program being traced
  and which collectives run on its tensors (TF ops; JAX's XLA custom
  calls, inside the jitted, stateless train step on tracers; PyTorch's
  custom ops in its eager step).
- Variables (broadcast, model averaging) go through the framework's
  collectives too, so a GPU tensor stays where it is.
- Small control values (metrics, step counts, flags, fingerprints) go
  through the core as numpy arrays on every framework (`_host.host_*`).

Nothing here imports Keras, TensorFlow, JAX or PyTorch: `get()` imports the
running backend's package only.
"""

import contextlib
import importlib

import numpy as np

from kerasdist import basics
from kerasdist import collectives as _collectives

_MODULES = {name: f"kerasdist.{name}._keras_layer"
            for name in _collectives.FRAMEWORKS}
_chosen = {}


def current():
    """The framework the Keras backend runs on ("tensorflow", "jax" or
    "torch"); ValueError if kerasdist does not support it."""
    return _collectives.keras_framework()


def get():
    """The running Keras backend's `KerasFramework` (imported once)."""
    name = current()
    framework = _chosen.get(name)
    if framework is None:
        framework = _chosen.setdefault(
            name, importlib.import_module(_MODULES[name]).FRAMEWORK)
    return framework


class KerasFramework:
    """What the Keras layer needs of a framework. The defaults fit a
    framework without graphs, sparse gradients or gradient accumulation of
    its own (JAX and PyTorch); each framework's `_keras_layer` module
    subclasses it and overrides what differs.

    Attributes:
        name: Keras' name of the backend.
        jit_compile: the `jit_compile` that fits a train step with
            kerasdist inside.
        mmap_large_blocks: whether a DistributedOptimizer has glibc
            return large freed blocks at once (see
            kerasdist.keras.optimizer); off where the step allocates its
            large temporaries anew each step (XLA on the CPU).
    """

    name = None
    jit_compile = False
    mmap_large_blocks = True

    # This framework's collectives module (`kerasdist/<framework>/
    # collectives.py`), named by each subclass with a plain import, so a
    # reader (or an editor's go-to-definition) follows the Keras layer's
    # `framework.collectives.grouped_allreduce` to its code. One function
    # per collective, taking this framework's tensors, the reduction op, a
    # resolved name and, where they apply, the scale factors, straight into
    # the core. The Keras layer's arguments are checked when it is built
    # (DistributedOptimizer, SyncBatchNormalization), so its collectives go
    # here directly rather than through the public ones
    # (`kerasdist.allreduce`...), which check a user's arguments and then
    # call these.
    collectives = None

    # ---- variables and values ------------------------------------------

    def value(self, variable):
        """A Keras variable's current value as the collectives take it."""
        return variable.value

    def regather(self, call, shards=()):
        """`call` (a layer's, reading the sharded weights `shards`)
        rematerialized: its backward runs it again (gathering the whole
        weights again) instead of keeping what its forward computed.
        `call(*inputs, anchor=x)` has its gathers wait for `x` rather
        than for its first input.
        Keras' remat: TensorFlow's recompute_grad, PyTorch's
        checkpoint; on JAX a custom VJP (kerasdist/jax/_keras_layer.py)."""
        import keras
        return keras.remat(call)

    def after(self, value, anchor):
        """`value`, computed only once `anchor` has been (a layer's
        shard, gathered only once the layer's input exists): where a
        traced program runs every ready op at once (TensorFlow's graph
        executor, XLA's schedule on JAX), each layer's gathered weights
        would otherwise all be made at the start of the step. Unchanged
        where ops run in program order."""
        return value

    def wait_before(self, tensors, done):
        """Has the ops that make `tensors` (whole gradients) run only
        once `done` (collectives' results) exist, where a traced program
        runs every ready op (TensorFlow's graph executor): the sharded
        optimizer's pacing (kerasdist/keras/sharding/step.py `scatter`).
        Nothing where ops run in program order or as they are called."""
        return

    def gather_rows(self, row, size, name):
        """Sharded weights' allgather: every rank's `row` (1, c), the
        same shape on each by the layout, stacked (size, c)."""
        return self.collectives.allgather(row, name=name)

    def gather_whole(self, flat, shapes, numels, chunks, size, gather_name,
                     grad_name):
        """Sharded weights' whole values (kerasdist/keras/sharding/
        views.py): `flat`, this rank's shards of them side by side (1-D,
        `chunks` elements each), allgathered (`gather_name`) into
        (size, sum of the chunks), each weight's column block reshaped to
        its shape (`shapes`, `numels`: padding dropped). Its gradient
        puts the whole gradients in one such buffer and reduce-scatters
        it once (`grad_name`, the average over the ranks) into this
        rank's row. Here in Keras ops; a framework with cheaper ops of
        its own (PyTorch) does the same in them."""
        import keras

        ops = keras.ops
        total = sum(chunks)

        @ops.custom_gradient
        def rows(x):
            every = self.gather_rows(ops.reshape(x, (1, -1)), size,
                                     gather_name)
            every = ops.reshape(every, (size, total))

            def grad(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                # The split's gradient: every whole gradient in one buffer.
                buffer = ops.reshape(self.dense(upstream), (size, total))
                return ops.reshape(self.scatter_rows(buffer, grad_name),
                                   (-1,))

            return every, grad

        # Column block j of every rank's row is weight j's shards in rank
        # order: its flattened (padded) whole value.
        every = rows(flat)
        pieces = ([every] if len(chunks) == 1
                  else self.split_columns(every, chunks))
        wholes = []
        for piece, shape, numel, chunk in zip(pieces, shapes, numels,
                                              chunks):
            if size * chunk != numel:  # padded
                piece = ops.reshape(piece, (-1,))[:numel]
            wholes.append(ops.reshape(piece, shape))
        return wholes

    def put(self, variable, value):
        """Sets a Keras variable to `value`, a tensor of its shape and
        dtype already (the sharded optimizer's per-step copies): Keras'
        `assign`, or where a framework can, the copy alone."""
        variable.assign(value)

    def gather_each(self, rows, names, size):
        """The sharded optimizer's allgathers (`rows`, 1-D, the same
        shapes on every rank; `names`, one each; `size` ranks): yields
        each result (size * c,) in order. Here one after another; a framework
        that can start several before waiting (PyTorch) does."""
        for row, name in zip(rows, names):
            yield self.collectives.allgather(row, name=name)

    def scatter_rows(self, rows, name):
        """Their gradients' reduce-scatter: the average of `rows`
        (size, c) over the ranks, this rank's row (1, c)."""
        return self.collectives.reducescatter(
            rows, op=basics.Average, name=name, prescale_factor=1.0,
            postscale_factor=1.0)

    def split_columns(self, x, sizes):
        """A 2-D tensor's column blocks of `sizes` (ints) columns each,
        by one split: its gradient is one concatenation, never a
        whole-size buffer a block."""
        import keras
        ends = np.cumsum(sizes)[:-1].tolist()
        return keras.ops.split(x, ends, axis=1)

    def no_grad(self):
        """A context in which assignments are not recorded for autograd."""
        return contextlib.nullcontext()

    def executing_eagerly(self):
        """Whether ops run now rather than being traced into a graph."""
        return True

    def to_numpy(self, x):
        import keras
        return np.asarray(keras.ops.convert_to_numpy(x))

    def assign_broadcast(self, variables, root_rank, names):
        """Assigns `root_rank`'s value of each variable to it, on every
        rank (one broadcast per variable, named by `names`)."""
        from kerasdist.keras.sharding.malloc import give_back_freed

        impl = self.collectives
        with self.no_grad():
            for v, n in zip(variables, names):
                v.assign(impl.broadcast(self.value(v), root_rank, n))
        give_back_freed()

    def assign_average(self, variables, name):
        """A function that replaces each variable by its average over the
        ranks: one grouped allreduce, then the assignments."""
        impl = self.collectives

        def average():
            with self.no_grad():
                values = impl.grouped_allreduce(
                    [self.value(v) for v in variables], basics.Average,
                    name, 1.0, 1.0)
                for v, x in zip(variables, values):
                    v.assign(x)

        return average

    def eager(self, fn):
        """`fn`, run outside the framework's compiler where a compiled
        step would trace it (PyTorch's torch.compile); `fn` elsewhere."""
        return fn

    def unique_name(self, base):
        """`base`, made unique within the program being traced where
        several collectives of one name could meet (identical on every
        rank); unchanged where collectives of one name run one after the
        other."""
        return base

    def agree_finite(self, finite, prefix):
        """A LossScaleOptimizer's finiteness flag, True only if it is True
        on every rank (one allreduce Min), as a tensor of this backend."""
        import keras
        flag = keras.ops.cast(finite, "int32")
        agreed = self.collectives.allreduce(
            flag, basics.Min,
            self.unique_name(f"{prefix}.loss_scale_finite"), 1.0, 1.0)
        return keras.ops.greater(agreed, 0)

    # ---- gradients (kerasdist.keras.reduction) ---------------------

    def is_sparse(self, grad):
        """Whether `grad` is a sparse gradient (TensorFlow's
        `tf.IndexedSlices`)."""
        return False

    def dense(self, grad):
        """`grad` as a dense tensor of this framework."""
        return grad

    def gathers_sparse(self, label):
        """Whether a sparse gradient (of the source `label`) can be
        allgathered here; False: it is allreduced dense instead (the
        framework says so once)."""
        return True

    def nbytes(self, x):
        """A dense tensor's size in bytes, or None if not known yet."""
        return int(np.prod(x.shape, dtype=np.int64)) * \
            np.dtype(x.dtype).itemsize

    def dtype_name(self, x):
        return str(x.dtype)

    def can_bucket(self):
        """Whether gradients may go in buckets here (they overlap nothing
        where every op waits for its result)."""
        return True

    def bucket_bytes(self, settings):
        """The bucket size a DistributedOptimizer's synchronous reduction
        splits by (its `settings`), or None: one group."""
        return None

    # ---- DistributedOptimizer ------------------------------------------

    def on_wrap(self, settings_of):
        """Called when an optimizer is wrapped; `settings_of(optimizer)`
        gives a DistributedOptimizer's settings (also through a wrapper
        around one), None for any other optimizer."""

    def check_apply(self):
        """Raises where a DistributedOptimizer cannot apply gradients."""

    def check_passes(self, backward_passes_per_step):
        if backward_passes_per_step > 1:
            raise ValueError(
                "DistributedOptimizer(backward_passes_per_step > 1) needs "
                f"the TensorFlow backend; on {self.name} pass gradient_"
                "accumulation_steps to the Keras optimizer instead (the "
                "gradients are then averaged over the ranks at every "
                "backward pass).")

    def overlap(self):
        """A new optimizer's reduction overlapped with backprop (an object
        whose `take` gives what it reduced during backprop, see
        kerasdist/torch/_keras_layer.py), or None where the buckets of the
        synchronous reduction serve."""
        return None
