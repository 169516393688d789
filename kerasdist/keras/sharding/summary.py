"""`model.summary()` with a sharded optimizer: a line after Keras' own that
says what its "Optimizer params" counted (this rank's shard of the
optimizer's state) and what the whole state holds.

Keras counts `model.optimizer.variables`, which for a sharded optimizer
are this rank's shards of the slots: a figure 1/N of the plain
optimizer's with nothing to say so. Keras' summary has no hook, so
`install()` wraps `keras.src.utils.summary_utils.print_summary` (which
`Model.summary` looks up at every call) once, the first time a sharded
optimizer is built; where that function is not found it does nothing.
"""

_installed = []


def install():
    """Wraps Keras' summary printer once (see the module docstring)."""
    if _installed:
        return
    _installed.append(True)
    try:
        from keras.src.utils import io_utils
        from keras.src.utils import summary_utils
    except ImportError:  # another Keras layout: its summary as it is
        return
    original = getattr(summary_utils, "print_summary", None)
    if original is None:
        return

    def print_summary(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        line = note(model)
        if line is not None:
            print_fn = kwargs.get("print_fn") or (
                args[2] if len(args) > 2 else None)
            (print_fn or io_utils.print_msg)(line)
        return out

    summary_utils.print_summary = print_summary


def note(model):
    """The line for `model` (None without a built sharded optimizer)."""
    from kerasdist.keras import optimizer as _optimizer

    if not getattr(model, "compiled", False):
        return None
    sharded = _optimizer.sharded_in(getattr(model, "optimizer", None))
    state = _optimizer.shard_state(sharded)
    if state is None:
        return None
    shard = whole = 0
    for v in sharded.variables:
        n = 1
        for d in v.shape:
            n *= int(d)
        j = state.slot_index(v)
        shard += n
        whole += n if j is None else state.layout.numels[j]
    return (f" (Optimizer params above: rank {state.rank}'s shard of a "
            f"sharded optimizer over {state.layout.size} ranks; the whole "
            f"optimizer state holds {whole:,} params, as one process's "
            "would.)")
