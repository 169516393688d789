"""Forms one MPI job from processes that someone else started.

A platform (torchrun, Kubernetes, Keras' distribution variables) starts N
processes and tells each its rank, N and a coordinator's host:port
(kerasdist/run/conventions.py). MPI cannot join such processes by itself:
started without a launcher, each would be a job of one. What a launcher
gives MPICH is a PMI server; MPICH's client speaks the simple PMI-1 wire
protocol to it (one line per command) when it finds `PMI_PORT=host:port`
and `PMI_ID` in its environment at `MPI_Init`: it learns its rank and size,
publishes its address ("business card") with `put`, meets the others at
`barrier_in`, reads their cards with `get`, and at `MPI_Finalize` meets
them once more. The data itself then moves over MPI's own transports
(shared memory within a host, its network module across hosts); the PMI
server only relays those few small key-value pairs.

So rank 0 starts that server, here, as a small process of its own
(`python rendezvous.py serve ...`, standard library only, nothing else of
kerasdist imported): it listens on the coordinator's port, and serves until
every rank's MPI has finalized or gone (or, after rank 0 itself has gone,
for a short grace). Before MPI starts, every rank (rank 0 too) says hello
to it: the hello is a barrier with a deadline, so a coordinator that never
answers, a rank that never arrives, a duplicate rank or a size that
differs between ranks is one clear error instead of a hang in `MPI_Init`.
The others wait for the coordinator (retrying the connection) until that
same deadline, so it may start late.

A platform that restarts a failed job (a Kubernetes Job's pods, torchrun's
`--max-restarts`) may start the next run while the previous run's server
is still ending on the same port (it ends once that run's processes are
gone, or 30 s after its rank 0 went): rank 0 then waits for the port, and
a hello that reaches the old server (whose job formed already) is answered
as such and retried, both within the same deadline.

`join(launch, timeout)` does the client side and returns the variables to
put in the environment before `MPI_Init`.
"""

import errno
import os
import socket
import subprocess
import sys
import threading
import time

TIMEOUT_ENV = "KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 300.0
# After rank 0 has gone: how long the server still serves the other ranks'
# finalize (they are a barrier's reply away from it).
_GRACE_S = 30.0
_RETRY_S = 0.25
# The hello's reply code of a server whose job has formed (or failed) already:
# the hello came too late for it, and may be meant for the next one.
_FORMED = 2
# What a hello that got no answer returns (the server closed, or ended).
_NO_ANSWER = "cmd=kd_ready rc=-1"
# The variables MPICH's PMI-1 client reads at MPI_Init.
PMI_VARIABLES = ("PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE")

_server = None  # rank 0's server process, kept for this process's life


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message says who and what to do."""


def timeout_from(environ):
    """Seconds from KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS (default 300)."""
    text = environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a positive number "
                         f"of seconds; set it to e.g. 300.")
    return value


# --------------------------------------------------------------- client


def _resolve(host, deadline):
    """host's IPv4 address (MPICH's PMI_PORT takes host:port, no IPv6)."""
    while True:
        try:
            return socket.getaddrinfo(host, None, socket.AF_INET,
                                      socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as e:
            # A Kubernetes service's name may resolve only once its pod runs.
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"cannot resolve the coordinator's host {host!r}: {e}")
            time.sleep(_RETRY_S)


def _connect(address, deadline):
    last = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, last
        try:
            return socket.create_connection(address,
                                            timeout=min(left, 5.0)), None
        except OSError as e:
            last = e
        time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


def _start_server(port, size, timeout):
    """Starts rank 0's server on `port` (0: any free one); returns the port
    once it listens. A port in use is waited for, up to `timeout`: after a
    platform restarted the job, the server of its previous run may still
    be ending there."""
    global _server
    proc = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), "serve",
         str(port), str(size), repr(timeout)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        close_fds=True)
    line = proc.stdout.readline().strip()
    if line.startswith("waiting "):
        sys.stderr.write(
            f"kerasdist: rank 0: the coordinator's port {port} is in use; "
            f"waiting up to {timeout:g} s ({TIMEOUT_ENV}) for it to be free "
            f"(the server of an earlier run of this job ends once that "
            f"run's processes have)\n")
        sys.stderr.flush()
        line = proc.stdout.readline().strip()
    if not line.startswith("ready "):
        proc.wait()
        raise RendezvousError(
            f"rank 0 cannot serve the rendezvous on port {port}: "
            f"{line or 'its server ended'}")
    _server = proc  # its stdin stays open while this process lives
    return int(line.split()[1])


def _agent_store(host, port, timeout):
    """torchrun's own key-value store, which its agent serves on
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): there rank 0 cannot
    listen, so it serves on a free port and says which in that store.
    torch is there whenever torchrun is."""
    import datetime
    from torch.distributed import TCPStore
    return TCPStore(host, port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout))


def _address_toward(ip):
    """This host's address on the route to `ip`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def join(launch, timeout, environ=None):
    """Meets the other ranks at `launch.coordinator`.

    Rank 0 first starts the server there (under torchrun's agent store, on
    a free port it publishes in that store). Returns {name: value} for the
    environment of MPI_Init (PMI_PORT, PMI_ID, PMI_RANK, PMI_SIZE).

    Raises:
        RendezvousError: the coordinator did not answer, or the ranks did
            not all arrive, within `timeout` seconds; or they disagree.
    """
    environ = os.environ if environ is None else environ
    host, port = launch.coordinator
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    ip = _resolve(host, deadline)
    if (launch.convention == "torchrun" and
            environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        key = (f"kerasdist/pmi/{environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        try:
            store = _agent_store(ip, port, timeout)
            if launch.rank == 0:
                own = _start_server(0, launch.size, timeout)
                store.set(key, f"{_address_toward(ip)}:{own}")
            ip, _, served = store.get(key).decode().rpartition(":")
        except RendezvousError:
            raise
        except Exception as e:  # torch's store errors have no common base
            raise RendezvousError(
                f"rank {launch.rank} of {launch.size} could not read rank "
                f"0's address from torchrun's store at {where} within "
                f"{timeout:g} s ({TIMEOUT_ENV}): {e}") from None
        port, where = int(served), f"{ip}:{served}"
    elif launch.rank == 0:
        _start_server(port, launch.size, timeout)
    if launch.rank == 0:
        ip = "127.0.0.1"
    while True:
        reply = _hello((ip, port), where, launch, timeout, deadline)
        # A server whose job formed without this process, or one that
        # closes without an answer: the previous run of a job that a
        # platform restarted, still ending. Its successor listens once it
        # has gone.
        stale = reply.startswith(f"cmd=kd_ready rc={_FORMED} ")
        if not (stale or reply.startswith(_NO_ANSWER)):
            break
        if time.monotonic() >= deadline:
            what = ("still served a job that had formed without this "
                    "process" if stale else "did not answer the hello")
            raise RendezvousError(
                f"rank {launch.rank} of {launch.size}: the coordinator at "
                f"{where} {what} after {timeout:g} s ({TIMEOUT_ENV}): "
                f"{reply.partition(' msg=')[2]}")
        time.sleep(_RETRY_S)
    if reply != "cmd=kd_ready rc=0":
        msg = reply.partition(" msg=")[2]
        raise RendezvousError(f"rank {launch.rank} of {launch.size}: {msg}")
    return {"PMI_PORT": f"{ip}:{port}", "PMI_ID": str(launch.rank),
            "PMI_RANK": str(launch.rank), "PMI_SIZE": str(launch.size)}


def _hello(address, where, launch, timeout, deadline):
    """Connects (retrying until `deadline`) and says hello; returns the
    server's reply line."""
    sock, error = _connect(address, deadline)
    if sock is None:
        raise RendezvousError(
            f"rank {launch.rank} of {launch.size} found no coordinator at "
            f"{where} within {timeout:g} s ({TIMEOUT_ENV}; last error: "
            f"{error}); check that rank 0 runs, that this host reaches "
            f"{where}, and that every process has the same coordinator.")
    try:
        sock.settimeout(max(1.0, deadline - time.monotonic()) + 10.0)
        sock.sendall(f"cmd=kd_hello rank={launch.rank} size={launch.size}\n"
                     .encode())
        reply = sock.makefile("r").readline().strip()
        return reply or (f"{_NO_ANSWER} msg=the coordinator at {where} "
                         f"closed the connection")
    except OSError as e:
        return (f"{_NO_ANSWER} msg=the coordinator at {where} stopped "
                f"answering ({e})")
    finally:
        sock.close()


# --------------------------------------------------------------- server


def _tokens(line):
    """{key: raw value} of one PMI-1 line ("cmd=put key=k value=v")."""
    out, cur, i = {}, [], 0
    parts = []
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):  # escaped (a space, a \)
            cur.append(line[i:i + 2])
            i += 2
            continue
        if c == " ":
            if cur:
                parts.append("".join(cur))
                cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        parts.append("".join(cur))
    for p in parts:
        key, _, value = p.partition("=")
        out[key] = value
    return out


class _Server:
    def __init__(self, size, timeout):
        self.size = size
        self.timeout = timeout
        self.kvsname = f"kerasdist_{os.getpid()}_{int(time.time())}"
        self.cv = threading.Condition()
        self.hello = {}        # rank -> socket, until all have come
        self.hello_done = False
        self.kvs = {}
        self.barrier = []      # sockets waiting in barrier_in
        self.pmi_open = 0      # PMI connections open now
        self.pmi_seen = 0      # PMI connections ever
        self.conns = set()
        self.parent_gone_at = None
        self.started = time.monotonic()
        self.formed_at = None  # when every rank had said hello
        self.failed = False

    # The hello: a barrier of all ranks with a deadline.
    def on_hello(self, conn, t):
        try:
            rank, size = int(t.get("rank")), int(t.get("size"))
        except (TypeError, ValueError):
            return self._send(conn, "cmd=kd_ready rc=1 msg=malformed hello")
        with self.cv:
            if self.hello_done:
                return self._send(
                    conn, f"cmd=kd_ready rc={_FORMED} msg=its job of "
                    f"{self.size} formed (or failed) without this rank "
                    f"{rank}; if no earlier run of the job is still ending, "
                    f"give each process its own rank in 0..{self.size - 1}")
            if size != self.size:
                return self._send(
                    conn, f"cmd=kd_ready rc=1 msg=this process says the job "
                    f"has {size} processes but rank 0 says {self.size}; give "
                    f"every process the same size")
            if not 0 <= rank < self.size or rank in self.hello:
                return self._send(
                    conn, f"cmd=kd_ready rc=1 msg=rank {rank} came twice; "
                    f"give each process its own rank in 0..{self.size - 1}")
            self.hello[rank] = conn
            if len(self.hello) == self.size:
                self.hello_done = True
                self.formed_at = time.monotonic()
                for c in self.hello.values():
                    self._send(c, "cmd=kd_ready rc=0")
                self.hello = {}

    def fail_hello(self):  # with self.cv held
        # The first 16 missing ranks: nothing the size of the job is built
        # (a size of 10**9 would take gigabytes).
        missing = []
        for r in range(self.size):
            if r not in self.hello:
                missing.append(r)
                if len(missing) > 16:
                    break
        shown = ", ".join(map(str, missing[:16])) + (
            ", ..." if len(missing) > 16 else "")
        for c in self.hello.values():
            self._send(c, f"cmd=kd_ready rc=1 msg=ranks {shown} of "
                       f"{self.size} did not reach the coordinator within "
                       f"{self.timeout:g} s ({TIMEOUT_ENV}); check that "
                       f"every process was started and has the same "
                       f"coordinator")
        self.hello_done = True
        self.failed = True

    def _send(self, conn, line):
        try:
            conn.sendall((line + "\n").encode())
        except OSError:
            pass

    # PMI-1, the commands MPICH's client sends.
    def on_pmi(self, conn, cmd, t):
        send = lambda line: self._send(conn, line)  # noqa: E731
        if cmd == "initack":  # PMI_ID: rank and size through the socket
            rank = int(t.get("pmiid", "-1"))
            send(f"cmd=initack rc=0\ncmd=set size={self.size}\n"
                 f"cmd=set rank={rank}\ncmd=set debug=0")
        elif cmd == "init":
            send("cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1")
        elif cmd == "get_maxes":
            send("cmd=maxes rc=0 kvsname_max=256 keylen_max=64 "
                 "vallen_max=1024")
        elif cmd == "get_appnum":
            send("cmd=appnum rc=0 appnum=0")
        elif cmd == "get_my_kvsname":
            send(f"cmd=my_kvsname rc=0 kvsname={self.kvsname}")
        elif cmd == "get_universe_size":
            send(f"cmd=universe_size rc=0 size={self.size}")
        elif cmd == "put":
            with self.cv:
                self.kvs[t.get("key", "")] = t.get("value", "")
            send("cmd=put_result rc=0")
        elif cmd == "get":
            # No PMI_process_mapping: MPICH then learns which ranks share a
            # host from their host names, which it exchanges here.
            with self.cv:
                value = self.kvs.get(t.get("key", ""))
            send("cmd=get_result rc=1 msg=key_not_found" if value is None
                 else f"cmd=get_result rc=0 value={value}")
        elif cmd == "barrier_in":
            with self.cv:
                self.barrier.append(conn)
                if len(self.barrier) == self.size:
                    for c in self.barrier:
                        self._send(c, "cmd=barrier_out rc=0")
                    self.barrier = []
        elif cmd == "finalize":
            send("cmd=finalize_ack rc=0")
        elif cmd == "abort":
            sys.stderr.write(f"kerasdist rendezvous: a rank aborted: "
                             f"{t.get('message', '')}\n")
        else:
            send(f"cmd={cmd} rc=-1 msg=unsupported")

    def serve(self, conn):
        is_pmi = False
        try:
            for raw in conn.makefile("rb"):
                line = raw.decode(errors="replace").rstrip("\n")
                t = _tokens(line)
                cmd = t.get("cmd")
                if cmd == "kd_hello":
                    self.on_hello(conn, t)
                    continue
                if not is_pmi:
                    is_pmi = True
                    with self.cv:
                        self.pmi_open += 1
                        self.pmi_seen += 1
                self.on_pmi(conn, cmd, t)
        except OSError:
            pass
        finally:
            with self.cv:
                if is_pmi:
                    self.pmi_open -= 1
                    if conn in self.barrier:
                        self.barrier.remove(conn)
                    if self.barrier:
                        # A rank left while others wait for it: let them
                        # fail now rather than wait forever.
                        for c in self.barrier:
                            c.close()
                        self.barrier = []
                self.conns.discard(conn)
                self.cv.notify_all()
            conn.close()

    def finished(self):
        with self.cv:
            if self.failed:
                return True
            if self.pmi_seen >= self.size and self.pmi_open == 0:
                return True  # every rank's MPI has finalized or gone
            return (self.parent_gone_at is not None and
                    (self.pmi_open == 0 or
                     time.monotonic() - self.parent_gone_at > _GRACE_S))

    def check_deadlines(self, now):
        with self.cv:
            if not self.hello_done and now > self.started + self.timeout:
                self.fail_hello()
            elif (self.formed_at is not None and self.pmi_seen < self.size
                  and now > self.formed_at + self.timeout):
                # A rank met the others but its MPI never came: the others
                # would wait in MPI_Init forever. Closing makes it fail.
                sys.stderr.write(
                    f"kerasdist rendezvous: only {self.pmi_seen} of "
                    f"{self.size} ranks started MPI within {self.timeout:g} "
                    f"s of meeting; ending the job's MPI start\n")
                self.failed = True


def _watch_parent(server):
    sys.stdin.read()  # EOF: rank 0 has gone
    with server.cv:
        server.parent_gone_at = time.monotonic()
        server.cv.notify_all()


def _listen(port, size, timeout):
    """The listening socket on `port`; while the port is in use (the server
    of an earlier run still ending), says "waiting" once and retries until
    `timeout`."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("", port))
            listener.listen(min(max(size, 16), 4096))
            return listener
        except OSError as e:
            listener.close()
            if (e.errno != errno.EADDRINUSE or port == 0 or
                    time.monotonic() >= deadline):
                raise
        if not said:
            print(f"waiting {port}", flush=True)
            said = True
        time.sleep(_RETRY_S)


def _serve(port, size, timeout):
    try:
        listener = _listen(port, size, timeout)
    except OSError as e:
        print(f"{e.strerror or e} (the coordinator's port must be free on "
              f"rank 0's host)", flush=True)
        return 1
    server = _Server(size, timeout)
    threading.Thread(target=_watch_parent, args=(server,),
                     daemon=True).start()

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with server.cv:
                server.conns.add(conn)
            threading.Thread(target=server.serve, args=(conn,),
                             daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(f"ready {listener.getsockname()[1]}", flush=True)
    while not server.finished():
        server.check_deadlines(time.monotonic())
        with server.cv:
            server.cv.wait(0.5)
    with server.cv:
        for c in list(server.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        sys.exit(_serve(int(sys.argv[2]), int(sys.argv[3]),
                        float(sys.argv[4])))
    sys.exit("usage: rendezvous.py serve PORT SIZE TIMEOUT_SECONDS")
