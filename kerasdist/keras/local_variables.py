"""Local variables: gradients that stay on their rank (Horovod's
`register_local_var`, `register_local_source` and `local_layers`), shared
by DistributedOptimizer (every Keras backend) and DistributedGradientTape
(TensorFlow). Imports no framework."""

from kerasdist import process_sets as _process_sets


class LocalVariables:
    """The variables whose gradients are not reduced, matched by identity.
    Layers are read when gradients are reduced, so a layer built after
    wrapping counts with all its weights."""

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

    def reduce(self, grads, variables, reduce, scale):
        """`reduce(grads, variables)` on the other variables' gradients;
        the local ones as they are, or divided by `size()` if `scale` (as
        Horovod's `scale_local_gradients`)."""
        local = self.ids()
        if not local:
            return reduce(grads, variables)
        keep = [i for i, v in enumerate(variables) if id(v) not in local]
        reduced = reduce([grads[i] for i in keep],
                         [variables[i] for i in keep])
        n = _process_sets.current_size() if scale else 1
        out = [scaled(g, n) if id(v) in local else None
               for g, v in zip(grads, variables)]
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
