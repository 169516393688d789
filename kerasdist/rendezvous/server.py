"""Rank 0's rendezvous server: a PMI server for processes that a platform
started, not an MPI launcher (the package's note).

Rank 0 starts it (client.py) as a small process of its own, `python -I
server.py serve PORT SIZE TIMEOUT_SECONDS [ADDRESS]`: it listens on the
coordinator's port, and serves until every rank's MPI has finalized or
gone (or, after rank 0 itself has gone, for a short grace). On each
connection, what it has proved decides what it may say: a hello proves
the job's secret first (`kd_auth`, a challenge, an HMAC; then the hello,
a barrier of all ranks with a deadline: hello.py), and on that connection
only its rank's `kd_watch` and `kd_up` follow (watch.py); MPICH's client,
which cannot prove the secret, proves the one-time PMI_ID this server gave
its rank in the hello's reply, and then speaks PMI-1 (pmi.py).

Run by path in isolated mode, it imports its siblings here (protocol,
hello, pmi, watch: standard library only) from this directory, and nothing
else of kerasdist; imported as kerasdist.rendezvous.server (the tests), the
same modules from the package.
"""

import errno
import os
import socket
import sys
import threading
import time

if __package__:
    from kerasdist.rendezvous import hello
    from kerasdist.rendezvous import pmi
    from kerasdist.rendezvous import protocol
    from kerasdist.rendezvous import reform
    from kerasdist.rendezvous import watch
else:
    # `python -I server.py`: isolated mode puts neither this directory nor
    # kerasdist on sys.path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hello  # noqa: E402
    import pmi  # noqa: E402
    import protocol  # noqa: E402
    import reform  # noqa: E402
    import watch  # noqa: E402

# After rank 0 has gone: how long the server still serves the other ranks'
# finalize (they are a barrier's reply away from it).
_GRACE_S = 30.0
# A rank's hello closed while its MPI's connection is open: how long the
# server waits for that one to close too (the same death), to say the rank
# died inside MPI_Init rather than before its MPI started.
_HELLO_BEFORE_MPI_S = 2.0
# After refusing two launches on its port: how long the server still
# answers each hello with that (at most the rendezvous' timeout).
_REFUSED_S = 60.0


class _Conn:
    """One connection: what it has proved, and which rank it is."""

    def __init__(self, sock):
        self.sock = sock
        self.since = time.monotonic()
        self.nonce = None    # the server's challenge, once asked
        self.theirs = None   # the client's nonce
        self.proven = False  # proved the secret (hello) or a PMI_ID (PMI)
        self.rank = None     # a PMI connection's rank
        self.hello_rank = None
        self.node = ""       # the node its hello named (node_identity)
        self.watching = False  # a hello's, open for its process's life
        self.joining = False   # waits to join a running job (reform.py)
        self.dropped = False

    def still_open(self):
        """Whether the peer still holds the connection: its reading thread
        may not have seen an end that has already come (a process that
        exited a moment ago), so look without taking anything."""
        if self.dropped:
            return False
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK |
                                       socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True  # open, nothing to read
        except OSError:
            return False

    def drop(self):
        """Ends the connection; its reading thread sees the end at once
        (close() alone would not wake a thread blocked reading it)."""
        self.dropped = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass



class _Server(hello.Hello, pmi.PmiCommands, watch.Watchers,
              reform.Reforms):
    def __init__(self, size, timeout, job="unnamed", key=b"", secret=False):
        self.size = size
        self.timeout = timeout
        self.job = job
        self.secret = secret
        self.key = key or protocol.identity({})[1]
        self.kvsname = f"kerasdist_{os.getpid()}_{int(time.time())}"
        self.cv = threading.Condition()
        self.hello = {}        # rank -> _Conn, until all have come
        self.hello_done = False
        self.tokens = {}       # PMI_ID -> rank, once formed, until used
        self.kvs = {}
        self.keys_of = {}      # rank -> keys it put
        self.barrier = {}      # rank -> _Conn waiting in barrier_in
        self.barrier_since = None
        self.pmi = {}          # rank -> _Conn of its MPI, while open
        self.pmi_seen = set()  # ranks whose MPI ever connected
        self.pmi_done = set()  # ranks whose MPI finalized or went
        self.dead = set()      # ranks whose MPI went without finalizing
        self.watchers = {}     # rank -> its hello's _Conn, once formed
        self.up = set()        # ranks whose kd.init() finished (kd_up)
        self.hello_gone = {}   # rank -> when its hello closed, MPI's open
        self.nodes = []        # rank -> its node's host name, once formed
        self.mapping = None    # PMI_process_mapping, once formed
        self.conns = set()
        self.parent_gone_at = None
        self.started = time.monotonic()
        self.formed_at = None  # when every rank had said hello
        self.failed = False
        self.told = []         # hello connections told to end the rank
        self.told_at = None
        self.port = 0          # the port it listens on
        self.refused = None    # the line of a refusal (hello.refuse)
        self.refused_at = None

    def send(self, conn, line):
        try:
            conn.sock.sendall((line + "\n").encode())
        except OSError:
            pass

    def serve(self, conn):
        try:
            buf = b""
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    if len(buf) > protocol.MAX_LINE:
                        raise protocol.BadConnection("a line beyond the bound")
                    data = conn.sock.recv(65536)
                    if not data:
                        break
                    buf += data
                    continue
                line, buf = buf[:i].decode(errors="replace"), buf[i + 1:]
                if len(line) > protocol.MAX_LINE:
                    raise protocol.BadConnection("a line beyond the bound")
                t = protocol.tokens(line)
                cmd = t.get("cmd", "")
                if conn.rank is not None:
                    self.on_pmi(conn, cmd, t)
                elif (cmd in ("kd_up", "kd_watch")
                      and conn.hello_rank is not None):
                    self.on_up(conn, line)
                elif cmd == "kd_auth" and conn.nonce is None:
                    self.on_auth(conn, t)
                elif cmd == "kd_hello":
                    self.on_hello(conn, t)
                elif cmd == "kd_join":
                    self.on_join(conn, t)
                elif cmd == "kd_rejoin":
                    self.on_rejoin(conn, t)
                elif cmd == "kd_conflict":
                    self.on_conflict(conn, t)
                elif cmd == "initack" and conn.nonce is None:
                    self.on_initack(conn, t)
                else:
                    raise protocol.BadConnection(
                        f"{cmd[:32]!r} from a connection that did not prove "
                        f"itself")
        except (OSError, protocol.BadConnection):
            pass
        finally:
            with self.cv:
                rank = conn.rank
                if rank is not None and self.pmi.get(rank) is conn:
                    del self.pmi[rank]
                    if rank not in self.pmi_done:
                        self.dead.add(rank)
                        self.pmi_done.add(rank)
                        if self.barrier:
                            # A rank left while others wait for it: they
                            # fail now rather than wait forever.
                            self.barrier.pop(rank, None)
                            self.fail_barrier(
                                f"the MPI of rank {rank} ended without "
                                f"finalizing")
                        elif not self.failed and len(self.up) < self.size:
                            # Its process ended while the job started:
                            # the others wait for it where nothing else
                            # would tell them. Later, the heartbeat does.
                            self.fail_start()
                watched = conn.hello_rank
                if (conn.watching and self.watchers.get(watched) is conn
                        and watched not in self.up
                        and watched not in self.pmi_done
                        and not self.failed):
                    # Its process ended before its kd.init() finished,
                    # perhaps before its MPI ever came: the others would
                    # wait for it in MPI_Init until the deadline.
                    # (A barrier it was missing from fails as the server
                    # ends, which drops every connection.) Where its MPI's
                    # connection is open, the same death closes that one
                    # too, and that is the line to give (its MPI was
                    # inside MPI_Init): check_deadlines waits a moment
                    # for it.
                    if watched in self.pmi:
                        self.hello_gone[watched] = time.monotonic()
                    else:
                        self.hello_lost(watched)
                for r, c in list(self.hello.items()):
                    if c is conn:
                        del self.hello[r]
                if conn.joining:
                    self.joining = [c for c in self.joining if c is not conn]
                self.conns.discard(conn)
                self.cv.notify_all()
            conn.drop()
            conn.sock.close()

    def admit(self, conn):
        """Counts a new connection in; drops the oldest that has not proved
        itself when there are too many such."""
        with self.cv:
            self.shed(protocol.MAX_UNPROVEN - 1)
            self.conns.add(conn)

    def shed(self, keep):
        """Drops the oldest connections that proved nothing, all but
        `keep`."""
        with self.cv:
            unproven = sorted((c for c in self.conns
                               if not (c.proven or c.dropped)),
                              key=lambda c: c.since)
            for c in unproven[:max(0, len(unproven) - keep)]:
                c.drop()

    def finished(self):
        with self.cv:
            if self.refused_at is not None:
                # Refused: it answers the other launch's later hellos
                # with that line for a while (hello.refuse).
                return (time.monotonic() - self.refused_at >
                        min(self.timeout, _REFUSED_S))
            if self.failed:
                return not self.telling()
            if len(self.pmi_done) >= self.size:
                return True  # every rank's MPI has finalized or gone
            # A TCP job that re-forms in place (reform.py) keeps it while
            # any of its ranks is connected.
            return (self.parent_gone_at is not None and
                    (not self.pmi or (not self.staying and
                     time.monotonic() - self.parent_gone_at > _GRACE_S)))

    def check_deadlines(self, now):
        with self.cv:
            self.check_reform(now)
            for c in self.conns:
                if (not (c.proven or c.dropped) and
                        now > c.since + protocol.AUTH_DEADLINE_S):
                    c.drop()
            for rank, when in list(self.hello_gone.items()):
                if rank in self.pmi_done or self.failed:
                    del self.hello_gone[rank]
                elif now > when + _HELLO_BEFORE_MPI_S:
                    del self.hello_gone[rank]
                    self.hello_lost(rank)
            if self.failed:
                return
            if not self.hello_done and now > self.started + self.timeout:
                self.fail_hello()
            elif (self.formed_at is not None and
                  len(self.pmi_seen) < self.size and
                  now > self.formed_at + self.timeout):
                # A rank met the others but its MPI never came: the others
                # would wait in MPI_Init forever. Ending makes it fail.
                missing = protocol.first_missing(self.size, self.pmi_seen)
                line = (f"the MPI of ranks {missing} of {self.size} did "
                        f"not start within {self.timeout:g} s of meeting "
                        f"({protocol.TIMEOUT_ENV}); ending the job's MPI start")
                sys.stderr.write(f"kerasdist rendezvous: {line}\n")
                self.tell_watchers(line)
                self.failed = True
            elif (self.barrier_since is not None and self.barrier and
                  now > self.barrier_since + self.timeout):
                self.fail_barrier(f"not within {self.timeout:g} s")


def _watch_parent(server):
    sys.stdin.read()  # EOF: rank 0 has gone
    with server.cv:
        server.parent_gone_at = time.monotonic()
        server.cv.notify_all()


def _listen(port, size, timeout, address=""):
    """The listening socket on `address`:`port` ("": every interface);
    while the port is in use (the server of an earlier run still ending),
    says "waiting" once and retries until `timeout`."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
            listener.listen(min(max(size, 128), 4096))
            return listener
        except OSError as e:
            listener.close()
            if (e.errno != errno.EADDRINUSE or port == 0 or
                    time.monotonic() >= deadline):
                raise
        if not said:
            print(f"waiting {port}", flush=True)
            said = True
        time.sleep(protocol.RETRY_S)


def _serve(port, size, timeout, address=""):
    job = os.environ.get("_KERASDIST_RENDEZVOUS_JOB", "unnamed")
    key = bytes.fromhex(os.environ.get("_KERASDIST_RENDEZVOUS_KEY", ""))
    try:
        listener = _listen(port, size, timeout, address)
    except OSError as e:
        print(f"{e.strerror or e} (the coordinator's port must be free on "
              f"rank 0's host)", flush=True)
        return 1
    server = _Server(size, timeout, job, key,
                     os.environ.get("_KERASDIST_RENDEZVOUS_SECRET") == "1")
    server.port = listener.getsockname()[1]
    standby = os.environ.get("_KERASDIST_RENDEZVOUS_STANDBY")
    if standby:  # a TCP job's standby (reform.py), at that generation
        server.stand_by(int(standby))
    threading.Thread(target=_watch_parent, args=(server,),
                     daemon=True).start()

    def accept():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                               errno.ENOMEM, errno.ECONNABORTED,
                               errno.EPROTO, errno.EPERM):
                    # Out of descriptors (a flood): shed the older half of
                    # the connections that proved nothing, and go on.
                    server.shed(protocol.MAX_UNPROVEN // 2)
                    time.sleep(0.01)
                    continue
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            server.admit(conn)
            try:
                threading.Thread(target=server.serve, args=(conn,),
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had
                with server.cv:
                    server.conns.discard(conn)
                sock.close()

    threading.Thread(target=accept, daemon=True).start()
    print(f"ready {listener.getsockname()[1]}", flush=True)
    while not server.finished():
        server.check_deadlines(time.monotonic())
        with server.cv:
            server.cv.wait(0.5)
    with server.cv:
        for c in list(server.conns):
            c.drop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "serve":
        sys.exit(_serve(int(sys.argv[2]), int(sys.argv[3]),
                        float(sys.argv[4]), *sys.argv[5:]))
    sys.exit("usage: server.py serve PORT SIZE TIMEOUT_SECONDS "
             "[ADDRESS]")
