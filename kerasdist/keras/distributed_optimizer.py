"""`DistributedOptimizer` and `PartialDistributedOptimizer`: Horovod's
wrappers of a Keras optimizer, for Keras 3 on every backend. They check
the arguments and combine the step of the mode asked for (replicated,
kerasdist/keras/optimizer.py, or sharded, kerasdist/keras/sharding/
optimizer.py) with the user's optimizer class; the module docstring of
kerasdist/keras/optimizer.py says where the gradients are reduced."""

import os

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist._core import gradients as _gradients
from kerasdist.keras import buckets as _buckets
from kerasdist.keras import framework as _framework
from kerasdist.keras import optimizer as _optimizer
from kerasdist.keras import reduction as _reduction
from kerasdist.keras.compression import Compression
from kerasdist.keras.sharding import optimizer as _sharding

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]

SHARD_MODES = (None, "optimizer_state", "gradients", "weights")

# Optimizers whose update of a variable depends on more than each of its
# elements alone: they cannot run on shards.
_WHOLE_VARIABLE = ("Lamb", "Adafactor", "Muon")


def check_shard(shard, base, settings):
    """Raises ValueError for a `shard=` that cannot work with the other
    arguments (`settings`) or the optimizer class `base`."""
    if shard not in SHARD_MODES:
        raise ValueError(
            f"DistributedOptimizer: shard must be None, 'optimizer_state', "
            f"'gradients' or 'weights'; got {shard!r}.")
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
    if shard == "weights" and (settings.backward_passes_per_step != 1 or
                               settings.process_set_id):
        raise ValueError(
            "DistributedOptimizer(shard='weights') reduces every gradient "
            "over all ranks as the backward pass runs: it takes neither "
            "backward_passes_per_step > 1 (use the Keras optimizer's "
            "gradient_accumulation_steps) nor a process_set.")
    if settings.op == basics.Adasum:
        raise ValueError(
            f"DistributedOptimizer(shard={shard!r}) cannot use Adasum: its "
            "result depends on whole gradients; use op=Average or Sum.")


class _Settings:
    """The wrapper's arguments (a plain object, so Keras/TF do not track it)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def DistributedOptimizer(optimizer, name=None,
                         compression=Compression.none, op=None,
                         backward_passes_per_step=1,
                         average_aggregated_gradients=False,
                         sparse_as_dense=False, gradient_predivide_factor=1.0,
                         num_groups=0, scale_local_gradients=True,
                         average=None, process_set=None, overlap=None,
                         bucket_bytes=None, shard=None):
    """Wraps a Keras optimizer so that gradients are averaged over all ranks
    (over the ranks of `process_set`, a `kerasdist.ProcessSet`, when given:
    only its members may then train with it).

    The result is an instance of a subclass of `type(optimizer)` (so
    `isinstance(opt, keras.optimizers.Adam)` holds), built from
    `optimizer.get_config()`; its `get_config()` is the original optimizer's,
    so `model.save()` writes a file that `keras.models.load_model` reads
    without kerasdist (the loaded optimizer is the plain class: wrap it again
    to continue distributed training). A built optimizer's state (iterations,
    slots) is copied into the wrapper.

    Gradients are reduced at the top of `apply`, which `model.fit`,
    `apply_gradients` and `LossScaleOptimizer` all go through, before
    clipping and the update, by the runtime's fused allreduce. Each gradient
    is named after its variable's path, so every rank must build the same
    model.

    Args:
        optimizer: a `keras.optimizers.Optimizer` (SGD, Adam, AdamW,
            RMSprop, `keras.mixed_precision.LossScaleOptimizer`, ...), or
            what `keras.optimizers.get` takes: a name such as "adam"
            (Keras' defaults) or a config dict.
        name: prefix of the collective names (default
            "DistributedOptimizer"); give two optimizers of one model
            different names.
        compression: `kerasdist.Compression.none` (default) or
            `kerasdist.Compression.fp16`.
        op: `kerasdist.Average` (None, the default), `kerasdist.Sum` or
            `kerasdist.Adasum` (as in Horovod: no division by `size()`;
            a power-of-two number of ranks; see docs/architecture.md for
            the learning rate).
        backward_passes_per_step: communicate and update once every this
            many `apply` calls; in between, gradients are summed locally
            (sparse gradients densified) and weights do not change.
            `iterations` counts updates.
        average_aggregated_gradients: divide the local sum by
            `backward_passes_per_step` before communicating.
        sparse_as_dense: allreduce `tf.IndexedSlices` gradients (Embedding)
            as dense tensors instead of allgathering them.
        gradient_predivide_factor: with op=Average, scale by 1/f before the
            sum and by f/size after it (both in the runtime).
        num_groups: 0 (default): all dense gradients of a step in one
            `kerasdist.grouped_allreduce` (one TF op; the runtime fuses it
            into buffers of up to the fusion threshold). n > 0: split the
            gradients, in order, into n groups of nearly equal count, one
            grouped allreduce each, so that communication of the groups
            finished first can start earlier. The result is the same
            either way. (Horovod's 0 meant one op per gradient; here that
            per-op cost is what grouping avoids.)
        scale_local_gradients: divide the gradients of local variables
            (`register_local_var`, `PartialDistributedOptimizer`'s
            `local_layers`) by `size()`, as Horovod does (default True).
        average: Horovod's deprecated form of `op`: True is Average,
            False Sum (a DeprecationWarning); ValueError with `op`.
        overlap: with `num_groups=0`, reduce the gradients in buckets of
            up to `bucket_bytes`, in the order backprop produces them (the
            last layer's first), so that communication overlaps the rest
            of backprop. TensorFlow: each bucket is one grouped allreduce op
            in the train step's graph, which TF's executor runs as soon as
            the bucket's gradients exist, while it goes on computing the
            others (eagerly, and with `backward_passes_per_step > 1`, the
            gradients stay in one group). PyTorch: each bucket's allreduce
            starts from autograd hooks as soon as its gradients exist (from
            the second step on; the first step installs the hooks). JAX:
            each bucket is a custom call of its own; only when asked for
            (True, or `KERASDIST_OVERLAP=1` set), since XLA's CPU runtime
            runs the step's operations in sequence and waits for each
            custom call before the next, so more calls only add round trips
            there (see docs/keras.md). The result is the same. None
            (default): the environment's `KERASDIST_OVERLAP` (default 1: on
            where it is faster, TensorFlow and PyTorch).
        bucket_bytes: the most bytes in a bucket (the first bucket is at
            most 1 MiB, as in PyTorch DDP). None: `KERASDIST_BUCKET_BYTES`
            (default 25 MiB).
        shard: None (default): every rank holds the whole optimizer state.
            "optimizer_state" (ZeRO-1): each rank keeps the optimizer state
            (Adam's moments, momentum, EMA, accumulators) of 1/size() of
            every variable only; the gradients are reduce-scattered (in
            buckets of `bucket_bytes`, in backprop order), each rank
            updates its shard, and the weights are allgathered back, the
            same bytes on the wire as an allreduce.
            "gradients" (ZeRO-2): the same, and the whole gradients that a
            framework keeps between steps (PyTorch's `.grad`) are dropped
            once reduced. The result equals the replicated optimizer's.
            Needs an elementwise update (SGD, Adam, AdamW, RMSprop, ...;
            not Lamb, Adafactor or Muon), no Adasum and no local
            variables. The gradients a `DistributedGradientTape` returned
            over the same ranks (TensorFlow) are averaged already: each
            rank slices its shard of them instead of reduce-scattering
            (see the tape). See kerasdist/keras/sharding/ and docs/keras.md.
            "weights" (ZeRO-3): for a model whose weights
            `kerasdist.shard_weights(model)` sharded: each rank holds
            1/size() of every trainable weight too, the layers allgather
            them as they run, and their gradients arrive reduce-scattered;
            the optimizer updates the shards in place.

    Local variables: `opt.register_local_var(var)` keeps `var`'s gradient
    on its rank (not reduced; divided by `size()` unless
    `scale_local_gradients=False`), as Horovod's. Every rank must register
    the same variables.

    With one rank (`size() == 1`) no collective is created: averaging over
    one rank is the identity, so only compression and
    `backward_passes_per_step` act, and the per-step cost is that of the
    plain optimizer.

    Backends: the same on TensorFlow, JAX and PyTorch, except that
    `backward_passes_per_step > 1` needs TensorFlow (elsewhere pass
    `gradient_accumulation_steps` to the Keras optimizer) and that only
    TensorFlow has `tf.IndexedSlices` gradients (`sparse_as_dense`).

    XLA (TensorFlow): the TF ops have XLA kernels (custom calls into the
    runtime) on the CPU, and on a GPU in a build with the core's GPU
    backend, so a model compiled with `jit_compile=True` keeps XLA, as
    does a custom step in `tf.function(jit_compile=True)`. In a build
    without them (TF_XLA=0; on a GPU, without the GPU backend): when
    `model.fit` (or `train_on_batch`) is about to build the train function
    of a model compiled with `jit_compile=True` (or "auto" resolved to XLA,
    as on a GPU) and this optimizer, kerasdist sets
    `model.jit_compile = False` and warns once per model; compile with
    `jit_compile=False` to silence it. A custom train step in
    `tf.function(jit_compile=True)` cannot be intercepted there and raises
    a RuntimeError that says so.

    Mixed precision: wrap a `LossScaleOptimizer`
    (`DistributedOptimizer(LossScaleOptimizer(opt))`) and the finiteness
    check sees the averaged gradients. Keras does the opposite under the
    `mixed_float16` policy: `compile` wraps this optimizer in its own
    `LossScaleOptimizer`, whose check sees each rank's local gradients, so
    one rank could skip the step (and its allreduces) while another takes
    it. kerasdist handles that case: a `LossScaleOptimizer` created around
    a DistributedOptimizer gets a finiteness check that is agreed over all
    ranks (one small allreduce Min), so every rank skips or applies the
    step together, and halves or grows the loss scale together.

    Returns:
        The distributed optimizer.

    Raises:
        ValueError: for an optimizer that is already distributed, or bad
            arguments.
        TypeError: if `optimizer` is not a Keras 3 optimizer.

    Example:
    >>> import keras, kerasdist
    >>> kerasdist.init()
    >>> opt = kerasdist.DistributedOptimizer(
    ...     keras.optimizers.Adam(0.001 * kerasdist.size()))
    >>> model.compile(optimizer=opt, loss="mse", jit_compile=False)
    """
    import keras

    if isinstance(optimizer, (str, dict)):
        # As keras' compile(optimizer="adam") accepts: a name or a config.
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as e:
            raise ValueError(f"DistributedOptimizer: {e}") from None
    if getattr(optimizer, "_kerasdist_settings", None) is not None:
        raise ValueError(
            "DistributedOptimizer got an optimizer that is already a "
            "kerasdist.DistributedOptimizer; wrap the plain optimizer once.")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError("DistributedOptimizer expects a "
                        "keras.optimizers.Optimizer (Keras 3); got "
                        f"{type(optimizer).__name__}.")
    op = _gradients.resolve_op(op, average)
    _reduction.check_args(op, compression, gradient_predivide_factor,
                          num_groups, "DistributedOptimizer")
    _check_passes(backward_passes_per_step)
    # Asked for, not defaulted: JAX splits its reduction only then (see
    # the docstring).
    overlap_asked = overlap is not None or _buckets.OVERLAP_ENV in os.environ
    overlap, bucket_bytes = _buckets.resolve_settings(
        overlap, bucket_bytes, "DistributedOptimizer")
    if op == basics.Adasum and average_aggregated_gradients:
        raise ValueError("DistributedOptimizer: Adasum does not support "
                         "average_aggregated_gradients=True (as in "
                         "Horovod).")
    settings = _Settings(
        prefix=name or "DistributedOptimizer", compression=compression, op=op,
        shard=shard,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        scale_local_gradients=bool(scale_local_gradients),
        process_set_id=_process_sets.resolve(process_set),
        overlap=overlap and num_groups == 0, bucket_bytes=bucket_bytes,
        jax_buckets=overlap and overlap_asked and num_groups == 0)
    check_shard(shard, type(optimizer), settings)
    _framework.get().on_wrap(_optimizer.settings_of)
    step = _optimizer.ReplicatedStep if shard is None else \
        _sharding.ShardedStep
    cls = _optimizer.combined(step, type(optimizer), settings)
    wrapped = cls.from_config(optimizer.get_config())
    if optimizer.built:
        _copy_state(optimizer, wrapped)
    return wrapped


def PartialDistributedOptimizer(optimizer, name=None,
                                compression=Compression.none,
                                sparse_as_dense=False,
                                gradient_predivide_factor=1.0,
                                op=basics.Average,
                                backward_passes_per_step=1,
                                average_aggregated_gradients=False,
                                num_groups=0, local_layers=None,
                                scale_local_gradients=True, overlap=None,
                                bucket_bytes=None):
    """A `DistributedOptimizer` whose `local_layers` keep their gradients
    on each rank, as Horovod's: their trainable weights are not reduced
    (their gradients are divided by `size()` unless
    `scale_local_gradients=False`); every other gradient is reduced as
    `DistributedOptimizer` reduces it.

    Args:
        optimizer: as `DistributedOptimizer`'s.
        local_layers: a `keras.layers.Layer` or a list of them (default
            none: the same as `DistributedOptimizer`). Their trainable
            weights are read when gradients are reduced, so a layer may be
            built after wrapping. Every rank must pass the same layers.
        scale_local_gradients: divide the local gradients by `size()`.
        The other arguments are `DistributedOptimizer`'s.

    Returns:
        The distributed optimizer (`register_local_var` adds more local
        variables).

    Raises:
        ValueError: if an element of `local_layers` is not a Keras layer,
            or for arguments `DistributedOptimizer` refuses.

    Example:
    >>> opt = kerasdist.PartialDistributedOptimizer(
    ...     keras.optimizers.SGD(0.1), local_layers=[model.layers[-1]])
    """
    layers = _reduction.local_layers(local_layers,
                                          "PartialDistributedOptimizer")
    wrapped = DistributedOptimizer(
        optimizer, name=name, compression=compression, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, scale_local_gradients=scale_local_gradients,
        overlap=overlap, bucket_bytes=bucket_bytes)
    _optimizer.add_local_layers(wrapped, layers)
    return wrapped


def _check_passes(backward_passes_per_step):
    if not isinstance(backward_passes_per_step, int) or \
            backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be an int >= 1; got "
                         f"{backward_passes_per_step!r}.")
    _framework.get().check_passes(backward_passes_per_step)


def _copy_state(source, target):
    if getattr(target._kerasdist_settings, "shard", None) is not None:
        # Each rank keeps its shard of the built optimizer's slots.
        import keras
        target.build(source._trainable_variables)
        if len(target.variables) != len(source.variables):
            raise ValueError(
                f"DistributedOptimizer(shard=...): the wrapper has "
                f"{len(target.variables)} optimizer variables but the built "
                f"optimizer has {len(source.variables)}.")
        target.kerasdist_assign_whole(
            [keras.ops.convert_to_numpy(v) for v in source.variables])
        return
    # Build the wrapper on the same variables, then take over the slots,
    # iterations (and a LossScaleOptimizer's scale and inner state).
    target.build(source._trainable_variables)
    target.built = True
    if len(target.variables) != len(source.variables):
        raise ValueError(
            f"DistributedOptimizer: the wrapper has {len(target.variables)} "
            f"optimizer variables but the built optimizer has "
            f"{len(source.variables)}; wrap it before building it.")
    for dst, src in zip(target.variables, source.variables):
        dst.assign(src)
