"""A process that joins a running TCP job (growing in place over TCP;
docs/failures-and-elastic.md, "Growing onto other hosts over TCP").

The job runs over the TCP transport with recovery in place
(KERASDIST_TRANSPORT=tcp, KERASDIST_RECOVER_IN_PLACE=1), so its
rendezvous server lives as long as the job. A process started with
KERASDIST_JOIN=1 and the job's coordinator (MASTER_ADDR, MASTER_PORT) and
secret proves the secret to that server as a hello does, says `kd_join`,
and waits: rank 0 learns at its next commit that a process waits, the
ranks agree to let it in and re-form with it (rendezvous/reform.py); the
server then tells this process its rank, the job's size and generation,
and the one-time PMI_ID its PMI connection proves itself with
(tcp_job.Exchange). Its kd.init() then forms the new generation's meshes
with the others, and `hvd.elastic.run` takes the job's state from rank 0.

Standard library only.
"""

import hmac
import time

from kerasdist.rendezvous import client
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import tcp_job

JOIN_ENV = "KERASDIST_JOIN"


def wanted(environ):
    """Whether this process joins a running job (KERASDIST_JOIN=1)."""
    return environ.get(JOIN_ENV, "").strip() == "1"


def join_running(coordinator, timeout, environ):
    """Waits, up to `timeout` seconds, to be let into the job whose
    rendezvous runs at `coordinator` (host, port). Returns {name: value}:
    PMI_PORT and PMI_ID for this process's PMI connection, and its rank,
    the job's size and generation ("rank", "size", "generation").

    Raises:
        RendezvousError: no server there, another job's, or the job ended
            or did not let this process in within `timeout`.
    """
    try:
        job, key, proven = protocol.identity(environ)
    except ValueError as e:
        raise protocol.RendezvousError(str(e)) from None
    host, port = coordinator
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    ip = client.resolve(host, deadline)
    sock, error = client.connect((ip, port), deadline)
    if sock is None:
        raise protocol.RendezvousError(
            f"this process ({JOIN_ENV}=1) found no running job at {where} "
            f"within {timeout:g} s ({protocol.TIMEOUT_ENV}; last error: "
            f"{error}); check that the job runs there")
    try:
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            nonce, theirs = client.auth(sock, where, job, key, proven)
        except (OSError, ValueError) as e:
            raise protocol.RendezvousError(
                f"the coordinator at {where} stopped answering this "
                f"process ({JOIN_ENV}=1): {e}") from None
        if theirs is None:
            raise protocol.RendezvousError(
                f"this process ({JOIN_ENV}=1) cannot join the job at "
                f"{where}: {nonce.partition(' msg=')[2]}")
        node = protocol.node_identity()
        proof = protocol.mac_of(key, "join", theirs, nonce, node)
        sock.sendall(f"cmd=kd_join node={node} proof={proof}\n".encode())
        try:
            reply = protocol.read_line(sock)
        except TimeoutError:
            raise protocol.RendezvousError(
                f"the job at {where} did not let this process "
                f"({JOIN_ENV}=1) in within {timeout:g} s "
                f"({protocol.TIMEOUT_ENV}): it lets waiting processes in "
                f"at a commit (`kerasdist.elastic.run`, the Trainer's "
                f"first training call)") from None
        except (OSError, ValueError):
            reply = ""
        body, _, mac = reply.rpartition(" mac=")
        if not reply or not hmac.compare_digest(
                mac, protocol.mac_of(key, "ready", nonce, theirs, body)):
            raise protocol.RendezvousError(
                f"the job at {where} ended (or closed the connection) "
                f"before it let this process ({JOIN_ENV}=1) in")
        t = protocol.tokens(body)
        if t.get("rc") != "0":
            raise protocol.RendezvousError(
                f"the job at {where} refused this process ({JOIN_ENV}=1): "
                f"{body.partition(' msg=')[2]}")
        return {"PMI_PORT": f"{ip}:{port}", "PMI_ID": t.get("pmiid", ""),
                "rank": int(t["rank"]), "size": int(t["size"]),
                "generation": int(t["generation"])}
    finally:
        sock.close()


def rejoin(address, rank, generation, timeout, environ):
    """A rank of a TCP job whose server has gone proves its `rank` and
    `generation` to the job's standby at `address` ("host:port",
    rendezvous/reform.py); returns the tcp_job.Exchange over that
    connection.

    Raises:
        RendezvousError: the standby did not answer, or refused.
    """
    job, key, proven = protocol.identity(environ)
    host, _, port = address.rpartition(":")
    sock, error = client.connect((host, int(port)),
                                 time.monotonic() + timeout)
    if sock is None:
        raise protocol.RendezvousError(
            f"the job's standby rendezvous at {address} did not answer "
            f"either ({error})")
    try:
        sock.settimeout(timeout)
        nonce, theirs = client.auth(sock, address, job, key, proven)
        if theirs is None:
            raise protocol.RendezvousError(
                f"the job's standby at {address}: "
                f"{nonce.partition(' msg=')[2]}")
        proof = protocol.mac_of(key, "rejoin", theirs, nonce, rank,
                                generation)
        sock.sendall(f"cmd=kd_rejoin rank={rank} generation={generation} "
                     f"proof={proof}\n".encode())
        reply = protocol.read_line(sock)
        body, _, mac = reply.rpartition(" mac=")
        if not reply or not hmac.compare_digest(
                mac, protocol.mac_of(key, "ready", nonce, theirs, body)):
            raise protocol.RendezvousError(
                f"the job's standby at {address} closed the connection")
        if protocol.tokens(body).get("rc") != "0":
            raise protocol.RendezvousError(
                f"the job's standby at {address} refused this rank: "
                f"{body.partition(' msg=')[2]}")
    except (OSError, ValueError) as e:
        sock.close()
        raise protocol.RendezvousError(
            f"the job's standby at {address} stopped answering ({e})"
        ) from None
    except BaseException:
        sock.close()
        raise
    return tcp_job.Exchange.over(sock, address)
