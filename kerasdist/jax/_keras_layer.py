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

    def regather(self, call, shards=()):
        # Left as it is: jax.checkpoint refuses the collectives' custom
        # calls (their effect), and with them allowed, a checkpoint policy
        # recomputing only the gathers, or a custom VJP gathering again
        # once the cotangent has arrived, left the jitted step's temporary
        # memory as large or larger (XLA's CPU schedule keeps the whole
        # weights from the forward to the backward either way).
        return call

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


FRAMEWORK = Jax()
