"""Where a sharded optimizer's buddy copies live
(kerasdist/keras/sharding/buddies.py): the pure rule, without a job."""

from kerasdist.keras.sharding import buddies


def test_buddy_offset_puts_each_copy_on_another_host():
    # One host: the next rank. Two hosts of two ranks, blocked: two on.
    assert buddies.buddy_offset(["a"] * 3) == 1
    assert buddies.buddy_offset(["a", "a", "b", "b"]) == 2
    # Alternating hosts: the next rank is on the other one already.
    assert buddies.buddy_offset(["a", "b", "a", "b"]) == 1
    # Uneven hosts (3 and 1): no offset moves every copy off its host.
    assert buddies.buddy_offset(["a", "a", "a", "b"]) == 1
    assert buddies.buddy_offset(["a"]) == 0
    for hosts in (["a", "a", "b", "b", "c", "c"], ["x", "y", "z"] * 2):
        d = buddies.buddy_offset(hosts)
        n = len(hosts)
        assert all(hosts[(r + d) % n] != hosts[r] for r in range(n))
        # A permutation: every rank holds exactly one copy.
        assert sorted((r + d) % n for r in range(n)) == list(range(n))


def test_buddy_holders_and_a_lost_pair_says_why():
    import pytest
    copies = buddies.Copies({}, {}, rank=0, size=3, offset=1, slots={},
                            number=4)
    # Rank 2 lost: its shard is rank 0's copy (rank 0 is new rank 0).
    assert buddies.holders(copies, [0, 1]) == {
        0: (0, False), 1: (1, False), 2: (0, True)}
    # Rank 0 lost: its copy is on rank 1, now new rank 0.
    assert buddies.holders(copies, [1, 2])[0] == (0, True)
    # Ranks 1 and 2 (a rank and its buddy) lost: rank 1's shard is gone.
    with pytest.raises(buddies.ShardsLostError, match=(
            r"^rank 1's shard of the sharded optimizer's state is lost: it "
            r"and its buddy, rank 2, were both lost \(ranks \[1, 2\]\)$")):
        buddies.holders(copies, [0])
    # No copies kept (offset 0): any lost rank's shard is gone.
    alone = buddies.Copies({}, None, rank=0, size=2, offset=0, slots={},
                           number=0)
    with pytest.raises(buddies.ShardsLostError, match="no copies are kept"):
        buddies.holders(alone, [0])
