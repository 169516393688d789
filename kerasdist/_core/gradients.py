"""Framework-free argument checks and gradient grouping shared by
DistributedOptimizer and DistributedGradientTape on every Keras backend."""

import warnings

from kerasdist import basics
from kerasdist.compression import Compressor


def resolve_op(op, average):
    """The reduce op from `op` and Horovod's deprecated `average`, as
    Horovod resolves them: `op` if given, else Average for average=True
    (or None) and Sum for average=False (with a DeprecationWarning);
    ValueError, Horovod's message, when both are given."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please "
                             "provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` "
                      "(kerasdist.Average or kerasdist.Sum).",
                      DeprecationWarning, stacklevel=3)
        return basics.Average if average else basics.Sum
    return basics.Average


def check_args(op, compression, gradient_predivide_factor, num_groups, what):
    """Validates the arguments both wrappers share; raises ValueError."""
    if op not in (basics.Average, basics.Sum, basics.Adasum):
        raise ValueError(f"{what}: op must be kerasdist.Average, "
                         f"kerasdist.Sum or kerasdist.Adasum; got {op!r}.")
    if not (isinstance(compression, type)
            and issubclass(compression, Compressor)) and not (
                hasattr(compression, "compress")
                and hasattr(compression, "decompress")):
        raise ValueError(f"{what}: compression must be a Compressor such as "
                         f"kerasdist.Compression.fp16; got {compression!r}.")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"{what}: gradient_predivide_factor must be > 0; "
                         f"got {gradient_predivide_factor!r}.")
    if gradient_predivide_factor != 1.0 and op != basics.Average:
        raise ValueError(f"{what}: gradient_predivide_factor needs "
                         "op=kerasdist.Average.")
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) \
            or num_groups < 0:
        raise ValueError(f"{what}: num_groups must be an int >= 0; got "
                         f"{num_groups!r}.")


def source_label(source, index):
    """A gradient source's name for people: a Keras variable's path, a
    tf.Variable's name (without ":0"), else `source<index>`."""
    for attr in ("path", "name"):
        try:
            value = getattr(source, attr, None)
        except (AttributeError, ValueError):  # eager tensors have no name
            value = None
        if value:
            return str(value).replace(":0", "")
    return f"source{index}"


def label_members(group_name, labels):
    """Names the timeline rows of a grouped collective's members
    (`<group_name>.<i>`) after `labels` (one per member; None: none)."""
    from kerasdist._core import capi
    capi.label_tensors((f"{group_name}.{k}", label)
                       for k, label in enumerate(labels) if label)


def split_groups(count, num_groups):
    """Splits range(count) into min(num_groups, count) contiguous lists
    whose lengths differ by at most one (longer ones first), like
    `numpy.array_split`. Pure, so every rank gets the same groups."""
    n = min(num_groups, count)
    base, extra = divmod(count, n)
    groups, start = [], 0
    for g in range(n):
        stop = start + base + (1 if g < extra else 0)
        groups.append(list(range(start, stop)))
        start = stop
    return groups
