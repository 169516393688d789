"""Gradient buckets: which gradients travel together in one allreduce.

Pure Python, no framework import: the TensorFlow, JAX and PyTorch front
ends all call it with their gradients' byte sizes and dtypes.

The model is PyTorch DDP's bucket assignment (c10d's
`compute_bucket_assignment_by_size`): gradients are taken in the order
backprop produces them, which for a model built layer after layer is the
reverse of its variables' order, and packed greedily into buckets, one
open bucket per dtype. The first bucket of each dtype is small (1 MiB by
default) so that its allreduce starts as early as possible; the later ones
are up to `bucket_bytes` (25 MiB by default). Unlike c10d, which closes a
bucket once it reaches its limit (so a bucket may overrun the limit by one
tensor), a bucket here never holds more than its limit, except a single
gradient larger than the limit, which is alone in its bucket.

A bucket is ready once its last gradient exists, so buckets are returned
in the order they become ready (by the position of their last member in
backprop order), and the indices inside a bucket in backprop order.
"""

import os

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
# DistributedOptimizer's defaults for `overlap` and `bucket_bytes` when the
# arguments are None (read when the optimizer is wrapped).
OVERLAP_ENV = "KERASDIST_OVERLAP"
BUCKET_BYTES_ENV = "KERASDIST_BUCKET_BYTES"

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES",
           "BUCKET_BYTES_ENV", "OVERLAP_ENV", "assign_buckets",
           "resolve_settings", "variable_buckets"]


def _check_limit(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (bytes); got "
                         f"{value!r}.")


def assign_buckets(sizes, dtypes=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                   first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES):
    """Buckets of gradient indices.

    Args:
        sizes: each gradient's size in bytes, in the order backprop
            produces the gradients (ints >= 0).
        dtypes: each gradient's dtype (any hashable, e.g. "float32"), as
            long as `sizes`; None: all the same. Two dtypes never share a
            bucket.
        bucket_bytes: the most bytes in a bucket (after the first of its
            dtype).
        first_bucket_bytes: the most bytes in the first bucket of each
            dtype (capped at `bucket_bytes`).

    Returns:
        A list of buckets, each a non-empty list of indices into `sizes`:
        every index exactly once, ascending within a bucket, buckets in the
        order they are complete (ascending last index).

    Raises:
        ValueError: for a negative or non-int size, limits < 1, or
            `dtypes` of another length.
    """
    _check_limit(bucket_bytes, "bucket_bytes")
    _check_limit(first_bucket_bytes, "first_bucket_bytes")
    sizes = list(sizes)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"assign_buckets: size {i} must be an int >= 0 "
                             f"(bytes); got {s!r}.")
    if dtypes is None:
        dtypes = [None] * len(sizes)
    else:
        dtypes = list(dtypes)
        if len(dtypes) != len(sizes):
            raise ValueError(
                f"assign_buckets: {len(dtypes)} dtypes for {len(sizes)} "
                "sizes; give one dtype per gradient.")
    first = min(first_bucket_bytes, bucket_bytes)
    done = []           # closed buckets
    open_ = {}          # dtype -> [indices, bytes]
    started = set()     # dtypes whose first bucket has been closed
    for i, (size, dtype) in enumerate(zip(sizes, dtypes)):
        limit = bucket_bytes if dtype in started else first
        bucket = open_.get(dtype)
        if bucket is not None and bucket[1] + size > limit:
            done.append(bucket[0])
            started.add(dtype)
            limit = bucket_bytes
            bucket = None
        if bucket is None:
            bucket = open_[dtype] = [[], 0]
        bucket[0].append(i)
        bucket[1] += size
        if bucket[1] >= limit:
            # Full (or one gradient over the limit): close it now, so that
            # it is ready as soon as this gradient is.
            done.append(bucket[0])
            started.add(dtype)
            del open_[dtype]
    done += [b[0] for b in open_.values()]
    done.sort(key=lambda b: b[-1])
    return done


def variable_buckets(sizes, dtypes=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                     first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES):
    """`assign_buckets` for gradients given in the variables' order (as
    `model.trainable_variables`, what optimizers take): backprop is assumed
    to produce them in reverse, as DDP assumes. Returns buckets of indices
    into the variables' order, buckets in the order they are ready
    (backprop order), indices in a bucket descending (backprop order)."""
    sizes = list(sizes)
    n = len(sizes)
    rev_dtypes = None if dtypes is None else list(dtypes)[::-1]
    if rev_dtypes is not None and len(rev_dtypes) != n:
        raise ValueError(
            f"variable_buckets: {len(rev_dtypes)} dtypes for {n} sizes; "
            "give one dtype per gradient.")
    buckets = assign_buckets(sizes[::-1], rev_dtypes, bucket_bytes,
                             first_bucket_bytes)
    return [[n - 1 - i for i in b] for b in buckets]


def resolve_settings(overlap=None, bucket_bytes=None, what="kerasdist",
                     environ=None):
    """(overlap, bucket_bytes) from the arguments, None taking the
    environment's KERASDIST_OVERLAP (1/0, true/false; default 1) and
    KERASDIST_BUCKET_BYTES (default 25 MiB). ValueError naming `what` for
    a bad value."""
    env = os.environ if environ is None else environ
    if overlap is None:
        text = env.get(OVERLAP_ENV, "1").strip().lower()
        if text in ("1", "true", "yes", "on", ""):
            overlap = True
        elif text in ("0", "false", "no", "off"):
            overlap = False
        else:
            raise ValueError(f"{what}: {OVERLAP_ENV} must be 1 or 0; got "
                             f"{text!r}.")
    elif not isinstance(overlap, bool):
        raise ValueError(f"{what}: overlap must be True, False or None; got "
                         f"{overlap!r}.")
    if bucket_bytes is None:
        text = env.get(BUCKET_BYTES_ENV, "").strip()
        try:
            bucket_bytes = int(text) if text else DEFAULT_BUCKET_BYTES
        except ValueError:
            raise ValueError(f"{what}: {BUCKET_BYTES_ENV} must be a number of "
                             f"bytes >= 1; got {text!r}.") from None
        if bucket_bytes < 1:
            raise ValueError(f"{what}: {BUCKET_BYTES_ENV} must be a number of "
                             f"bytes >= 1; got {text!r}.")
    else:
        try:
            _check_limit(bucket_bytes, "bucket_bytes")
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return overlap, bucket_bytes
