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
