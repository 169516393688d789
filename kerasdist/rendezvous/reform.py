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

Growing: a process that joins the running job (rendezvous/joining.py)
proves the job's secret as a hello does and says `kd_join node=N
proof=P`; it then waits, its connection open, and is counted in the
answer to `kd_joiners` (rank 0 asks at each commit: kerasdist/_core/
grow.py). A round in which a rank asked with `grow=1` (the ranks agreed
at a commit to let the waiting processes in) takes every process then
waiting after the ranks that asked: each hears, under the hello's
proof, `kd_joined rc=0 pmiid=T rank=R size=N generation=G`, proves T on
a PMI connection of its own (pmi.py) and exchanges its addresses with
the others. A round without it (a lost rank's) leaves them waiting.

A standby: in a job of several hosts, one rank on another host than the
server's runs a second server (`stand_by`: already formed, at the job's
generation), whose address every rank learns at each formation
(tcp_job.designate_standby). Where the server has gone with its host
(it does not answer a survivor within the heartbeat's timeout, at most
10 s: kerasdist/_core/tcp_start.py), the survivors prove their rank and
generation to the standby instead (`kd_rejoin rank=R generation=G
proof=P`, after the challenge) and ask it for the next generation;
until the round's end it waits for every rank of the generation that
neither went nor was named lost, whether or not it has come yet. A job
with a standby re-forms only with a quorum of its ranks (more than half,
or half with its rank 0): a link cut between the server's host and the
rest could otherwise leave two jobs, one on each side, where the ranks
that reach neither quorum end in one line (a relaunch resumes from
disk).

Standard library only; imported by path with server.py (its note).
"""

import hmac
import secrets
import time

if __package__:
    from kerasdist.rendezvous import protocol
else:  # beside server.py, run by path
    import protocol

# The window's bounds: a request's W is clamped to them.
MIN_WINDOW_S, MAX_WINDOW_S = 1.0, 600.0
# The most processes waiting to join at once.
MAX_JOINERS = 1024


class Reforms:
    """The re-form round of the server (server._Server, whose state it
    shares: size, pmi, dead, pmi_done, up, watchers, kvs, keys_of,
    barrier, cv)."""

    generation = 0
    staying = False        # a rank said kd_stay: outlive rank 0
    asked = None           # old rank -> its connection, during a round
    named = None           # old rank -> the ranks it named lost
    round_until = None     # the round's deadline (monotonic)
    growing = False        # a rank of the round asked with grow=1
    expected = frozenset()  # a standby's ranks, waited for till they come
    standing_by = False    # this server is a standby, not yet used
    joining = ()           # connections waiting to join (kd_join)

    def on_stay(self, conn):
        """kd_stay: the rank's transport formed (its kd.init() is past the
        start's failures) and its connection lasts for the job's life."""
        with self.cv:
            self.staying = True
            self.up.add(conn.rank)
        self.send(conn, "cmd=kd_stay_ack rc=0")

    def on_join(self, conn, t):
        """kd_join: a process that proved the job's secret waits to join
        the running job at its next grow round."""
        if conn.nonce is None or conn.hello_rank is not None or \
                conn.joining:
            raise protocol.BadConnection("join before the challenge, or "
                                         "twice")
        node = t.get("node", "")
        if len(node) > protocol.NODE_MAX or not hmac.compare_digest(
                t.get("proof", ""), protocol.mac_of(
                    self.key, "join", conn.nonce, conn.theirs, node)):
            raise protocol.BadConnection("no proof of the secret")
        conn.proven = conn.joining = True
        conn.node = node
        with self.cv:
            if len(self.joining) >= MAX_JOINERS:
                return self.reply(conn, f"cmd=kd_joined rc=1 msg="
                                  f"{MAX_JOINERS} processes wait to join "
                                  f"already")
            self.joining = [*self.joining, conn]

    def stand_by(self, generation):
        """This server is a standby for the job's `generation`: formed,
        its ranks staying, none connected yet (they come with
        kd_rejoin)."""
        with self.cv:
            self.generation = generation
            self.hello_done = self.staying = True
            self.formed_at = time.monotonic()
            self.up = set(range(self.size))
            self.pmi_seen = set(range(self.size))
            self.expected = frozenset(range(self.size))
            self.standing_by = True

    def on_rejoin(self, conn, t):
        """kd_rejoin: a rank of the job, whose server has gone, proves its
        rank and generation to this standby; its connection is then that
        rank's, as its PMI connection was."""
        if conn.nonce is None or conn.hello_rank is not None or \
                conn.rank is not None or conn.joining:
            raise protocol.BadConnection("rejoin before the challenge")
        try:
            rank, generation = int(t.get("rank")), int(t.get("generation"))
        except (TypeError, ValueError):
            raise protocol.BadConnection("malformed rejoin") from None
        if not hmac.compare_digest(t.get("proof", ""), protocol.mac_of(
                self.key, "rejoin", conn.nonce, conn.theirs, rank,
                generation)):
            raise protocol.BadConnection("no proof of the secret")
        conn.proven = True
        with self.cv:
            if generation != self.generation or rank not in self.expected \
                    or rank in self.pmi:
                return self.reply(
                    conn, f"cmd=kd_rejoined rc=1 msg=this standby serves "
                    f"generation {self.generation}, and rank {rank} of "
                    f"generation {generation} is not one it waits for")
            conn.rank = rank
            self.pmi[rank] = conn
        self.reply(conn, "cmd=kd_rejoined rc=0")

    def quorum_needed(self):  # with self.cv held
        """Whether a round needs a quorum: the job has a standby, or this
        is it."""
        at = self.kvs.get(protocol.STANDBY_KEY.format(
            generation=self.generation, what="at"), "-")
        return self.standing_by or at != "-"

    def end_round_without_quorum(self, old):  # with self.cv held
        """Too few ranks asked for the next generation: each hears why and
        its connection closes (its rank ends; a relaunch resumes)."""
        msg = (f"only {len(old)} of the job's {self.size} ranks could "
               f"re-form here, not more than half of them: the others may "
               f"go on without these where the rest of the job meets")
        for r, c in list(self.asked.items()):
            self.send(c, f"cmd=kd_reformed rc=1 msg={msg.replace(' ', '_')}")
            c.drop()
            if self.pmi.get(r) is c:
                del self.pmi[r]
        self.asked = self.round_until = self.named = None
        self.growing = False
        self.cv.notify_all()

    def joiners(self):
        """How many processes wait to join (kd_joiners)."""
        with self.cv:
            return sum(1 for c in self.joining if not c.dropped)

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
            self.growing = self.growing or t.get("grow") == "1"
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
                   if r not in self.asked
                   and (r in self.pmi or r in self.expected)
                   and r not in self.dead and r not in lost]
        if waiting and now < self.round_until:
            return
        old = sorted(r for r, c in self.asked.items()
                     if self.pmi.get(r) is c and r not in lost)
        if self.quorum_needed() and not (
                2 * len(old) > self.size or
                (2 * len(old) == self.size and 0 in old)):
            self.end_round_without_quorum(old)
            return
        conns = [self.asked[r] for r in old]
        # Left out (silent at the deadline, or named lost though it
        # asked: cut off from the others): its process hears the close.
        for r in (set(waiting) | lost) & set(self.pmi):
            self.pmi.pop(r).drop()
        self.generation += 1
        joiners = [c for c in self.joining if not c.dropped] \
            if self.growing else []
        if self.growing:
            self.joining = []
        self.size = len(old) + len(joiners)
        self.pmi = {new: c for new, c in enumerate(conns)}
        self.watchers = {}
        self.dead, self.pmi_done = set(), set()
        self.up = set(range(self.size))
        self.kvs, self.keys_of, self.barrier = {}, {}, {}
        self.barrier_since = None
        self.asked = self.round_until = self.named = None
        self.growing = False
        self.expected = frozenset()
        self.standing_by = False
        for new, c in enumerate(joiners, start=len(conns)):
            token = 0
            while token == 0 or token in self.tokens:
                token = 1 + secrets.randbelow(2 ** 31 - 2)
            self.tokens[token] = new
            self.reply(c, f"cmd=kd_joined rc=0 pmiid={token} rank={new} "
                          f"size={self.size} generation={self.generation}")
        for new, c in enumerate(conns):
            c.rank = new
            self.send(c, f"cmd=kd_reformed rc=0 rank={new} size={self.size} "
                         f"generation={self.generation}")
        self.cv.notify_all()
