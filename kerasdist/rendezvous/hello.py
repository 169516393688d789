"""The server's hello: each connection proves the job's secret first
(`kd_auth`: the server's challenge and proof, the client's HMAC), then says
which rank of which size it is and on which node (`kd_hello`); the hello is
a barrier of all ranks with a deadline (`fail_hello`). Once every rank has
come, each hears its one-time PMI_ID, which its MPI proves itself with
(pmi.py), and its connection stays open for the watch (watch.py).

Standard library only; imported by path with server.py (its note).
"""

import hmac
import secrets
import time

if __package__:
    from kerasdist.rendezvous import pmi
    from kerasdist.rendezvous import protocol
else:  # beside server.py, run by path
    import pmi
    import protocol


class Hello:
    """The hello of the server (server._Server, whose state it shares)."""

    # Who may talk: a hello proves the secret first (kd_auth, a challenge,
    # an HMAC); MPICH's client, which cannot, proves the one-time PMI_ID
    # this server gave its rank in the hello's reply.
    def on_auth(self, conn, t):
        job = t.get("job", "")
        # secret=: whether this job has one, so that a rank that differs
        # hears that rather than "another job" (it proves nothing: the
        # proof below does).
        if job != self.job:
            self.send(conn, f"cmd=kd_challenge rc={protocol.OTHER_JOB} "
                      f"job={self.job} secret={int(self.secret)}")
            raise protocol.BadConnection("another job")
        conn.theirs = t.get("nonce", "")[:64]
        conn.nonce = secrets.token_hex(16)
        proof = protocol.mac_of(self.key, "server", conn.theirs, conn.nonce,
                                self.job)
        # state=: what a rank 0 that finds this port held needs to know
        # (client._start_server): "live" (this job's rank 0 runs: the
        # port is another launch's), "ending" (its rank 0 has gone, or
        # every rank finalized: an earlier run, still ending) or
        # "refused" (two launches met here already).
        self.send(conn, f"cmd=kd_challenge rc=0 job={self.job} "
                  f"secret={int(self.secret)} nonce={conn.nonce} "
                  f"proof={proof} state={self.state()}")

    def state(self):
        with self.cv:
            if self.refused is not None:
                return "refused"
            if (self.parent_gone_at is not None or
                    len(self.pmi_done) >= self.size):
                return "ending"
            return "live"

    def refuse(self, why, newcomer=None):  # with self.cv held
        """Two launches met on this port (two processes claimed one rank,
        or a second rank 0 found this server live): every rank of this
        server, waiting in the hello or past it, hears one line and ends,
        and so does every hello until the server ends (a while after:
        the other launch's ranks arrive later), rather than any of them
        forming a job of both."""
        self.refused = (
            f"{why} at the coordinator's port {self.port}: two launches of "
            f"job {self.job} met there (another job on this port with the "
            f"same id, or none), and neither may go on as a mix of both; "
            f"give each job a port of its own (MASTER_PORT), or a "
            f"{protocol.JOB_ID_ENV} of its own, and each process its own "
            f"rank")
        self.refused_at = time.monotonic()
        for c in list(self.hello.values()) + ([newcomer] if newcomer
                                               else []):
            self.reply(c, f"cmd=kd_ready rc={protocol.CONFLICT} "
                       f"msg={self.refused}")
        self.hello = {}
        self.tell_watchers(self.refused)
        self.hello_done = True
        self.failed = True

    def on_conflict(self, conn, t):
        """kd_conflict: a rank 0 of another launch of this job (it proved
        the key) found this server live on its port (client._probe)."""
        if conn.nonce is None or conn.hello_rank is not None or \
                not hmac.compare_digest(t.get("proof", ""), protocol.mac_of(
                    self.key, "conflict", conn.nonce, conn.theirs)):
            raise protocol.BadConnection("kd_conflict without the proof")
        with self.cv:
            if self.refused is None and self.state() == "live":
                self.refuse("a second rank 0 found this job's server")
            self.cv.notify_all()

    def reply(self, conn, line):
        """A hello's reply, with its proof."""
        mac = protocol.mac_of(self.key, "ready", conn.theirs, conn.nonce, line)
        self.send(conn, f"{line} mac={mac}")

    # The hello: a barrier of all ranks with a deadline.
    def on_hello(self, conn, t):
        if conn.nonce is None or conn.hello_rank is not None:
            raise protocol.BadConnection("hello before the challenge, or twice")
        try:
            rank, size = int(t.get("rank")), int(t.get("size"))
        except (TypeError, ValueError):
            raise protocol.BadConnection("malformed hello") from None
        # The rank's node (node_identity), under the proof with rank and
        # size; a hello without one (an older client) proves those alone,
        # and MPI then tells nodes apart by host name.
        node = t.get("node", "")
        if len(node) > protocol.NODE_MAX:
            raise protocol.BadConnection("a node beyond the bound")
        said = (rank, size, node) if node else (rank, size)
        if not hmac.compare_digest(
                t.get("proof", ""),
                protocol.mac_of(self.key, "hello", conn.nonce, conn.theirs,
                                *said)):
            raise protocol.BadConnection("no proof of the secret")
        conn.proven = True
        conn.hello_rank = rank
        conn.node = node
        with self.cv:
            if self.refused is not None:
                return self.reply(conn, f"cmd=kd_ready rc="
                                  f"{protocol.CONFLICT} msg={self.refused}")
            held = self.hello.get(rank) or self.watchers.get(rank)
            if (held is not None and held in self.conns
                    and held.still_open() and rank not in self.pmi_done
                    and size == self.size):
                # A rank that a live process holds (its hello waits, or
                # its process runs): a second launch on this port. Both
                # end, at any time in the job.
                return self.refuse(f"two processes claimed rank {rank} of "
                                   f"{self.size}", conn)
            if self.hello_done:
                return self.reply(
                    conn, f"cmd=kd_ready rc={protocol.FORMED} msg=its job of "
                    f"{self.size} formed (or failed) without this rank "
                    f"{rank}; if no earlier run of the job is still ending, "
                    f"give each process its own rank in 0..{self.size - 1}")
            if size != self.size:
                return self.reply(
                    conn, f"cmd=kd_ready rc=1 msg=this process says the job "
                    f"has {size} processes but rank 0 says {self.size}; give "
                    f"every process the same size")
            if not 0 <= rank < self.size or rank in self.hello:
                return self.reply(
                    conn, f"cmd=kd_ready rc=1 msg=rank {rank} came twice; "
                    f"give each process its own rank in 0..{self.size - 1}")
            self.hello[rank] = conn
            if len(self.hello) == self.size:
                self.hello_done = True
                self.formed_at = time.monotonic()
                nodes = [self.hello[r].node for r in range(self.size)]
                self.mapping = pmi.process_mapping(nodes)
                self.nodes = [n.partition("/")[0] for n in nodes]
                for r, c in self.hello.items():
                    token = 0
                    while token == 0 or token in self.tokens:
                        token = 1 + secrets.randbelow(2 ** 31 - 2)
                    self.tokens[token] = r
                    self.reply(c, f"cmd=kd_ready rc=0 pmiid={token}")
                self.watchers = dict(self.hello)
                self.hello = {}

    def fail_hello(self):  # with self.cv held
        shown = protocol.first_missing(self.size, self.hello)
        for c in self.hello.values():
            self.reply(c, f"cmd=kd_ready rc=1 msg=ranks {shown} of "
                       f"{self.size} did not reach the coordinator within "
                       f"{self.timeout:g} s ({protocol.TIMEOUT_ENV}); check "
                       f"that every process was started and has the same "
                       f"coordinator")
        self.hello_done = True
        self.failed = True
