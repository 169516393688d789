"""The reduce op from Horovod's two arguments (`op`, the deprecated
`average`), shared by the public collectives and the Keras layer's
wrappers on every framework."""

import warnings

from kerasdist import basics


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
