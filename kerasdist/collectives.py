"""The public collectives, written once for every framework.

`__all__` names them; their code is the class `Collectives`
(`kerasdist/_public_collectives.py`), one instance per framework, whose
methods check their arguments, name the collective and hand the
framework's tensors to an implementation module that only moves them
through the core and registers their gradients:
`kerasdist/tensorflow/collectives.py` (TF ops), `kerasdist/jax/collectives.py`
(XLA custom calls) and `kerasdist/torch/collectives.py` (torch custom ops).
`bound(framework)` gives the collectives on one framework's tensors:
`kerasdist.tensorflow`, `kerasdist.jax` and `kerasdist.torch` export those
(the names of `__all__`), whatever the Keras backend.
`kerasdist.allreduce` and `kerasdist.collectives.allreduce` are the
collectives of the framework the Keras backend runs on, so
`help(kerasdist.allreduce)` reads the same on every one.

An implementation module provides `require_init()`, `check_op(op, what)`,
`auto_name(kind, name)` (the name ranks match an unnamed collective by),
`tensor(x, what)` (its framework's tensor), one function per collective
taking converted tensors and a resolved name, and `variable_value(v)` and
`no_grad()` for `broadcast_variables`. Optionally (TensorFlow):
`topology_op(query, name, what)` for `rank_op` & co (elsewhere an array of the
value), `assign(variables, values)` for `broadcast_` (elsewhere each
variable's `assign`), and `global_variables()` and `group(tensors)` for
`broadcast_global_variables` (elsewhere it raises).

Importing this module imports no other kerasdist module
(`kerasdist/__init__.py` reads `__all__`): no framework, not numpy, not
the core library. Its names are written out for readers and type checkers
under `TYPE_CHECKING` (tools/api_names.py).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kerasdist._public_collectives import Collectives

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "broadcast",
           "broadcast_", "broadcast_global_variables", "broadcast_variables",
           "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
           "join", "local_rank_op", "local_size_op",
           "process_set_included_op", "rank_op", "reducescatter", "size_op"]

# The frameworks kerasdist runs on, as Keras names its backends.
FRAMEWORKS = ("tensorflow", "jax", "torch")


def keras_framework():
    """The framework the Keras backend runs on (one of `FRAMEWORKS`);
    ValueError if kerasdist does not support it. Imports Keras."""
    import keras
    name = keras.backend.backend()
    if name not in FRAMEWORKS:
        raise ValueError(
            f"kerasdist supports the Keras backends {', '.join(FRAMEWORKS)}; "
            f"this process runs Keras on {name!r}. Set KERAS_BACKEND to "
            "one of them before importing keras.")
    return name


def bound(framework) -> "Collectives":
    """The public collectives on `framework`'s tensors ("tensorflow", "jax"
    or "torch"): a `Collectives` whose attributes `__all__` names are its
    methods, each bound once; built once per framework."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"kerasdist runs on {', '.join(FRAMEWORKS)}; "
                         f"got the framework {framework!r}.")
    from kerasdist._public_collectives import for_framework
    return for_framework(framework)


# For readers and type checkers: the collectives are the methods of
# `kerasdist._public_collectives.Collectives`.
# ---- names written by tools/api_names.py from the one list
if TYPE_CHECKING:
    # What `__getattr__` returns: the Keras backend's.
    _api = bound(keras_framework())
    allgather = _api.allgather
    allreduce = _api.allreduce
    alltoall = _api.alltoall
    barrier = _api.barrier
    broadcast = _api.broadcast
    broadcast_ = _api.broadcast_
    broadcast_global_variables = _api.broadcast_global_variables
    broadcast_variables = _api.broadcast_variables
    grouped_allgather = _api.grouped_allgather
    grouped_allreduce = _api.grouped_allreduce
    grouped_reducescatter = _api.grouped_reducescatter
    join = _api.join
    local_rank_op = _api.local_rank_op
    local_size_op = _api.local_size_op
    process_set_included_op = _api.process_set_included_op
    rank_op = _api.rank_op
    reducescatter = _api.reducescatter
    size_op = _api.size_op
# ---- end of the names written by tools/api_names.py


def __getattr__(name):
    if name in __all__:
        return getattr(bound(keras_framework()), name)
    raise AttributeError(
        f"module 'kerasdist.collectives' has no attribute {name!r}")


def __dir__():
    return __all__
