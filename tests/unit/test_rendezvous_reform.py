"""The rendezvous's re-form round (kerasdist/rendezvous/reform.py) for a
TCP job with recovery in place: a real server process and real sockets on
loopback, the ranks join() itself and tcp_job's Exchange on threads. A
rank that went ends the round at once; one that neither asks nor goes is
left out at the window and its connection closed; one the lowest asker
names lost is not waited for, and is left out if it asks; another
generation is refused; the server outlives rank 0 while a rank stays
connected.
"""

import os
import sys
import threading
import time

import pytest

from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import tcp_job
from tests.unit.test_rendezvous_security import _end
from tests.unit.test_rendezvous_security import _join_all
from tests.unit.test_rendezvous_security import _serve

KEY = protocol.identity({})[1]


def _staying(size):
    """A server of `size` ranks, each joined and staying; (process,
    [Exchange by rank])."""
    proc, port = _serve(size, 20)
    joined = _join_all(port, size, {})
    exchanges = [tcp_job.Exchange(joined[r]["PMI_PORT"], joined[r]["PMI_ID"],
                                  20) for r in range(size)]
    for ex in exchanges:
        ex.stay()
    return proc, exchanges


def _reform(exchanges, ranks, generation, window):
    """reform() of `ranks` on threads; {rank: (new rank, size) or the
    error} and the seconds it took."""
    out, began = {}, time.monotonic()

    def one(r):
        try:
            out[r] = exchanges[r].reform(generation, window)
        except (OSError, protocol.RendezvousError) as e:
            out[r] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(window + 40)
    return out, time.monotonic() - began


def _close(proc, exchanges):
    for ex in exchanges:
        ex.sock.close()
    return _end(proc)


def test_a_rank_that_went_ends_the_round_at_once():
    proc, ex = _staying(3)
    try:
        ex[1].sock.close()
        got, took = _reform(ex, [0, 2], 1, window=30)
        assert got == {0: (0, 2), 2: (1, 2)}, got
        assert took < 10, took
        # The new generation exchanges its addresses as at the start.
        specs = {}
        threads = [threading.Thread(target=lambda r=r: specs.update(
            {r: tcp_job.describe(ex[r], got[r][0], 2, KEY, 20, 1)}))
            for r in (0, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        lines = [dict(x.split("=", 1) for x in specs[r].split())
                 for r in (0, 2)]
        assert lines[0]["data"] == lines[1]["data"], lines
        assert len(lines[0]["data"].split(",")) == 2
        assert lines[1]["rank"] == "1" and lines[1]["generation"] == "1"
        for line in lines:
            os.close(int(line["data_fd"]))
            os.close(int(line["control_fd"]))
    finally:
        _close(proc, ex)


def test_a_rank_that_never_asks_is_left_out_at_the_window():
    proc, ex = _staying(3)
    try:
        got, took = _reform(ex, [0, 2], 1, window=1.5)
        assert got == {0: (0, 2), 2: (1, 2)}, got
        assert 1.0 < took < 10, took
        # Its connection was closed: its own request fails, naming why.
        late, _ = _reform(ex, [1], 1, window=1)
        assert isinstance(late[1], (OSError, protocol.RendezvousError)), late
    finally:
        _close(proc, ex)


def test_a_rank_named_lost_is_not_waited_for_and_left_out_if_it_asks():
    # Rank 2 is cut off from the others (its connection to the server
    # open): rank 0's heartbeat names it, so the round ends as soon as
    # ranks 0 and 1 asked, well within the window; rank 2 naming rank 0
    # does not count against rank 0's view, and its own request is
    # answered with the close.
    proc, ex = _staying(3)
    try:
        out, began = {}, time.monotonic()

        def ask(r, lost):
            try:
                out[r] = ex[r].reform(1, 30, lost)
            except (OSError, protocol.RendezvousError) as e:
                out[r] = e
        threads = [threading.Thread(target=ask, args=(2, [0]))]
        threads[0].start()
        time.sleep(0.3)
        threads += [threading.Thread(target=ask, args=(r, [2]))
                    for r in (1, 0)]
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(60)
        assert out[0] == (0, 2) and out[1] == (1, 2), out
        assert isinstance(out[2], (OSError, protocol.RendezvousError)), out
        assert time.monotonic() - began < 10
    finally:
        _close(proc, ex)


def test_another_generation_is_refused():
    proc, ex = _staying(2)
    try:
        got, _ = _reform(ex, [0], 5, window=1)
        assert isinstance(got[0], protocol.RendezvousError), got
        assert "generation 0" in str(got[0]) and "asked for 5" in str(got[0])
    finally:
        _close(proc, ex)


@pytest.mark.timeout(60)
def test_the_server_outlives_rank_0_while_ranks_stay():
    proc, ex = _staying(3)
    try:
        proc.stdin.close()  # rank 0's process has gone
        ex[0].sock.close()  # and with it its connection
        time.sleep(1.5)
        assert proc.poll() is None
        got, _ = _reform(ex, [1, 2], 1, window=30)
        assert got == {1: (0, 2), 2: (1, 2)}, got
    finally:
        for e in ex:
            e.sock.close()
        proc.wait(timeout=30)  # every rank gone: it ends by itself
        sys.stderr.write(proc.stderr.read())
