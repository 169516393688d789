"""kd.init() over TCP (KERASDIST_TRANSPORT=tcp), the rank's side.

Where a platform or `kerasdist run --nnodes` started the ranks and they
met at the coordinator (client.join), the MPI transport hands MPI_Init the
PMI server's address. The TCP transport uses that server only to exchange
addresses: each rank opens two listeners (the data mesh's and the control
mesh's, ops/core/transport/tcp_context.h) on its address toward the
server, publishes them with PMI-1's `put`, meets the others at
`barrier_in` and reads theirs with `get`; `describe` returns the job's
description for the core (ops/core/transport/tcp_job.h), which forms both
meshes in kd.init(). Every connection of the meshes proves a key made from
the job's key (protocol.identity), so a process without the job's secret
cannot join them (where the job has a secret).

The PMI connection stays open until the core has formed the meshes
(`Exchange.done`): a rank whose process ends before then ends the others
with one line through the server, as MPI's start does. With recovery in
place it stays open for the job's life (`Exchange.stay`), and the
survivors of a lost rank re-form through it (`Exchange.reform`,
reform.py): the next generation's ranks and size, then `describe` again.

Standard library only (the package's note).
"""

import hashlib
import socket

if __package__:
    from kerasdist.rendezvous import protocol
else:  # beside server.py, run by path
    import protocol

TRANSPORT_ENV = "KERASDIST_TRANSPORT"
TRANSPORTS = ("mpi", "tcp")
_KEY_PREFIX = "kdtcp"


def wanted(environ):
    """Whether KERASDIST_TRANSPORT asks for TCP ("mpi", the default, or
    unset: no). Raises ValueError naming the variable where it is
    neither."""
    value = environ.get(TRANSPORT_ENV, "").strip().lower()
    if value not in ("",) + TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: the transports are "
                         f"{' and '.join(TRANSPORTS)} (the default: mpi)")
    return value == "tcp"


def mesh_key(key, generation):
    """The meshes' key (hex) for the job's `key` (bytes) at `generation`."""
    return hashlib.sha256(b"kerasdist tcp mesh|" + key + b"|" +
                          str(generation).encode()).hexdigest()


class Exchange:
    """One rank's PMI-1 connection to the rendezvous's server, proven by
    the PMI_ID its hello got."""

    def __init__(self, address, pmiid, timeout):
        host, _, port = address.rpartition(":")
        self.where = address
        self.ip = protocol.address_toward(host)  # where this rank listens
        self.sock = socket.create_connection((host, int(port)),
                                             timeout=timeout)
        self.sock.settimeout(timeout)
        self.sock.sendall(f"cmd=initack pmiid={pmiid}\n".encode())
        first = self._line()
        if protocol.tokens(first).get("rc") != "0":
            raise protocol.RendezvousError(
                f"the rendezvous at {address} refused this rank's PMI_ID")
        while not self._line().startswith("cmd=set debug="):
            pass

    @classmethod
    def over(cls, sock, address):
        """An Exchange over `sock`, already proven to the server at
        `address` (joining.rejoin)."""
        ex = cls.__new__(cls)
        ex.where, ex.sock = address, sock
        ex.ip = protocol.address_toward(address.rpartition(":")[0])
        return ex

    def _line(self):
        line = protocol.read_line(self.sock)
        if not line:
            raise protocol.RendezvousError(
                f"the rendezvous at {self.where} closed the connection")
        return line

    def command(self, line):
        self.sock.sendall((line + "\n").encode())
        return protocol.tokens(self._line())

    def put(self, key, value):
        if self.command(f"cmd=put kvsname=kd key={key} "
                        f"value={value}").get("rc") != "0":
            raise protocol.RendezvousError(f"the rendezvous refused {key}")

    def get(self, key):
        t = self.command(f"cmd=get kvsname=kd key={key}")
        if t.get("rc") != "0":
            raise protocol.RendezvousError(f"the rendezvous lacks {key}")
        return t.get("value", "")

    def barrier(self):
        t = self.command("cmd=barrier_in")
        if t.get("rc") != "0":
            raise protocol.RendezvousError(
                t.get("msg", "the rendezvous's barrier failed").replace(
                    "_", " "))

    def stay(self):
        """Keeps this connection for the job's life (reform.py): the
        server outlives rank 0 while it is open."""
        self.command("cmd=kd_stay")

    def joiners(self):
        """How many processes wait to join the job (reform.py)."""
        t = self.command("cmd=kd_joiners")
        return int(t.get("count", "0")) if t.get("rc") == "0" else 0

    def reform(self, generation, window, lost=(), grow=False):
        """Asks for `generation` among the ranks still here (reform.py),
        naming the ranks this rank's heartbeat found `lost`; with `grow`,
        the processes waiting to join come in after them. Returns this
        rank's (rank, size) in it."""
        self.sock.settimeout(window + 30.0)
        named = ",".join(str(int(r)) for r in lost) or "-"
        t = self.command(f"cmd=kd_reform generation={generation} "
                         f"window={window:g} lost={named}"
                         f"{' grow=1' if grow else ''}")
        if t.get("rc") != "0":
            raise protocol.RendezvousError(
                "the job re-formed without this rank: " +
                t.get("msg", "?").replace("_", " "))
        return int(t["rank"]), int(t["size"])

    def done(self):
        """The meshes formed: this rank is done with the server."""
        try:
            self.command("cmd=finalize")
        except (OSError, ValueError, protocol.RendezvousError):
            pass
        self.sock.close()


def _listener(ip):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((ip, 0))
    s.listen(128)
    return s


def describe(ex, rank, size, key, timeout, generation=0):
    """Opens this rank's listeners, exchanges addresses through the server
    (`ex`, an Exchange) and returns the core's description of the job.

    Raises:
        RendezvousError: the server refused or closed, or a rank did not
            reach the barrier.
        OSError: no listener could be opened, or the server went silent.
    """
    data, control = _listener(ex.ip), _listener(ex.ip)
    try:
        mine = (f"{ex.ip}:{data.getsockname()[1]}/"
                f"{ex.ip}:{control.getsockname()[1]}")
        ex.put(f"{_KEY_PREFIX}{generation}.{rank}", mine)
        ex.barrier()
        pairs = [ex.get(f"{_KEY_PREFIX}{generation}.{r}").split("/")
                 for r in range(size)]
    except BaseException:
        data.close()
        control.close()
        raise
    lines = {
        "rank": rank, "size": size, "generation": generation,
        "key": mesh_key(key, generation), "host": protocol.node_identity(),
        "data": ",".join(p[0] for p in pairs),
        "control": ",".join(p[-1] for p in pairs),
        "connect_timeout_s": max(1, int(timeout)),
        # The core closes them once the meshes formed.
        "data_fd": data.detach(), "control_fd": control.detach(),
    }
    return "\n".join(f"{k}={v}" for k, v in lines.items()) + "\n"


def designate_standby(ex, rank, size, generation, start):
    """After `describe`, in a job that re-forms: rank 0 names the lowest
    rank whose host is not the server's (none: every rank is on it), that
    rank starts a standby server (`start()`: its address, "-" where it
    could not) and every rank learns where it is (reform.py). Returns
    "host:port", or None where there is none."""
    def key(what):
        return protocol.STANDBY_KEY.format(generation=generation, what=what)
    if rank == 0:
        server = ex.sock.getpeername()[0]
        hosts = [ex.get(f"{_KEY_PREFIX}{generation}.{r}").partition(
            "/")[0].rpartition(":")[0] for r in range(size)]
        others = [r for r, h in enumerate(hosts) if h != server]
        ex.put(key("rank"), str(others[0] if others else -1))
    ex.barrier()
    chosen = int(ex.get(key("rank")))
    if chosen < 0:
        return None
    if rank == chosen:
        try:
            at = start()
        except (OSError, protocol.RendezvousError):
            at = "-"
        ex.put(key("at"), at)
    ex.barrier()
    at = ex.get(key("at"))
    return None if at == "-" else at
