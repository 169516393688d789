"""A numpy reference of Horovod's Adasum reduction, written from its formula
and its pairing (not from kerasdist's C++).

For two gradients a, b of one tensor

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

where a coefficient stays 1 when its squared norm is below sqrt(DBL_MIN)
(a zero vector). Over 2^k ranks the pairs form a binary tree: at level
1, 2, 4, ... the block of ranks [j, j + level) combines with the block
[j + level, j + 2 level), the lower block's result as `a`. Each level's
result is rounded to the tensor's dtype (the ranks exchange it in that
dtype). Standard library and numpy only.
"""

import sys

import numpy as np

_TINY = np.sqrt(sys.float_info.min)


def pair(a, b):
    """adasum(a, b), computed in float64, rounded to a's dtype."""
    dtype = np.asarray(a).dtype
    x = np.asarray(a, np.float64).ravel()
    y = np.asarray(b, np.float64).ravel()
    dot, xx, yy = x @ y, x @ x, y @ y
    ac = 1.0 - dot / xx * 0.5 if xx >= _TINY else 1.0
    bc = 1.0 - dot / yy * 0.5 if yy >= _TINY else 1.0
    return (ac * x + bc * y).astype(dtype).reshape(np.shape(a))


def tree(per_rank):
    """The Adasum of one tensor over len(per_rank) ranks (a power of two):
    per_rank[r] is rank r's tensor."""
    n = len(per_rank)
    if n < 1 or n & (n - 1):
        raise ValueError(f"Adasum needs a power-of-two number of ranks; "
                         f"got {n}")
    level = list(per_rank)
    while len(level) > 1:
        level = [pair(level[i], level[i + 1])
                 for i in range(0, len(level), 2)]
    return level[0]
