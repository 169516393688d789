"""Collective names for front ends that trace (JAX) or run eagerly (PyTorch).

The ranks match collectives by name, so an unnamed one needs a name that is
the same on every rank for the same logical tensor. Eagerly, unnamed calls
are numbered in call order per kind (every rank makes them in the same
order, as with TF's eager ops). Framework-free.
"""

import itertools
import threading

_counters = {}
_lock = threading.Lock()


def eager_name(kind, name):
    """`name`, or `<kind>.noname.<k>` for the k-th unnamed call of `kind`."""
    if name is not None:
        return str(name)
    with _lock:
        counter = _counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"
