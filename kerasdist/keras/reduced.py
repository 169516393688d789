"""Gradients that are already reduced over the ranks, by identity: what a
`DistributedGradientTape` returned (TensorFlow), so that a sharded
`DistributedOptimizer` handed exactly those tensors takes its shard of
each by slicing it locally instead of reduce-scattering it again (as
PyTorch's `ZeroRedundancyOptimizer` behind DDP uses DDP's averaged
`.grad` as it is). Every rank holds the same value of such a tensor.

A tensor is recorded with the process set it was reduced over, by
`id()`, with a weak reference that forgets it once the tensor is freed
(an eager tensor at the end of its step; a traced one with its graph),
so a recycled `id()` never matches. Anything not recorded (a gradient
the user scaled, clipped or summed, a local source's gradient, a tensor
that cannot be weakly referenced) is simply not known here: its consumer
reduces it as usual.

Pure Python: no framework, no kerasdist module."""

import threading
import weakref

# Reentrant: a garbage collection while a thread holds it may free a
# recorded tensor and run its callback in that same thread.
_lock = threading.RLock()
_entries = {}  # id(tensor) -> (weak reference, process set id)


def note(tensors, process_set_id):
    """Records `tensors` (None entries skipped) as reduced over process
    set `process_set_id` (0: every rank of the job)."""
    for tensor in tensors:
        if tensor is None:
            continue
        key = id(tensor)
        try:
            ref = weakref.ref(tensor, _forget(key))
        except TypeError:
            continue  # cannot know when it dies: never matched
        with _lock:
            _entries[key] = (ref, int(process_set_id))


def _forget(key):
    def forget(ref):
        with _lock:
            entry = _entries.get(key)
            if entry is not None and entry[0] is ref:
                del _entries[key]
    return forget


# What a LossScaleOptimizer passes on (pass_on), per thread.
_passed = threading.local()


def pass_on(sets):
    """A LossScaleOptimizer hands its inner optimizer its gradients divided
    by the scale, which every rank agrees on: new tensors, reduced as the
    ones it got. `sets` (per gradient, its `process_set_of` or None) are
    noted for the gradients its inner optimizer's `take_passed` next
    gets; None forgets them."""
    _passed.sets = sets


def take_passed(tensors):
    """Notes `tensors` as `pass_on` said, once; nothing if the count
    differs or nothing was passed on."""
    sets = getattr(_passed, "sets", None)
    _passed.sets = None
    if sets is None or len(sets) != len(tensors):
        return
    for tensor, ps in zip(tensors, sets):
        if ps is not None:
            note([tensor], ps)


def process_set_of(tensor):
    """The process set id `tensor` was recorded as reduced over, or None
    (not recorded, or None)."""
    if tensor is None:
        return None
    with _lock:
        entry = _entries.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]


def count():
    """How many live tensors are recorded (for tests)."""
    with _lock:
        refs = [ref for ref, _ in list(_entries.values())]
    return sum(1 for ref in refs if ref() is not None)


def same_set(a, b, ranks_of):
    """Whether process sets `a` and `b` (ids) are the same ranks: equal
    ids, or equal rank lists (`ranks_of(id)`, None for an unknown id; a
    set of the job's ranks added again has an id of its own)."""
    if a == b:
        return True
    ranks = ranks_of(a)
    return ranks is not None and ranks == ranks_of(b)
