"""The server's PMI-1 half: what MPICH's client says to it once the ranks
have met (server.py).

A launcher gives MPICH a PMI server; MPICH's client speaks the simple
PMI-1 wire protocol to it (one line per command) when it finds
`PMI_PORT=host:port` and `PMI_ID` in its environment at `MPI_Init`: it
learns its rank and size, publishes its address ("business card") with
`put`, meets the others at `barrier_in`, reads their cards with `get`, and
at `MPI_Finalize` meets them once more. The data itself then moves over
MPI's own transports (shared memory within a host, its network module
across hosts); the server only relays those few small key-value pairs.

MPICH shares memory only within a node: the server answers its
PMI_process_mapping from the nodes the hellos named (`process_mapping`).

Standard library only; imported by path with server.py (its note).
"""

import sys
import time

if __package__:
    from kerasdist.rendezvous import protocol
else:  # beside server.py, run by path
    import protocol

# The key under which MPICH asks its process manager which ranks share a
# node (PMI_process_mapping); the server answers it from the hellos.
PROCESS_MAPPING_KEY = "PMI_process_mapping"
_KEY_MAX, _VALUE_MAX = 64, 1024


class PmiCommands:
    """The PMI-1 commands of the server (server._Server, whose state they
    share): a connection that proves a rank's PMI_ID (`on_initack`), then
    one line per command (`on_pmi`)."""

    def on_initack(self, conn, t):
        try:
            token = int(t.get("pmiid", ""))
        except ValueError:
            raise protocol.BadConnection("malformed initack") from None
        with self.cv:
            rank = self.tokens.pop(token, None)
            if rank is None:
                raise protocol.BadConnection("not a rank's PMI_ID")
            conn.proven = True
            conn.rank = rank
            self.pmi[rank] = conn
            self.pmi_seen.add(rank)
        self.send(conn, f"cmd=initack rc=0\ncmd=set size={self.size}\n"
                   f"cmd=set rank={rank}\ncmd=set debug=0")

    # PMI-1, the commands MPICH's client sends, from a proven rank.
    def on_pmi(self, conn, cmd, t):
        send = lambda line: self.send(conn, line)  # noqa: E731
        rank = conn.rank
        if cmd == "init":
            send("cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1")
        elif cmd == "get_maxes":
            send(f"cmd=maxes rc=0 kvsname_max=256 keylen_max={_KEY_MAX} "
                 f"vallen_max={_VALUE_MAX}")
        elif cmd == "get_appnum":
            send("cmd=appnum rc=0 appnum=0")
        elif cmd == "get_my_kvsname":
            send(f"cmd=my_kvsname rc=0 kvsname={self.kvsname}")
        elif cmd == "get_universe_size":
            send(f"cmd=universe_size rc=0 size={self.size}")
        elif cmd == "put":
            key, value = t.get("key", ""), t.get("value", "")
            with self.cv:
                mine = self.keys_of.setdefault(rank, set())
                if (len(key) > _KEY_MAX or len(value) > _VALUE_MAX or
                        (key not in mine and
                         len(mine) >= protocol.MAX_KEYS_PER_RANK)):
                    raise protocol.BadConnection("a put beyond the bounds")
                if key in self.kvs and key not in mine:
                    # One rank's key is never another's to change.
                    send("cmd=put_result rc=1 msg=duplicate_key")
                    return
                mine.add(key)
                self.kvs[key] = value
            send("cmd=put_result rc=0")
        elif cmd == "get":
            # PMI_process_mapping: which ranks share a node, from the nodes
            # the hellos named (process_mapping). Without it (a hello
            # named none) MPICH groups the ranks by host name, which it
            # exchanges here.
            key = t.get("key", "")
            with self.cv:
                value = (self.mapping if key == PROCESS_MAPPING_KEY
                         else self.kvs.get(key))
            send("cmd=get_result rc=1 msg=key_not_found" if value is None
                 else f"cmd=get_result rc=0 value={value}")
        elif cmd == "barrier_in":
            with self.cv:
                if rank in self.barrier:
                    raise protocol.BadConnection("barrier_in twice")
                if self.dead:
                    self.fail_barrier(
                        f"the MPI of {protocol.rank_list(self.dead)} ended "
                        f"without finalizing")
                    return
                if not self.barrier:
                    # MPI_Init's barriers come within seconds of meeting;
                    # they have a deadline. MPI_Finalize's may wait for a
                    # rank's long last work: only a rank's end fails it.
                    now = time.monotonic()
                    self.barrier_since = (
                        now if now < self.formed_at + self.timeout else None)
                self.barrier[rank] = conn
                if len(self.barrier) == self.size:
                    for c in self.barrier.values():
                        self.send(c, "cmd=barrier_out rc=0")
                    self.barrier = {}
                    self.barrier_since = None
        elif cmd == "finalize":
            # The ack goes first: once every rank is done the server ends
            # and drops its connections. This thread reads this rank's
            # next bytes, so its close cannot count as a death before it.
            send("cmd=finalize_ack rc=0")
            with self.cv:
                self.pmi_done.add(rank)
                self.cv.notify_all()
        elif cmd == "kd_stay":  # a TCP job's rank (reform.py)
            self.on_stay(conn)
        elif cmd == "kd_reform":
            self.on_reform(conn, t)
        elif cmd == "kd_joiners":
            send(f"cmd=kd_joiners rc=0 count={self.joiners()}")
        elif cmd == "abort":
            sys.stderr.write(f"kerasdist rendezvous: rank {rank} aborted: "
                             f"{t.get('message', '')[:200]}\n")
        else:
            send(f"cmd={cmd[:32]} rc=-1 msg=unsupported")

    def fail_barrier(self, why):  # with self.cv held
        """Ends a PMI barrier that cannot complete: one line naming who is
        missing, and every waiting rank's MPI fails instead of waiting."""
        missing = protocol.first_missing(self.size, self.barrier)
        line = (f"kerasdist rendezvous: ranks {missing} of {self.size} did "
                f"not reach MPI's barrier ({why}); ending the job's MPI")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        self.tell_watchers(line.partition(": ")[2])
        for c in self.barrier.values():
            self.send(c, f"cmd=barrier_out rc=1 msg={line.replace(' ', '_')}")
            c.drop()
        self.barrier = {}
        self.barrier_since = None
        self.failed = True


def node_ids(nodes):
    """Each rank's node number from the node identities of the ranks, in
    rank order (node_identity()): 0 for rank 0's node, then 1, 2, ... in
    the order of each node's first rank."""
    number = {}
    return [number.setdefault(n, len(number)) for n in nodes]


def process_mapping(nodes):
    """PMI_process_mapping (MPICH's "(vector,(node,nodes,ranks),...)")
    for ranks whose node identities are `nodes`, in rank order: which ranks
    MPI takes to share memory. Consecutive ranks on one node are one
    block; blocks of consecutive nodes with as many ranks each are one
    triple: 2 hosts of 4 ranks each are "(vector,(0,2,4))". None (MPICH
    then groups by host name) where a rank named no node, or where the
    mapping would not fit in one PMI value (ranks spread over nodes in no
    order that triples say briefly)."""
    if not nodes or not all(nodes):
        return None
    runs = []  # [node, ranks], consecutive ranks
    for n in node_ids(nodes):
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    triples = []  # [first node, nodes, ranks each]
    for n, count in runs:
        last = triples[-1] if triples else None
        if last and last[2] == count and last[0] + last[1] == n:
            last[1] += 1
        else:
            triples.append([n, 1, count])
    text = "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in triples) \
        + ")"
    return text if len(text) < _VALUE_MAX else None

