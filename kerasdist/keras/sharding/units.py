"""Units of small layers (`kerasdist.shard_weights(model, min_unit_bytes=)`,
FSDP's size-based wrapping): the layers whose sharded weights are fewer
bytes whole than the bound stop gathering them at their own calls; the
model's call gathers all of theirs at once (one allgather, and one
reduce-scatter of their gradients, a dtype), and their whole views read
them from its frame (views.FRAMES: the innermost call's)."""

from kerasdist.keras.sharding import views as _views
from kerasdist.keras.sharding.layout import itemsize


def _own_frame(layer):
    """Whether `layer`'s call gathers its own weights (weights.py's
    `_gather_per_call`, or `_regather_in_backward`)."""
    call = layer.__dict__.get("call")
    return (getattr(call, "_kerasdist_grouped", False)
            or getattr(call, "_kerasdist_regather", False))


def gather_small_layers_at_the_call(layers, min_unit_bytes, own_shards):
    """`layers`: the model first, then every layer in it (recursively);
    `own_shards(layer)`: the `WeightShard`s of a layer's own sharded
    weights. Returns the layers that joined the model's unit."""
    model, layers = layers[0], layers[1:]
    # A layer called inside another's gathering call reads that call's
    # frame, never the model's: it keeps gathering its own.
    inside = {id(sub) for layer in layers if _own_frame(layer)
              for sub in layer._flatten_layers(include_self=False)}
    small = []
    for layer in layers:
        call = layer.__dict__.get("call")
        if (not getattr(call, "_kerasdist_grouped", False)
                or id(layer) in inside):
            continue  # rematerialized, or inside another's call
        mine = own_shards(layer)
        if sum(w.numel * itemsize(w.dtype) for w in mine) < min_unit_bytes:
            # The call it had before, for good: not wrapped again.
            object.__setattr__(layer, "call", call._kerasdist_inner)
            object.__setattr__(layer, "_kerasdist_in_unit", True)
            small.append(layer)
    if not small:
        return small
    call = model.call

    def unit(*args, **kwargs):
        weights = [w for layer in small for w in own_shards(layer)]
        return _views.call_in_frame(weights, call, args, kwargs)

    unit._kerasdist_unit = True
    object.__setattr__(model, "call", unit)
    return small
