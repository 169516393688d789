"""The liveness watch while a job starts, both ends of it.

Each rank's hello connection (client.py) stays open: through it the server
ends every rank with one line when the job cannot start. One such case is
a rank whose MPI's PMI connection closes without MPI_Finalize, or whose
process ends, before every rank has said that its kd.init() finished
(`started`): past MPI_Init's PMI exchange the others would wait for it for
ever, and the heartbeat that reports a lost rank later
(ops/core/control/liveness.cc) starts only in init, after MPI_Init.

The rank's end: `start_watch` and `started`. The server's end: `Watchers`,
part of server._Server.

Standard library only; imported by path with server.py (its note).
"""

import hmac
import os
import sys
import threading
import time

if __package__:
    from kerasdist.rendezvous import protocol
else:  # beside server.py, run by path
    import protocol

_watching = []  # (the hello's connection, its signer), kept for life
# After telling the ranks to end: how long the server waits for their
# processes to end before it closes their MPI's connections (telling()).
_TOLD_S = 10.0


def start_watch(sock, check, sign, launch):
    """Keeps the hello's connection open: if the server ends the job's MPI
    start (a rank missing from MPI's barrier, or a rank's process gone
    while the job starts), it says so here, and this rank prints that one
    line and ends instead of waiting in MPI_Init (MPI's own error says
    nothing of who is missing; inside MPI_Init, past its PMI exchange,
    MPI says nothing at all and waits for ever). The server's line gives
    the exit code where it is not 1: EXIT_PEER_LOST, with the heartbeat's
    line ("kerasdist: rank 0: lost rank 1 ...; ending this rank.")."""
    sock.settimeout(None)
    _watching.append((sock, sign))
    # The server now knows that this connection lasts as long as this
    # process: its end before kd_up is this process's end.
    try:
        sock.sendall((sign("cmd=kd_watch") + "\n").encode())
    except OSError:
        pass

    def watch():
        try:
            line = protocol.read_line(sock)
        except (OSError, ValueError):
            return
        body, _, mac = line.rpartition(" mac=")
        if body.startswith("cmd=kd_fail ") and check(body, mac):
            head, _, msg = body.partition(" msg=")
            code = protocol.tokens(head).get("code", "")
            if code.isdigit() and 0 < int(code) < 256:
                status, who = int(code), f"rank {launch.rank}"
            else:
                status, who = 1, f"rank {launch.rank} of {launch.size}"
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.write(2, f"kerasdist: {who}: {msg}\n".encode(
                errors="replace"))
            os._exit(status)

    threading.Thread(target=watch, daemon=True,
                     name="kerasdist-rendezvous-watch").start()


def started():
    """Tells rank 0's server that this rank's `kd.init()` has finished:
    from here on its heartbeat (which init started, every rank connected)
    reports a rank that ends, so the server stops doing so once every rank
    has said this. Until then a rank whose process ends (its MPI's PMI
    connection closes without MPI_Finalize) ends the others with one line
    naming it: they would wait for it inside MPI_Init, or in init's first
    collectives, for ever. Nothing where this process met no coordinator,
    or the server has gone."""
    for sock, sign in _watching:
        try:
            sock.sendall((sign("cmd=kd_up") + "\n").encode())
        except OSError:
            pass


class Watchers:
    """The server's end (server._Server, whose state it shares): each
    rank's hello connection once the job formed (`watchers`), which ranks'
    kd.init() finished (`up`), and the one line that ends them all."""

    def tell_watchers(self, line, code=None):  # with self.cv held
        """Every rank whose MPI has not finalized hears `line` on its
        hello's connection, prints it and ends (start_watch): with exit
        code `code`, else 1."""
        head = "cmd=kd_fail" + (f" code={code}" if code else "")
        for r, c in self.watchers.items():
            if r not in self.pmi_done or r in self.dead:
                self.reply(c, f"{head} msg={line}")
                self.told.append(c)
        self.told_at = time.monotonic()

    def telling(self):  # with self.cv held
        """Whether ranks told to end (tell_watchers) may still be reading
        it: the server keeps their MPI's connections open until each
        told rank's process has ended (its hello's connection closed), or
        for _TOLD_S. Closing them at once would end a rank's MPI inside
        MPI_Init, before its watch thread had printed the line: MPICH
        crashes (SIGSEGV) when its PMI connection closes there."""
        return (any(c in self.conns for c in self.told) and
                time.monotonic() - self.told_at < _TOLD_S)

    def fail_start(self, how="its MPI's connection to the rendezvous "
                   "closed without MPI_Finalize"):  # with self.cv held
        """Ends the job when a rank's process ended while it started
        (before every rank's kd.init() had finished, see started()): the
        others wait for it in MPI_Init, past its PMI exchange, or in
        init's first collectives, where MPI waits for ever and the
        heartbeat does not watch yet. Each of them prints the heartbeat's
        kind of line, naming the rank, and ends with EXIT_PEER_LOST. `how`:
        what showed that the process ended."""
        lost = sorted(self.dead)
        hosts = {self.nodes[r] for r in lost if r < len(self.nodes)}
        where = f" on host {hosts.pop()}" if len(hosts) == 1 else ""
        which = (f"rank {lost[0]}{where}: its process" if len(lost) == 1
                 else f"ranks {protocol.rank_list(lost)}{where}: their "
                 f"processes")
        self.tell_watchers(
            f"lost {which} ended while the job was starting ({how} "
            f"before every rank's kd.init() had finished, where MPI would "
            f"wait for it for ever); ending this rank.",
            code=protocol.EXIT_PEER_LOST)
        self.failed = True

    def on_up(self, conn, line):
        """kd_up on a hello's connection: that rank's kd.init() finished
        (started()). kd_watch: the connection stays open for as long as
        that rank's process lives (start_watch)."""
        body, _, mac = line.rpartition(" mac=")
        if body not in ("cmd=kd_up", "cmd=kd_watch") or not \
                hmac.compare_digest(mac, protocol.mac_of(
                    self.key, "up", conn.theirs, conn.nonce, body)):
            raise protocol.BadConnection(
                "kd_up or kd_watch without the hello's proof")
        with self.cv:
            if self.watchers.get(conn.hello_rank) is not conn:
                return
            if body == "cmd=kd_up":
                self.up.add(conn.hello_rank)
            else:
                conn.watching = True

    def hello_lost(self, rank):  # with self.cv held
        self.dead.add(rank)
        self.pmi_done.add(rank)
        self.fail_start("its hello's connection to the rendezvous closed")

