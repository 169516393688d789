"""Sharded weights (`kerasdist.shard_weights(model)` with
`DistributedOptimizer(opt, shard="weights")`: ZeRO-3, FSDP's full
sharding), written once for every Keras backend.

Each trainable weight of the model is replaced, where the layer tracks it,
by a 1-D variable holding only this rank's shard (the partition of
`kerasdist.keras.sharding.layout`: rank r owns elements [r * c, (r + 1) * c)
of the weight flattened and zero-padded to N * c). Where the layer keeps the
weight as an attribute (`self._kernel`, `self.bias`...), a *whole view*
takes its place: a Keras variable of the weight's shape and dtype that holds
nothing, whose value is the allgather of the shards, read when the layer
reads it (in its `call`, inside Keras' traced or jitted step) and freed
after use. The view's gradient is the reduce-scatter (average over the
ranks) of the whole weight's gradient straight into the shard, so Keras'
trainers, on every backend, compute gradients of the shards: the
optimizer (`ShardedStep` in "weights" mode) updates the shards in place,
with nothing to gather after the step. A layer's own sharded weights are
gathered together when its call begins, in one allgather (FSDP's flat
parameter; one a dtype, a weight of 1 MiB or more alone), and their
gradients reduce-scattered together; a weight read anywhere else
(`layer.kernel` outside a call) gathers alone.

Everything else a user reads sees whole weights: `model.get_weights()`,
`set_weights`, `save`/`save_weights`/`load_weights`, `summary()` run with
the layers' variable lists showing the views (`whole_weights`), and
`layer.kernel` is the view. Reading a whole weight is a collective: every
rank of the job reads it (as `kerasdist.save_model`).
"""

import contextlib
import math

from kerasdist import basics
from kerasdist._core import grow as _grow
from kerasdist._core import host as _host
from kerasdist.keras import framework as _framework
from kerasdist.keras.sharding import loading as _loading
from kerasdist.keras.sharding import malloc as _malloc
from kerasdist.keras.sharding import units as _units
from kerasdist.keras.sharding import views as _views
from kerasdist.keras.sharding.layout import itemsize
from kerasdist.keras.sharding.layout import partition

# With remat=None, a layer whose sharded weights are this many bytes or
# more whole is rematerialized (gathered again for its backward).
REMAT_BYTES = 1 << 20

_METHODS = ("get_weights", "set_weights", "save_weights", "load_weights",
            "save", "summary", "count_params")


class WeightShard:
    """What a shard variable (and its view) knows of the whole weight."""

    def __init__(self, path, shape, dtype, size, rank):
        self.path = path
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.numel = math.prod(self.shape)
        self.size = size
        self.rank = rank
        self.chunk = partition([self.numel], size)[0]
        self.shard = None  # the shard variable
        self.view = None  # the whole view


def info(variable):
    """The `WeightShard` of a shard variable (or a view), else None."""
    return getattr(variable, "_kerasdist_weight", None)


def is_shard(variable):
    return info(variable) is not None and info(variable).shard is variable


def shards_in(variables):
    return [v for v in variables if is_shard(v)]


def shard_weights(model=None, root_rank=0, remat=None, frozen=True,
                  min_unit_bytes=0):
    """Shards the trainable weights of a built Keras model over every rank
    (ZeRO-3, FSDP's full sharding): afterwards each rank holds 1/N of
    every trainable weight, and the layers read whole weights by
    allgather as they run. Train it with `DistributedOptimizer(opt,
    shard="weights")`. A collective: every rank calls it, with the same
    model; the weights start as `root_rank`'s (one broadcast a weight,
    one weight whole at a time). Returns the model.

    Without a model, a context in which every layer built is sharded as
    soon as it is built (DeepSpeed's `zero.Init`): a model built inside
    never holds more than one layer's whole weights. Call
    `shard_weights(model)` on the model afterwards all the same (it then
    only makes `get_weights`, saving and `summary` see whole weights).

    Args:
        model: a built Keras model, or None (the context).
        root_rank: the rank whose initial weights every rank takes.
        remat: gather a layer's weights again for its backward rather
            than keeping them from its forward (TensorFlow and PyTorch;
            JAX's jitted step keeps them): None (default) for layers
            whose weights are REMAT_BYTES or more whole (a small layer's
            second gather costs more time than its weights save), True
            for every layer, False for none.
        frozen: also shard the frozen weights (made trainable, then
            frozen: a LoRA base, a layer with `trainable = False`), which
            are gathered for the forward and never updated. State a layer
            updates itself (BatchNormalization's moving averages) stays
            whole on every rank.
        min_unit_bytes: a layer whose sharded weights are this many
            bytes or more whole gathers them at its own call (a unit of
            its own, as FSDP's size-based wrapping); the smaller ones
            (not rematerialized) are gathered together when the model's
            call begins, one allgather and one reduce-scatter a step for
            all of them (FSDP's root unit), their whole weights alive
            from the forward to the backward. Fewer collectives a step
            for a model of many small layers. 0 (default): every layer
            is a unit of its own.

    Raises:
        ValueError: for a model not built yet, a weight with a constraint
            (it would act on shards), or a weight a layer does not keep
            as an attribute (its reads could not be redirected).
    """
    _malloc.return_large_blocks()
    if model is None:
        if min_unit_bytes:
            raise ValueError(
                "kerasdist.shard_weights(min_unit_bytes=...) applies to a "
                "built model: give it to the shard_weights(model) call "
                "made after the `with kerasdist.shard_weights():` block.")
        return _ShardedInit(root_rank, remat, frozen)
    if not model.built:
        raise ValueError(
            "kerasdist.shard_weights(model): the model is not built yet; "
            "build it first (call it on a batch, model.build(shape), or "
            "give it an Input) so that its weights exist.")
    for layer in _layers(model):
        _plan(layer, frozen)  # checks every layer before any changes
    sharder = _Sharder(root_rank, remat, frozen)
    for layer in _layers(model):
        sharder.shard(layer, own=False)
    functional = getattr(model, "_functional", None)  # a Sequential's
    for layer in _layers(model) + ([functional] if functional else []):
        if hasattr(layer, "_torch_params"):
            layer._track_variables()  # PyTorch's parameters: the shards
    if min_unit_bytes:
        _units.gather_small_layers_at_the_call(
            _layers(model), min_unit_bytes, _own_shards)
    _install_whole_methods(model)
    _loading.install(model)  # load_weights reads each rank's slices
    return model


class _Sharder:
    """Shards layers one at a time, numbering the broadcasts alike on
    every rank."""

    def __init__(self, root_rank, remat, frozen):
        self.root_rank, self.remat, self.frozen = root_rank, remat, frozen

    def shard(self, layer, own=True):
        """Shards `layer`'s own trainable weights (checked first)."""
        import keras

        framework = _framework.get()
        size, rank = basics.size(), basics.rank()
        plan = _plan(layer, self.frozen)
        for variable, attrs in plan:
            _SHARDED[0] += 1
            _shard_one(keras, framework, layer, variable, attrs, size, rank,
                       self.root_rank, _SHARDED[0])
        if own and plan and hasattr(layer, "_torch_params"):
            layer._track_variables()
        # Not a layer with state of its own (BatchNormalization's moving
        # averages): its call, run again, would update it twice.
        mine = _own_shards(layer)
        _keras_remat_regathers(layer)
        if mine:
            _gather_per_call(layer)
        large = sum(w.numel * itemsize(w.dtype) for w in mine) >= \
            REMAT_BYTES
        if mine and not layer._non_trainable_variables and (
                self.remat or (self.remat is None and large)):
            _regather_in_backward(layer)


# How many weights this process has sharded (their broadcasts' names,
# alike on every rank); the open `shard_weights()` contexts, innermost
# last, and the Layer._post_build they replaced.
_SHARDED = [0]
_OPEN = []
_REPLACED = []


class _ShardedInit:
    """`shard_weights()`'s context: each layer is sharded once built."""

    def __init__(self, root_rank, remat, frozen):
        self.sharder = _Sharder(root_rank, remat, frozen)

    def __enter__(self):
        from keras.src.layers.layer import Layer

        if not _OPEN:
            original = Layer.__dict__.get("_post_build")

            def _post_build(layer):
                if original is not None:
                    original(layer)
                else:
                    super(Layer, layer)._post_build()
                if _OPEN:
                    _OPEN[-1].sharder.shard(layer)

            Layer._post_build = _post_build
            _REPLACED[:] = [original]
        _OPEN.append(self)
        return self

    def __exit__(self, *exc):
        from keras.src.layers.layer import Layer

        _OPEN.pop()
        if not _OPEN:
            original = _REPLACED.pop()
            if original is None:
                del Layer._post_build
            else:
                Layer._post_build = original
        return False


def _gather_per_call(layer):
    """The layer's call, gathering all of its own sharded weights at once
    when it begins (`views.gather_layer`: one allgather, and one
    reduce-scatter for their gradients, rather than one a weight); its
    views read them while it runs. Inside `_regather_in_backward`'s
    call, so that the backward's recomputation gathers again."""
    call = layer.call
    if getattr(call, "_kerasdist_grouped", False) or \
            getattr(call, "_kerasdist_regather", False) or \
            getattr(layer, "_kerasdist_in_unit", False):  # units.py's
        return

    def grouped(*args, **kwargs):
        return _views.call_in_frame(_own_shards(layer), call, args, kwargs)

    grouped._kerasdist_grouped = True
    grouped._kerasdist_inner = call
    object.__setattr__(layer, "call", grouped)


def _regather_in_backward(layer):
    """The layer's call, rematerialized (TensorFlow's recompute_grad,
    PyTorch's checkpoint, a custom VJP on JAX): its whole weights
    are freed after its forward and gathered again for its backward,
    rather than kept alive from the forward to the backward."""
    if not getattr(layer.call, "_kerasdist_regather", False):
        object.__setattr__(layer, "call", _regathered(layer, layer.call))


def _regathered(layer, call):
    from keras.src.backend.common import variables as _variables

    def regathered(*args, **kwargs):
        # The keyword arguments (training=...) bound: TensorFlow's
        # recompute_grad takes tensors only. The autocast scope of the
        # forward (mixed precision) holds again when the backward runs
        # the call again, outside the layer's __call__.
        scope = _variables.get_autocast_scope()
        dtype = None if scope is None else scope.dtype

        def again(*inputs, anchor=None):
            # What the gathers wait for: the layer's input, or (JAX's
            # recomputation in the backward) the cotangent.
            if anchor is None and inputs:
                anchor = inputs[0]
            _views.ANCHORS.append(anchor)
            try:
                if dtype is None:
                    return call(*inputs, **kwargs)
                with _variables.AutocastScope(dtype):
                    return call(*inputs, **kwargs)
            finally:
                _views.ANCHORS.pop()

        shards = [v for v in layer._trainable_variables if is_shard(v)]
        return _framework.get().regather(again, shards)(*args)

    regathered._kerasdist_regather = True
    return regathered


def _keras_remat_regathers(layer):
    """A layer that Keras rematerializes (built under `keras.RematScope`)
    and that reads sharded weights: Keras' own remat around the gathers
    is jax.checkpoint on JAX, which refuses collectives ("Effects not
    supported in partial-eval of `checkpoint`"), and TensorFlow's
    recompute_grad, which refuses the call's keyword arguments in a
    traced step (keras#21207). A layer with sharded weights of its own
    is rematerialized as `_regather_in_backward` does instead (its
    recomputation gathers again), unless kerasdist does already or it has
    state of its own (BatchNormalization: its call run again would update
    it twice); a layer that only holds sharded layers (a model, a block)
    is not rematerialized itself (its layers are, each as it asks). The
    "activations" mode (the activation alone recomputed, no gather in
    it) stays Keras'."""
    keras_remat = layer.rematerialized_call
    if getattr(keras_remat, "_kerasdist_remat", False):
        return

    def rematerialized_call(layer_call, *args, **kwargs):
        wrapped = keras_remat(layer_call, *args, **kwargs)
        mode = getattr(getattr(layer, "_remat_mode", None), "mode", None)
        if wrapped is layer_call or mode == "activations" or \
                not any(is_shard(v) for v in layer.weights):
            return wrapped
        own = any(is_shard(v) for v in layer._trainable_variables)
        if not own or layer._non_trainable_variables or \
                getattr(layer_call, "_kerasdist_regather", False):
            return layer_call
        return _regathered(layer, layer_call)

    rematerialized_call._kerasdist_remat = True
    object.__setattr__(layer, "rematerialized_call", rematerialized_call)


def _layers(model):
    return list(model._flatten_layers(include_self=True, recursive=True))


def _own_shards(layer):
    """The `WeightShard`s of `layer`'s own sharded weights."""
    return [info(v) for v in layer._trainable_variables if is_shard(v)]


def _plan(layer, frozen):
    """(variable, attribute names) of each of `layer`'s own weights to
    shard (those made trainable; with `frozen`, also those frozen since),
    checked before anything changes."""
    plan = []
    for v in list(layer._trainable_variables):
        if info(v) is not None or not (v.trainable or frozen):
            continue
        if getattr(v, "constraint", None) is not None:
            raise ValueError(
                f"kerasdist.shard_weights: the weight {v.path} has a "
                f"constraint ({v.constraint!r}), which needs the whole "
                "weight after each update; sharded weights cannot keep "
                "it. Remove the constraint, or train this model with "
                "shard='gradients'.")
        attrs = [name for name, value in vars(layer).items() if value is v]
        if not attrs:
            raise ValueError(
                f"kerasdist.shard_weights: layer {layer.name!r} "
                f"({type(layer).__name__}) keeps its weight {v.path} "
                "somewhere other than one of its attributes, so its "
                "reads cannot be redirected to the shards. Train this "
                "model with shard='gradients', or keep the weight as "
                "an attribute (self.w = self.add_weight(...)).")
        plan.append((v, attrs))
    return plan


def _shard_one(keras, framework, layer, variable, attrs, size, rank,
               root_rank, k):
    dtype = keras.backend.standardize_dtype(variable._dtype)
    weight = WeightShard(variable.path, variable.shape, dtype, size, rank)
    # On the host, as own_piece reads it anyway: TensorFlow's eager
    # broadcast op keeps its output buffer for its next call, one kernel
    # (and one whole weight) a name, for as long as the process lives.
    whole = framework.to_numpy(framework.value(variable))
    if not _grow.joining():  # a new rank of a grown job: the commit's
        whole = _host.host_broadcast(whole, root_rank,
                                     f"kerasdist.shard_weights.{k}")
    piece = _views.own_piece(weight, whole)
    del whole
    shard = keras.Variable(
        initializer=piece, shape=(weight.chunk,), dtype=dtype,
        trainable=variable.trainable,
        autocast=getattr(variable, "_autocast", True), name=variable.name)
    shard._path = variable.path
    shard._kerasdist_weight = weight
    view = object.__new__(_views.view_class(type(variable)))
    view.__dict__.update(variable.__dict__)
    view._value = None
    view._kerasdist_weight = weight
    weight.shard, weight.view = shard, view
    store = layer._trainable_variables
    at = next(i for i, x in enumerate(store) if x is variable)
    store[at] = shard
    ids = getattr(layer._tracker, "stored_ids", {}).get(
        "trainable_variables")
    if ids is not None:
        ids.discard(id(variable))
        ids.add(id(shard))
    for name in attrs:
        object.__setattr__(layer, name, view)
    _forget_dependencies(layer, attrs)


def _forget_dependencies(layer, attrs):
    """TensorFlow's object tracking (a layer is a tf.Module) keeps the
    whole variable under its attribute's name: dropped, so that it is
    freed."""
    names = getattr(layer, "_self_unconditional_dependency_names", None)
    refs = getattr(layer, "_self_unconditional_checkpoint_dependencies",
                   None)
    for name in attrs:
        if names is not None and name in names:
            del names[name]
        if refs is not None:
            refs[:] = [r for r in refs if r.name != name]


@contextlib.contextmanager
def whole_weights(model):
    """Within: every layer's variable lists show the whole views in place
    of the shards, so Keras' saving, loading, `get_weights`, `summary`
    see the model as one process does."""
    swapped = []
    for layer in _layers(model):
        store = layer._trainable_variables
        if not any(is_shard(v) for v in store):
            continue
        swapped.append((layer, list(store)))
        store[:] = [info(v).view if is_shard(v) else v for v in store]
    try:
        yield
    finally:
        for layer, original in swapped:
            layer._trainable_variables[:] = original


def _install_whole_methods(model):
    if getattr(model, "_kerasdist_whole_methods", False):
        return
    for name in _METHODS:
        method = getattr(model, name, None)
        if method is None:
            continue
        object.__setattr__(model, name, _whole(model, method))
    object.__setattr__(model, "_kerasdist_whole_methods", True)


def _whole(model, method):
    def call(*args, **kwargs):
        with whole_weights(model):
            return method(*args, **kwargs)

    call.__name__ = getattr(method, "__name__", "call")
    call.__doc__ = getattr(method, "__doc__", None)
    return call


def check_mode(variables, shard):
    """The `WeightShard`s of `variables` for shard="weights" (all must be
    shards of sharded weights); [] otherwise, where none may be.

    Raises:
        ValueError: where the optimizer's mode and the model disagree.
    """
    variables = list(variables)
    found = [info(v) for v in variables if is_shard(v)]
    if shard == "weights":
        if len(found) != len(variables):
            raise ValueError(
                "DistributedOptimizer(shard='weights') trains a model whose "
                "weights kerasdist.shard_weights(model) has sharded; "
                f"{len(variables) - len(found)} of the {len(variables)} "
                "variables it was given are whole. Call "
                "kerasdist.shard_weights(model) after building the model "
                "and before compiling it.")
        return found
    if found:
        raise ValueError(
            f"DistributedOptimizer(shard={shard!r}) was given the shards of "
            "a model whose weights kerasdist.shard_weights() sharded: each "
            "rank's gradients are of its own shard, averaged already. Use "
            "DistributedOptimizer(opt, shard='weights').")
    return []
