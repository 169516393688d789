"""The rendezvous's re-form round (kerasdist/rendezvous/reform.py) for a
TCP job with recovery in place: a real server process and real sockets on
loopback, the ranks join() itself and tcp_job's Exchange on threads. A
rank that went ends the round at once, a foreign client's flood
changing nothing; one that neither asks nor goes is
left out at the window and its connection closed; one the lowest asker
names lost is not waited for, and is left out if it asks; another
generation is refused; the server outlives rank 0 while a rank stays
connected.
"""

import os
import socket
import sys
import threading
import time

import pytest

from kerasdist.rendezvous import client
from kerasdist.rendezvous import joining
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import tcp_job
from tests.support.hostile import foreigner
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


def _reform(exchanges, ranks, generation, window, grow=False):
    """reform() of `ranks` on threads; {rank: (new rank, size) or the
    error} and the seconds it took."""
    out, began = {}, time.monotonic()

    def one(r):
        try:
            out[r] = exchanges[r].reform(generation, window, (), grow)
        except (OSError, protocol.RendezvousError) as e:
            out[r] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(window + 40)
    return out, time.monotonic() - began


def _port_of(exchange):
    return exchange.sock.getpeername()[1]


def _describe(exchanges, ranks, size, generation):
    """describe() of each (Exchange, new rank) of `ranks` on threads, as
    the ranks of `generation` do; the descriptions by new rank, their
    descriptors closed."""
    specs = {}
    threads = [threading.Thread(target=lambda e=e, r=r: specs.update(
        {r: tcp_job.describe(e, r, size, KEY, 20, generation)}))
        for e, r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    lines = {r: dict(x.split("=", 1) for x in spec.split())
             for r, spec in specs.items()}
    for line in lines.values():
        os.close(int(line["data_fd"]))
        os.close(int(line["control_fd"]))
    return lines


def _close(proc, exchanges):
    for ex in exchanges:
        ex.sock.close()
    return _end(proc)


def test_a_rank_that_went_ends_the_round_at_once():
    # A foreign client floods the server all the while, re-form requests
    # (kd_stay, kd_reform) among its lines: unproven, they change nothing.
    proc, ex = _staying(3)
    stop, sent = threading.Event(), []
    flood = threading.Thread(target=foreigner,
                             args=(_port_of(ex[0]), stop, sent))
    flood.start()
    try:
        time.sleep(0.3)
        ex[1].sock.close()
        got, took = _reform(ex, [0, 2], 1, window=30)
        stop.set()
        flood.join(10)
        assert len(sent) > 10, sent
        assert got == {0: (0, 2), 2: (1, 2)}, got
        assert took < 10, took
        # The new generation exchanges its addresses as at the start.
        lines = _describe(ex, [(ex[0], 0), (ex[2], 1)], 2, 1)
        assert lines[0]["data"] == lines[1]["data"], lines
        assert len(lines[0]["data"].split(",")) == 2
        assert lines[1]["rank"] == "1" and lines[1]["generation"] == "1"
    finally:
        stop.set()
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


@pytest.mark.timeout(90)
def test_a_process_that_joins_comes_in_at_a_round_that_grows():
    # It proves the secret and waits; a lost rank's round (no grow=1)
    # leaves it waiting; the next round that grows gives it the last
    # rank, and the job of 3 exchanges its addresses at that generation.
    proc, ex = _staying(2)
    port = _port_of(ex[0])
    joined = {}
    joiner = threading.Thread(target=lambda: joined.update(
        joining.join_running(("127.0.0.1", port), 30, {})))
    try:
        joiner.start()
        deadline = time.monotonic() + 20
        while ex[0].joiners() != 1:
            assert time.monotonic() < deadline, "the joiner was not counted"
            time.sleep(0.05)
        got, _ = _reform(ex, [0, 1], 1, window=30)
        assert got == {0: (0, 2), 1: (1, 2)}, got
        _describe(ex, [(ex[0], 0), (ex[1], 1)], 2, 1)
        assert ex[1].joiners() == 1 and not joined
        got, _ = _reform(ex, [0, 1], 2, window=30, grow=True)
        assert got == {0: (0, 3), 1: (1, 3)}, got
        joiner.join(20)
        assert (joined["rank"], joined["size"], joined["generation"]) == \
            (2, 3, 2), joined
        new = tcp_job.Exchange(joined["PMI_PORT"], joined["PMI_ID"], 20)
        ex.append(new)
        lines = _describe(ex, [(ex[0], 0), (ex[1], 1), (new, 2)], 3, 2)
        assert len({line["data"] for line in lines.values()}) == 1, lines
        assert len(lines[2]["data"].split(",")) == 3
        assert ex[0].joiners() == 0
    finally:
        _close(proc, ex)


@pytest.mark.timeout(60)
def test_a_process_without_the_secret_cannot_join():
    proc, port = _serve(2, 20, "job1", "s" * 32)
    try:
        with pytest.raises(protocol.RendezvousError) as e:
            joining.join_running(("127.0.0.1", port), 10, {
                protocol.JOB_ID_ENV: "job1",
                protocol.SECRET_ENV: "t" * 32})
        assert "cannot join the job at 127.0.0.1:" in str(e.value)
        assert "another secret" in str(e.value)
        # A join whose proof is wrong is dropped, unanswered.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"cmd=kd_auth job=job1 nonce=x\n")
            assert protocol.read_line(s).startswith("cmd=kd_challenge rc=0")
            s.sendall(b"cmd=kd_join node=n proof=00\n")
            assert protocol.read_line(s) == ""
    finally:
        _end(proc)


def _standby(size, generation=0):
    """A standby server of the job (reform.py), as a rank starts it; (its
    address, its process)."""
    job, key, proven = protocol.identity({})
    port, proc = client.start_standby(size, 20, job, key, "127.0.0.1",
                                      proven, generation)
    return f"127.0.0.1:{port}", proc


def _end_standby(proc):
    proc.stdin.close()  # its rank has gone: it ends, no rank using it
    assert proc.wait(timeout=20) == 0


@pytest.mark.timeout(90)
def test_a_standby_re_forms_the_ranks_that_prove_their_generation():
    # The job's server gone (here: just not asked), ranks 1 and 2 of 3
    # rejoin the standby; rank 1 asks first naming rank 0 lost, and the
    # round waits for rank 2, which comes later: a job of 2 at generation
    # 1, its addresses exchanged through the standby.
    at, standby = _standby(3)
    ex = []
    try:
        # A rejoin whose proof is wrong is dropped, unanswered, and claims
        # nothing: rank 1 rejoins after it.
        job = protocol.identity({})[0]
        with socket.create_connection(("127.0.0.1", int(at.rpartition(
                ":")[2])), timeout=10) as s:
            s.sendall(f"cmd=kd_auth job={job} nonce=x\n".encode())
            assert protocol.read_line(s).startswith("cmd=kd_challenge rc=0")
            s.sendall(b"cmd=kd_rejoin rank=1 generation=0 proof=00\n")
            assert protocol.read_line(s) == ""
        ex = [None] + [joining.rejoin(at, r, 0, 20, {}) for r in (1, 2)]
        out = {}
        first = threading.Thread(target=lambda: out.update(
            {1: ex[1].reform(1, 30, [0])}))
        first.start()
        time.sleep(0.5)
        out[2] = ex[2].reform(1, 30, [0])
        first.join(30)
        assert out == {1: (0, 2), 2: (1, 2)}, out
        lines = _describe(ex, [(ex[1], 0), (ex[2], 1)], 2, 1)
        assert lines[0]["data"] == lines[1]["data"], lines
        # Rank 1 twice, or another generation: refused.
        for rank, generation in ((1, 0), (0, 3)):
            with pytest.raises(protocol.RendezvousError) as e:
                joining.rejoin(at, rank, generation, 10, {})
            assert "refused this rank" in str(e.value)
    finally:
        for e in ex[1:]:
            e.sock.close()
        _end_standby(standby)


@pytest.mark.timeout(60)
def test_a_standby_needs_more_than_half_of_the_ranks():
    # Rank 2 of 3 alone (ranks 0 and 1 named lost): it may be the cut-off
    # side of a job that goes on elsewhere, so it is refused, saying why.
    at, standby = _standby(3)
    try:
        ex = joining.rejoin(at, 2, 0, 20, {})
        with pytest.raises(protocol.RendezvousError) as e:
            ex.reform(1, 30, [0, 1])
        assert "only 1 of the job's 3 ranks could re-form here" in \
            str(e.value)
        ex.sock.close()
    finally:
        _end_standby(standby)
