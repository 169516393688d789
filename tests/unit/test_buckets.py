"""kerasdist.keras.buckets: the gradient bucket assignment, against hand-worked
cases and its invariants (every index once, order, caps, dtypes)."""

import random

import pytest

from kerasdist.keras import buckets as _buckets
from kerasdist.keras.buckets import assign_buckets
from kerasdist.keras.buckets import variable_buckets

MiB = 1024 * 1024


def _check_invariants(sizes, dtypes, buckets, cap, first):
    n = len(sizes)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(n)), "every index exactly once"
    assert all(b for b in buckets), "no empty bucket"
    assert all(b == sorted(b) for b in buckets), "backprop order inside"
    lasts = [b[-1] for b in buckets]
    assert lasts == sorted(lasts), "buckets in the order they are ready"
    seen = set()
    for b in buckets:
        kinds = {dtypes[i] if dtypes else None for i in b}
        assert len(kinds) == 1, "dtypes never mixed"
        kind = kinds.pop()
        limit = cap if kind in seen else min(first, cap)
        seen.add(kind)
        total = sum(sizes[i] for i in b)
        assert total <= limit or len(b) == 1, (b, total, limit)


def test_assign_buckets_hand_worked_cases():
    # First bucket 4 bytes, later ones 8: [0] | [1, 2] | [3, 4].
    assert assign_buckets([4, 4, 4, 4, 4], bucket_bytes=8,
                          first_bucket_bytes=4) == [[0], [1, 2], [3, 4]]
    # 3 stays open (3 < 4); 10 does not fit, closes [0], is alone (over the
    # cap); the rest share the last bucket.
    assert assign_buckets([3, 10, 2, 2, 2], bucket_bytes=8,
                          first_bucket_bytes=4) == [[0], [1], [2, 3, 4]]
    # A bucket never overruns its limit (c10d's would hold [0, 1]).
    assert assign_buckets([3, 3, 3], bucket_bytes=5,
                          first_bucket_bytes=5) == [[0], [1], [2]]
    # Exactly full closes at once.
    assert assign_buckets([2, 3, 1], bucket_bytes=5,
                          first_bucket_bytes=5) == [[0, 1], [2]]
    # Two dtypes: one open bucket each, ordered by when they are ready.
    assert assign_buckets([1, 1, 1, 1], ["f32", "f16", "f32", "f16"],
                          bucket_bytes=2, first_bucket_bytes=2) == \
        [[0, 2], [1, 3]]
    assert assign_buckets([2, 1, 1, 1], ["a", "b", "a", "a"],
                          bucket_bytes=2, first_bucket_bytes=2) == \
        [[0], [1], [2, 3]]
    # Zero-byte gradients ride along; empty input, no buckets.
    assert assign_buckets([0, 0, 1], bucket_bytes=1,
                          first_bucket_bytes=1) == [[0, 1, 2]]
    assert assign_buckets([]) == []


def test_assign_buckets_defaults_are_ddps():
    assert _buckets.DEFAULT_BUCKET_BYTES == 25 * MiB
    assert _buckets.DEFAULT_FIRST_BUCKET_BYTES == 1 * MiB
    # 0.5 MiB gradients: two fill the first bucket, fifty each later one.
    buckets = assign_buckets([MiB // 2] * 104)
    assert [len(b) for b in buckets] == [2, 50, 50, 2]
    # A model under 1 MiB is one bucket.
    assert assign_buckets([4096] * 10) == [list(range(10))]


def test_assign_buckets_invariants_random():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(0, 40)
        sizes = [rng.choice([0, 1, 7, 64, 100, 1000, 5000])
                 for _ in range(n)]
        dtypes = [rng.choice(["f32", "f16", "i32"]) for _ in range(n)] \
            if rng.random() < 0.5 else None
        cap = rng.choice([1, 50, 300, 4000, 10 ** 6])
        first = rng.choice([1, 20, 300, 10 ** 7])
        buckets = assign_buckets(sizes, dtypes, cap, first)
        _check_invariants(sizes, dtypes, buckets, cap, first)
        # Greedy (one dtype): a bucket after the first closed because it
        # was full or the next gradient did not fit.
        if dtypes is None:
            for a, b in zip(buckets[1:], buckets[2:]):
                used = sum(sizes[i] for i in a)
                assert used >= cap or used + sizes[b[0]] > cap


def test_variable_buckets_reverse_variable_order():
    # Variables in model order; backprop produces the last first.
    sizes = [100, 4, 4, 100]
    assert variable_buckets(sizes, bucket_bytes=104,
                            first_bucket_bytes=104) == [[3, 2], [1, 0]]
    assert variable_buckets([1, 2], ["a", "b"]) == [[1], [0]]
    with pytest.raises(ValueError, match="dtypes for 2 sizes"):
        variable_buckets([1, 2], ["a"])


def test_assign_buckets_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1"):
        assign_buckets([1], bucket_bytes=0)
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        assign_buckets([1], first_bucket_bytes=1.5)
    with pytest.raises(ValueError, match="size 1 must be an int >= 0"):
        assign_buckets([1, -2])
    with pytest.raises(ValueError, match="2 dtypes for 1 sizes"):
        assign_buckets([1], ["a", "b"])


def test_assign_buckets_resolve_settings():
    from kerasdist.keras.buckets import resolve_settings
    assert resolve_settings(environ={}) == (True, 25 * MiB)
    assert resolve_settings(environ={"KERASDIST_OVERLAP": "0",
                                     "KERASDIST_BUCKET_BYTES": "4096"}) == \
        (False, 4096)
    # Arguments win over the environment.
    assert resolve_settings(True, 10, environ={"KERASDIST_OVERLAP": "0"}) \
        == (True, 10)
    with pytest.raises(ValueError, match="X: KERASDIST_OVERLAP must be 1"):
        resolve_settings(environ={"KERASDIST_OVERLAP": "maybe"}, what="X")
    with pytest.raises(ValueError, match="KERASDIST_BUCKET_BYTES must be"):
        resolve_settings(environ={"KERASDIST_BUCKET_BYTES": "0"})
    with pytest.raises(ValueError, match="X: bucket_bytes must be an int"):
        resolve_settings(bucket_bytes=-1, what="X", environ={})
    with pytest.raises(ValueError, match="overlap must be True, False"):
        resolve_settings(overlap="yes", environ={})
