"""`load_model`: a saved Keras model whose optimizer is wrapped in
`DistributedOptimizer` again, as Horovod's `hvd.load_model`; `save_model`:
a model file plain Keras loads, also from a sharded optimizer."""

from kerasdist.keras.compression import Compression

__all__ = ["load_model", "save_model"]


def save_model(model, filepath, **kwargs):
    """Saves `model` as `model.save(filepath, **kwargs)` does, on rank 0;
    call it on every rank. The file is written whole or not at all (a
    temporary file beside it, renamed).

    With a sharded optimizer (`DistributedOptimizer(shard=...)`) each
    rank holds a shard of the optimizer's slots: every rank sends its
    shards (an allgather per slot, as rank 0 writes it, so no rank holds
    the whole state at once), and rank 0 writes the file in the plain
    optimizer's layout, which plain Keras loads with the whole optimizer
    state, and `load_model` (any number of ranks, sharded or not) resumes
    from; called on rank 0 alone it raises, saying that every rank must
    call it. With any other optimizer it is `model.save` on rank 0. A
    `model.save()` with a sharded optimizer keeps the weights and loses
    the whole optimizer (Keras skips it on load: iterations restart at
    0), with a warning naming this function.

    Args:
        model: a Keras model.
        filepath: the `.keras` file (or a legacy `.h5` file).
        **kwargs: `model.save`'s other arguments.

    Example:
    >>> kerasdist.save_model(model, "model.keras")  # on every rank
    """
    import os

    from kerasdist import basics
    from kerasdist.keras import optimizer as _optimizer
    from kerasdist.keras.sharding import weights as _weights

    if _weights.shards_in(model.weights):
        # Sharded weights (kerasdist.shard_weights): each whole weight is
        # allgathered as a save reads it, so every rank saves, in the same
        # order; the other ranks' files are thrown away.
        with _optimizer.whole_state(getattr(model, "optimizer", None),
                                    writer=None):
            if basics.rank() == 0:
                _write(model, filepath, kwargs)
                return
            import tempfile
            with tempfile.TemporaryDirectory() as scratch, _streamed():
                model.save(os.path.join(
                    scratch, os.path.basename(os.fspath(filepath))),
                    **kwargs)
        return
    with _optimizer.whole_state(getattr(model, "optimizer", None)):
        if basics.rank() != 0:
            return
        _write(model, filepath, kwargs)


def _write(model, filepath, kwargs):
    import os

    from kerasdist._core import files as _files

    path = os.fspath(filepath)
    if "://" in path:  # a remote file system Keras writes to itself
        model.save(filepath, **kwargs)
    else:
        # Whole or not at all: a save that fails half-way (a gather that
        # finds the other ranks gone) leaves no torn file.
        with _streamed():
            _files.atomic_write(path, lambda tmp: model.save(tmp, **kwargs))


class _streamed:
    """Keras writes a `.keras` file's weights into memory first,
    the whole file, where it judges memory sufficient
    (`saving_lib.is_memory_sufficient`, which counts the model's
    variables: a sharded model's are its shards, so always); within this
    context it writes them to a file beside the target instead, each
    weight as it is read (for sharded weights: gathered, written, freed),
    then copies that file into the archive. Measured on every backend, a
    96 MiB model and its Adam state saved at np=2: the save's peak rise
    fell from 104-112 MiB to 8-18 MiB a rank."""

    def __enter__(self):
        from keras.src.saving import saving_lib

        self.lib = saving_lib
        self.was = getattr(saving_lib, "is_memory_sufficient", None)
        if self.was is not None:
            saving_lib.is_memory_sufficient = _never
        return self

    def __exit__(self, *exc):
        if self.was is not None:
            self.lib.is_memory_sufficient = self.was


def _never(model):
    return False


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False,
               root_rank=None, shard=None):
    """Loads a Keras model file and wraps its optimizer in
    `kerasdist.DistributedOptimizer`, keeping the optimizer's state
    (iterations, slots), so training continues where it was saved.

    A model saved with a `DistributedOptimizer` names the plain optimizer
    class (see `DistributedOptimizer`), so Keras loads it as that class;
    this function then wraps it and compiles the model again with the same
    loss, metrics and settings. A model saved without an optimizer (or not
    compiled) is returned as Keras loads it.

    Args:
        filepath: the `.keras` file (or a legacy `.h5` file) to load.
        custom_optimizers: optimizer classes that are not Keras' own, which
            the file may name (registered as custom objects under their
            class names).
        custom_objects: more custom objects (layers, losses...), as
            `keras.models.load_model` takes them.
        compression: the wrapper's compression
            (`kerasdist.Compression.none` or `.fp16`).
        legacy_opts: False; Keras 3 has no `keras.optimizers.legacy`
            (Horovod's True loaded those).
        root_rank: None (default): every rank reads `filepath` itself.
            A rank number: only that rank reads the file and sends its
            bytes to the others (a collective: call it on every rank), so
            ranks that cannot see the root's file system, or a file the
            root wrote a moment ago, load the same model. The other
            ranks' `filepath` is used only for its ending.
        shard: the wrapper's `shard=` (`DistributedOptimizer`): with
            "optimizer_state" or "gradients" each rank keeps its shard of
            the saved optimizer state, whatever the number of ranks or
            the optimizer that saved it. With "weights" (a `.keras` file)
            the model is built under `kerasdist.shard_weights()` (no rank
            ever holds it whole), and each rank reads from the file only
            its slice of every trainable weight and of every optimizer
            slot (`kerasdist.shard_weights`); a collective: every rank
            calls it.

    Returns:
        The Keras model, compiled with the distributed optimizer.

    Raises:
        TypeError: if `custom_optimizers` holds something other than
            optimizer classes, or `custom_objects` is not a dict.
        ValueError: for `legacy_opts=True`; with shard="weights", for a
            file other than a `.keras` one, or with `root_rank`.
        ValueError: for a file Keras cannot read (Keras' own error).
        OSError: with `root_rank`, on every rank, when the root cannot
            read the file.

    Example:
    >>> model = kerasdist.load_model("checkpoint-3.keras")
    >>> model = kerasdist.load_model("best.keras", root_rank=0)  # every rank
    >>> model.fit(x, y, initial_epoch=3, epochs=10)
    """
    import keras

    from kerasdist.keras.distributed_optimizer import DistributedOptimizer

    if legacy_opts:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no "
                         "keras.optimizers.legacy optimizers; save the model "
                         "with a Keras 3 optimizer and load it with "
                         "legacy_opts=False.")
    objects = {}
    for cls in custom_optimizers or ():
        if not (isinstance(cls, type)
                and issubclass(cls, keras.optimizers.Optimizer)):
            raise TypeError("load_model(custom_optimizers=...) takes "
                            "keras.optimizers.Optimizer subclasses; got "
                            f"{cls!r}.")
        objects[cls.__name__] = cls
    if custom_objects is not None:
        if not isinstance(custom_objects, dict):
            raise TypeError("load_model(custom_objects=...) takes a dict of "
                            "name: object; got "
                            f"{type(custom_objects).__name__}.")
        objects.update(custom_objects)
    if shard == "weights":
        return _load_sharded(filepath, objects or None, compression,
                             root_rank)
    if root_rank is None:
        model = keras.models.load_model(filepath,
                                        custom_objects=objects or None)
    else:
        model = _load_from_root(filepath, root_rank, objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or _distributed(optimizer):
        return model
    if not optimizer.built and getattr(model, "built", False):
        optimizer.build(model.trainable_variables)
    wrapped = DistributedOptimizer(optimizer, compression=compression,
                                   shard=shard)
    compile_config = getattr(model, "_compile_config", None)
    config = dict(getattr(compile_config, "config", None) or {})
    if config:
        # The same compile() Keras ran when loading, with the wrapper (and
        # so its config, not the dropped optimizer's, when saving again).
        config["optimizer"] = wrapped
        model.compile(**config)
    else:
        model.optimizer = wrapped
    return model


def _load_sharded(filepath, custom_objects, compression, root_rank):
    """load_model(shard="weights"): the model built sharded, its weights
    and optimizer state read by slices (kerasdist/keras/sharding/
    loading.py)."""
    import json
    import os
    import zipfile

    import keras
    from keras.src.saving import object_registration
    from keras.src.saving import serialization_lib

    from kerasdist.keras.distributed_optimizer import DistributedOptimizer
    from kerasdist.keras.sharding import weights as _weights

    path = os.fspath(filepath)
    if not path.endswith(".keras"):
        raise ValueError(
            "load_model(shard='weights') reads a .keras file (each rank "
            f"its slices of the weights); got {path!r}. Load a "
            ".weights.h5 file with model.load_weights(path) on a model "
            "built under kerasdist.shard_weights().")
    if root_rank is not None:
        raise ValueError(
            "load_model(shard='weights') cannot take root_rank: the root "
            "would send the whole file to every rank. Give every rank "
            "the file (a shared file system), and each reads only its "
            "slices of it.")
    with zipfile.ZipFile(path, "r") as archive:
        config = json.loads(archive.read("config.json"))
    compile_config = config.pop("compile_config", None)
    config["compile_config"] = None
    with object_registration.CustomObjectScope(custom_objects or {}):
        with serialization_lib.ObjectSharingScope(), \
                _weights.shard_weights():
            model = serialization_lib.deserialize_keras_object(
                config, custom_objects=custom_objects, safe_mode=True)
        if not getattr(model, "built", False):
            raise ValueError(
                f"load_model(shard='weights'): the model in {path!r} is "
                "not built by its config (no build_config), so its "
                "weights cannot be sharded as it is built. Build it under "
                "kerasdist.shard_weights() and call "
                "model.load_weights(path).")
        _weights.shard_weights(model)
        if compile_config:
            args = serialization_lib.deserialize_keras_object(
                compile_config)
            optimizer = args.get("optimizer")
            if optimizer is not None:
                optimizer = keras.optimizers.get(optimizer)
                args["optimizer"] = DistributedOptimizer(
                    optimizer, compression=compression, shard="weights")
            model.compile(**args)
            if optimizer is not None:
                model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


def _load_from_root(filepath, root_rank, custom_objects):
    """keras.models.load_model of `root_rank`'s file on every rank."""
    import os
    import tempfile

    import keras

    from kerasdist import basics
    from kerasdist import objects

    if basics.rank() == root_rank:
        try:
            with open(filepath, "rb") as f:
                sent = ("ok", f.read())
        except OSError as e:
            sent = ("error", f"{type(e).__name__}: {e}")
    else:
        sent = None
    # The root's failure travels too, so that no rank waits for bytes.
    status, payload = objects.broadcast_object(
        sent, root_rank=root_rank, name="kerasdist.load_model")
    if status != "ok":
        raise OSError(f"load_model(root_rank={root_rank}): rank "
                      f"{root_rank} could not read the file: {payload}")
    if basics.rank() == root_rank:
        return keras.models.load_model(filepath,
                                       custom_objects=custom_objects)
    suffix = ".h5" if str(filepath).endswith(".h5") else ".keras"
    with tempfile.TemporaryDirectory(prefix="kerasdist-load-") as tmp:
        local = os.path.join(tmp, "model" + suffix)
        with open(local, "wb") as f:
            f.write(payload)
        return keras.models.load_model(local, custom_objects=custom_objects)


def _distributed(optimizer):
    """True for a DistributedOptimizer or a wrapper around one."""
    while optimizer is not None:
        if getattr(optimizer, "_kerasdist_settings", None) is not None:
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False
