"""The Keras layer's JAX parts: the `KerasFramework` that
`kerasdist.keras.framework.get()` returns on the JAX backend. Keras' JAX
train step is jitted and stateless, so the gradients are tracers and every
collective is an XLA custom call (kerasdist/jax/collectives.py)."""

from kerasdist.jax import collectives as _jax_collectives
from kerasdist.keras import framework as _framework


class Jax(_framework.KerasFramework):
    """The Keras layer on JAX (see kerasdist/keras/framework.py)."""

    name = "jax"
    collectives = _jax_collectives
    # The collectives are XLA custom calls: the train step stays compiled.
    jit_compile = True
    # XLA's CPU step page-faults its temporaries anew from mmap: slower
    # (kerasdist.keras.optimizer._large_blocks_from_mmap).
    mmap_large_blocks = False

    def regather(self, call, shards=()):
        # Not jax.checkpoint: its recomputation depends on the residuals
        # only, so XLA ran it (and held its whole weights) as early as it
        # liked, or merged it with the forward's. A custom VJP keeps only
        # the shards and the inputs; its backward gathers again once the
        # cotangent has arrived (`_tie`).
        return _regathered(call, list(shards))

    def after(self, value, anchor):
        # XLA schedules by data only (on the CPU it drops optimization
        # barriers before scheduling): a gather that reads only its shard
        # may run, and hold its whole weight, anywhere in the step.
        return _tie(value, anchor)

    def unique_name(self, base):
        # Several collectives of one jitted step may run at once, so two
        # must never share a name; eagerly they run one after the other.
        from kerasdist.jax._dispatch import auto_name
        from kerasdist.jax._dispatch import program_trace
        if program_trace() is None:
            return base
        return auto_name(base, None)

    def bucket_bytes(self, settings):
        # Only when overlap was asked for (True, or KERASDIST_OVERLAP set):
        # XLA's CPU runtime runs the step's operations in sequence and
        # waits for each custom call, so more calls only add round trips
        # there (docs/keras.md).
        if getattr(settings, "overlap", False) and \
                getattr(settings, "jax_buckets", False):
            return settings.bucket_bytes
        return None


def _tie(value, anchor):
    """`value`, made to depend on `anchor` by data (so computed after
    it): plus a zero that XLA cannot fold (a float times zero is not
    folded, for NaN's sake), made from whether one element of `anchor` is
    NaN, so always 0.0, never NaN."""
    import jax
    import jax.numpy as jnp

    leaves = [x for x in jax.tree_util.tree_leaves(anchor)
              if isinstance(x, jax.core.Tracer) and x.size]
    if not isinstance(value, jax.core.Tracer) or not leaves or \
            not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    first = jnp.ravel(leaves[0])[0]
    zero = (first != first).astype(value.dtype) * jnp.zeros((), value.dtype)
    return value + zero


def _regathered(call, shards):
    """`call` as a custom VJP of the shards' values and the inputs: the
    whole weights live while its forward runs and again while its
    backward does, never between them."""
    import jax
    from keras.src.backend.common import stateless_scope

    def regathered(*inputs):
        outer = stateless_scope.get_stateless_scope()
        values = None if outer is None else [
            outer.get_current_value(v) for v in shards]
        # Outside Keras' stateless step (an eager call, building): as is.
        if not shards or values is None or any(v is None for v in values) \
                or not any(isinstance(v, jax.core.Tracer) for v in values):
            return call(*inputs)
        # Every other variable as in the step's scope (the backward is
        # traced after that scope has closed).
        mapping = dict(outer.state_mapping)

        def with_values(values, inputs, anchor=None):
            # The shards' values are arguments: a custom VJP must not
            # close over the step's tracers.
            scope = stateless_scope.StatelessScope(
                collect_losses=outer.collect_losses)
            scope.state_mapping.update(mapping)
            scope.state_mapping.update(
                {id(v): x for v, x in zip(shards, values)})
            with scope:
                out = call(*inputs) if anchor is None else \
                    call(*inputs, anchor=anchor)
            if scope.losses:
                raise ValueError(
                    "kerasdist.shard_weights: a layer whose weights are "
                    "gathered again for its backward adds a loss inside "
                    "its call (add_loss), which JAX cannot carry out of "
                    "the regathered call. Build the model with "
                    "kd.shard_weights(remat=False), and not under "
                    "keras.RematScope.")
            return out

        @jax.custom_vjp
        def run(values, inputs):
            return with_values(values, inputs)

        def forward(values, inputs):
            return with_values(values, inputs), (values, inputs)

        def backward(saved, cotangent):
            values, inputs = saved
            # The second gathers wait for the cotangent reaching here,
            # not for the saved input: XLA recomputes an input's element
            # from its producers (an activation of the layer before,
            # reading that layer's gathered weights), which would keep
            # the forward's gathered weights alive until here.
            values = [_tie(v, cotangent) for v in values]
            _, vjp = jax.vjp(
                lambda v, i: with_values(v, i, cotangent), values, inputs)
            return vjp(cotangent)

        run.defvjp(forward, backward)
        return run(values, inputs)

    return regathered


FRAMEWORK = Jax()
