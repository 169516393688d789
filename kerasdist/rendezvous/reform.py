"""The server's re-form round: a TCP job (tcp_job.py) forms again among
the ranks it still has, in place, after a lost rank.

Each rank of a TCP job with recovery in place keeps its PMI connection
open for the job's life (`kd_stay`, once its transport formed): its end
is that rank's end, and the server then outlives rank 0 (whose process
started it) for as long as such a connection is open. After a loss every
survivor asks on it for the next generation (`kd_reform generation=G
window=W lost=R,...`, the ranks its heartbeat reported lost). The round
ends once every rank of the current generation has asked, gone (its
connection closed) or been named lost by the lowest rank that asked (its
heartbeat's view: rank 0 watches every rank), or `W` seconds after the
first request (a rank silent till then is left out, its connection
closed, as is one named lost that asks: cut off from the others); the
ranks that asked, in their old order, are the new generation's ranks 0..n-1,
and each hears `kd_reformed rc=0 rank=R size=N`. They then exchange their
new listeners' addresses as at the start (put, barrier, get). A request
for another generation is answered rc=1 with why; that rank, as one left
out, ends (a relaunch resumes from disk).

Standard library only; imported by path with server.py (its note).
"""

import time

# The window's bounds: a request's W is clamped to them.
MIN_WINDOW_S, MAX_WINDOW_S = 1.0, 600.0


class Reforms:
    """The re-form round of the server (server._Server, whose state it
    shares: size, pmi, dead, pmi_done, up, watchers, kvs, keys_of,
    barrier, cv)."""

    generation = 0
    staying = False        # a rank said kd_stay: outlive rank 0
    asked = None           # old rank -> its connection, during a round
    named = None           # old rank -> the ranks it named lost
    round_until = None     # the round's deadline (monotonic)

    def on_stay(self, conn):
        """kd_stay: the rank's transport formed (its kd.init() is past the
        start's failures) and its connection lasts for the job's life."""
        with self.cv:
            self.staying = True
            self.up.add(conn.rank)
        self.send(conn, "cmd=kd_stay_ack rc=0")

    def on_reform(self, conn, t):
        try:
            generation = int(t.get("generation", ""))
            window = float(t.get("window", "30"))
            lost = {int(r) for r in t.get("lost", "-").split(",")
                    if r != "-"}
        except ValueError:
            generation, window, lost = -1, 30.0, set()
        window = min(MAX_WINDOW_S, max(MIN_WINDOW_S, window))
        with self.cv:
            if generation != self.generation + 1 or conn.rank is None:
                self.send(conn, f"cmd=kd_reformed rc=1 msg=the_job_is_at_"
                                f"generation_{self.generation}_and_this_rank_"
                                f"asked_for_{generation}")
                return
            if self.asked is None:
                self.asked, self.named = {}, {}
                self.round_until = time.monotonic() + window
            self.asked[conn.rank] = conn
            self.named[conn.rank] = {r for r in lost if 0 <= r < self.size}
            self.check_reform(time.monotonic())

    def check_reform(self, now):  # with self.cv held
        """Ends the round once every rank asked, went or was named lost by
        the lowest rank that asked (its heartbeat's view: rank 0's, which
        watches every rank, while rank 0 is there), or at its deadline."""
        if self.asked is None:
            return
        lost = self.named[min(self.asked)]
        waiting = [r for r in range(self.size)
                   if r not in self.asked and r in self.pmi
                   and r not in self.dead and r not in lost]
        if waiting and now < self.round_until:
            return
        old = sorted(r for r, c in self.asked.items()
                     if self.pmi.get(r) is c and r not in lost)
        conns = [self.asked[r] for r in old]
        # Left out (silent at the deadline, or named lost though it
        # asked: cut off from the others): its process hears the close.
        for r in set(waiting) | (lost & set(self.pmi)):
            self.pmi.pop(r).drop()
        self.generation += 1
        self.size = len(old)
        self.pmi = {new: c for new, c in enumerate(conns)}
        self.watchers = {}
        self.dead, self.pmi_done = set(), set()
        self.up = set(range(self.size))
        self.kvs, self.keys_of, self.barrier = {}, {}, {}
        self.barrier_since = None
        self.asked = self.round_until = self.named = None
        for new, c in enumerate(conns):
            c.rank = new
            self.send(c, f"cmd=kd_reformed rc=0 rank={new} size={self.size} "
                         f"generation={self.generation}")
        self.cv.notify_all()
