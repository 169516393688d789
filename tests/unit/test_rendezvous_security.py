"""The rendezvous server (kerasdist/rendezvous/server.py) against foreign and
hostile clients: real server processes and real sockets on loopback; the
ranks are join() itself (the hello) and a PMI-1 client that speaks as
MPICH's does. No MPI: each test takes a second or a few.
"""

import os
import random
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from kerasdist.rendezvous import client
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import server as rdv_server
from kerasdist.rendezvous.conventions import Launch
from kerasdist.rendezvous.pmi import node_ids
from kerasdist.rendezvous.pmi import process_mapping
from tests.support.helpers import launcher_env
from tests.support.hostile import foreigner as _foreigner

SECRET = "an-honest-jobs-secret-0123456789"


def _serve(size, timeout, job="unnamed", secret="", port=0, limit=None):
    """rank 0's server as join() starts it; returns (process, port)."""
    env = {protocol.JOB_ID_ENV: job}
    if secret:
        env[protocol.SECRET_ENV] = secret
    job, key, proven = protocol.identity(env)
    preexec = None
    if limit:
        def preexec():
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    proc = subprocess.Popen(
        [sys.executable, "-I", rdv_server.__file__, "serve", str(port),
         str(size), str(timeout)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, _KERASDIST_RENDEZVOUS_KEY=key.hex(),
                 _KERASDIST_RENDEZVOUS_JOB=job,
                 _KERASDIST_RENDEZVOUS_SECRET=str(int(proven))),
        preexec_fn=preexec)
    line = proc.stdout.readline().split()
    assert line[0] == "ready", line
    return proc, int(line[1])


def _end(proc):
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stderr.read()


def _join_all(port, size, env, timeout=20):
    """join() of every rank on threads; returns {rank: variables or the
    error}."""
    out = {}

    def one(rank):
        launch = Launch("torchrun", rank, size, rank, size,
                        ("127.0.0.1", port))
        try:
            # watch=False: a watching join ends its process on the
            # server's failure report (tested in a process of its own).
            out[rank] = client.join(launch, timeout,
                                        environ=dict(env), watch=False)
        except protocol.RendezvousError as e:
            out[rank] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in range(1,
                                                                      size)]
    # Rank 0's server is the test's: rank 0 says hello like the others.
    threads.append(threading.Thread(target=lambda: out.update(
        {0: _hello0(port, size, env, timeout)})))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


def _hello0(port, size, env, timeout):
    job, key, _ = protocol.identity(env)
    launch = Launch("torchrun", 0, size, 0, size, ("127.0.0.1", port))
    deadline = time.monotonic() + timeout
    reply = client._hello(("127.0.0.1", port), "here", launch, timeout,
                              deadline, job, key)
    assert reply.startswith("cmd=kd_ready rc=0 "), reply
    return {"PMI_PORT": f"127.0.0.1:{port}",
            "PMI_ID": protocol.tokens(reply)["pmiid"]}


class Pmi:
    """MPICH's PMI-1 client, as it speaks: initack with PMI_ID, then one
    line per command."""

    def __init__(self, variables):
        host, port = variables["PMI_PORT"].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=20)
        self.file = self.sock.makefile("r")
        self.send(f"cmd=initack pmiid={variables['PMI_ID']}")
        assert self.read() == "cmd=initack rc=0"
        self.size = int(self.read().split("=")[-1])
        self.rank = int(self.read().split("=")[-1])
        self.read()  # debug

    def send(self, line):
        self.sock.sendall((line + "\n").encode())

    def read(self):
        return self.file.readline().strip()

    def ask(self, line):
        self.send(line)
        return self.read()

    def close(self):
        self.file.close()
        self.sock.close()


def _mpi_init_and_finalize(variables, results):
    """What MPI_Init and MPI_Finalize ask: put a card, barrier, get all."""
    p = Pmi(variables)
    assert p.ask(f"cmd=put kvsname=k key=card[{p.rank}] value=r{p.rank}") \
        == "cmd=put_result rc=0"
    assert p.ask("cmd=barrier_in") == "cmd=barrier_out rc=0"
    cards = [p.ask(f"cmd=get kvsname=k key=card[{r}]") for r in
             range(p.size)]
    assert p.ask("cmd=barrier_in") == "cmd=barrier_out rc=0"
    assert p.ask("cmd=finalize") == "cmd=finalize_ack rc=0"
    p.close()
    results[p.rank] = cards


def _form_and_run(port, size, env):
    joined = _join_all(port, size, env)
    for r in range(size):
        assert isinstance(joined[r], dict), joined[r]
    results = {}
    threads = [threading.Thread(target=_mpi_init_and_finalize,
                                args=(joined[r], results))
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    want = [f"cmd=get_result rc=0 value=r{r}" for r in range(size)]
    assert results == {r: want for r in range(size)}, results


# ---- foreign clients --------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", ["", SECRET])
def test_a_foreign_client_changes_nothing(secret):
    env = {protocol.JOB_ID_ENV: "job1"}
    if secret:
        env[protocol.SECRET_ENV] = secret
    proc, port = _serve(2, 20, "job1", secret)
    stop, sent = threading.Event(), []
    foreigner = threading.Thread(target=_foreigner,
                                 args=(port, stop, sent))
    foreigner.start()
    try:
        time.sleep(0.3)
        _form_and_run(port, 2, env)
        assert proc.wait(timeout=10) == 0
    finally:
        stop.set()
        foreigner.join(10)
        _end(proc)
    assert len(sent) > 10


@pytest.mark.timeout(60)
def test_a_wrong_secret_proves_nothing():
    proc, port = _serve(2, 20, "job1", SECRET)
    try:
        launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", port))
        with pytest.raises(protocol.RendezvousError) as e:
            client.join(launch, 20, environ={
                protocol.JOB_ID_ENV: "job1",
                protocol.SECRET_ENV: "another-secret-of-32-characters!"})
        assert f"port {port} serves another job (job job1 with another " \
            f"secret (KERASDIST_JOB_SECRET differs))" in str(e.value)
        # A hello whose proof is wrong is dropped, unanswered.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"cmd=kd_auth job=job1 nonce=x\n")
            assert protocol.read_line(s).startswith(
                "cmd=kd_challenge rc=0 job=job1 ")
            s.sendall(b"cmd=kd_hello rank=1 size=2 proof=" + b"0" * 64 +
                      b"\n")
            assert s.recv(100) == b""
        _form_and_run(port, 2, {protocol.JOB_ID_ENV: "job1",
                                protocol.SECRET_ENV: SECRET})
    finally:
        _end(proc)


@pytest.mark.timeout(60)
def test_unproven_connections_are_capped_and_accept_survives_emfile():
    # 40 descriptors: the idle connections exhaust them (accept fails with
    # EMFILE); the server sheds the oldest unproven ones and the ranks
    # still meet.
    proc, port = _serve(2, 20, limit=40)
    idle = []
    try:
        for _ in range(100):
            idle.append(socket.create_connection(("127.0.0.1", port),
                                                 timeout=5))
        time.sleep(0.5)
        _form_and_run(port, 2, {})
        idle[0].settimeout(5)
        assert idle[0].recv(10) == b""  # shed
    finally:
        for s in idle:
            s.close()
        _end(proc)


@pytest.mark.timeout(60)
def test_an_unproven_connection_is_dropped_at_its_deadline(monkeypatch):
    proc, port = _serve(1, 30)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        start = time.monotonic()
        s.sendall(b"cmd=kd_au")  # and then nothing, ever
        assert s.recv(10) == b""
        took = time.monotonic() - start
    finally:
        _end(proc)
    assert protocol.AUTH_DEADLINE_S - 1 < took < \
        protocol.AUTH_DEADLINE_S + 3, took


# ---- two jobs on one port ---------------------------------------------------

@pytest.mark.timeout(60)
def test_two_jobs_on_one_port_are_refused_naming_both():
    proc, port = _serve(2, 20, "jobA")
    try:
        launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", port))
        start = time.monotonic()
        with pytest.raises(protocol.RendezvousError) as e:
            client.join(launch, 20,
                            environ={protocol.JOB_ID_ENV: "jobB"})
        assert time.monotonic() - start < 5
        assert str(e.value) == (
            f"rank 1 of 2: the coordinator's port {port} serves another job "
            f"(job jobA), not this one (jobB); give each job its own port "
            f"(e.g. MASTER_PORT), or a name (KERASDIST_JOB_ID) and secret "
            f"(KERASDIST_JOB_SECRET) of its own")
        # Rank 0 of the second job: the port is busy with job A's server.
        launch = Launch("torchrun", 0, 2, 0, 2, ("127.0.0.1", port))
        start = time.monotonic()
        with pytest.raises(protocol.RendezvousError) as e:
            client.join(launch, 20,
                            environ={protocol.JOB_ID_ENV: "jobB"})
        assert time.monotonic() - start < 5
        assert f"port {port} serves another job (job jobA), not this one " \
            f"(jobB)" in str(e.value)
        # Job A is untouched by either.
        _form_and_run(port, 2, {protocol.JOB_ID_ENV: "jobA"})
    finally:
        _end(proc)


def _conflict(port, job, key, proof=None):
    """A second rank 0's kd_conflict (client._probe), with `proof` in
    place of the right one where given; returns the state the server
    said it was in."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        nonce = "n" * 32
        sock.sendall(f"cmd=kd_auth job={job} nonce={nonce}\n".encode())
        t = protocol.tokens(protocol.read_line(sock))
        proof = proof or protocol.mac_of(key, "conflict", t["nonce"], nonce)
        sock.sendall(f"cmd=kd_conflict proof={proof}\n".encode())
        sock.settimeout(2)
        try:
            sock.recv(1)
        except OSError:
            pass
    return t.get("state")


@pytest.mark.timeout(60)
def test_a_second_launch_ends_a_forming_job_only_with_the_key():
    # With a secret, a kd_conflict without the key's proof changes
    # nothing: the job forms. Without one (the key is the id's), a second
    # rank 0 of the same id ends it, and every rank that comes later hears
    # the same line.
    env = {protocol.SECRET_ENV: SECRET}
    job, key, _ = protocol.identity(env)
    proc, port = _serve(2, 20, job, secret=SECRET)
    try:
        assert _conflict(port, job, key, proof="0" * 64) == "live"
        _form_and_run(port, 2, env)
    finally:
        _end(proc)
    job, key, _ = protocol.identity({})
    proc, port = _serve(2, 20, job)
    try:
        assert _conflict(port, job, key) == "live"
        assert _conflict(port, job, key) == "refused"
        launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", port))
        with pytest.raises(protocol.RendezvousError) as e:
            client.join(launch, 20, environ={}, watch=False)
        assert str(e.value).startswith(
            f"rank 1 of 2: a second rank 0 found this job's server at the "
            f"coordinator's port {port}: two launches of job unnamed met "
            f"there"), e.value
    finally:
        proc.kill()  # refused, it answers hellos for a while yet
        _end(proc)


@pytest.mark.timeout(60)
def test_a_held_rank_claimed_again_ends_the_forming_job():
    proc, port = _serve(3, 20)
    try:
        first = {}
        job, key, _ = protocol.identity({})

        def hello(rank):
            launch = Launch("torchrun", rank, 3, rank, 3,
                            ("127.0.0.1", port))
            return client._hello(("127.0.0.1", port), "here", launch, 20,
                                 time.monotonic() + 20, job, key)
        t = threading.Thread(target=lambda: first.update(
            _on_threads(hello, [0, 1])))
        t.start()
        time.sleep(1.0)  # ranks 0 and 1 wait for rank 2
        launch = Launch("torchrun", 1, 3, 1, 3, ("127.0.0.1", port))
        with pytest.raises(protocol.RendezvousError) as e:
            client.join(launch, 20, environ={}, watch=False)
        t.join(30)
        want = (f"two processes claimed rank 1 of 3 at the coordinator's "
                f"port {port}: two launches of job unnamed met there")
        assert want in str(e.value)
        assert set(first) == {0, 1}, first
        for r in (0, 1):
            assert want in str(first[r]), first[r]
    finally:
        proc.kill()
        _end(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("named", [False, True])
def test_a_rank_without_the_secret_is_refused_naming_it(named):
    # A server whose job has a secret refuses a rank without one (and the
    # other way round) with a line that says so, named jobs or not.
    ids = {protocol.JOB_ID_ENV: "jobS"} if named else {}
    for server_secret, rank_env, want in [
            (SECRET, dict(ids), "which requires the job's secret "
             "(KERASDIST_JOB_SECRET), and this process has none; give "
             "every process of the job the same KERASDIST_JOB_SECRET"),
            ("", dict(ids, KERASDIST_JOB_SECRET=SECRET), "which has no "
             "secret, and this process has one (KERASDIST_JOB_SECRET)")]:
        proc, port = _serve(2, 20, "jobS" if named else "unnamed",
                            secret=server_secret)
        if not named and server_secret:
            proc.kill()  # its name must be the secret's fingerprint
            _end(proc)
            env = {protocol.SECRET_ENV: SECRET}
            proc, port = _serve(2, 20, protocol.identity(env)[0],
                                secret=SECRET)
        try:
            launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", port))
            start = time.monotonic()
            with pytest.raises(protocol.RendezvousError) as e:
                client.join(launch, 20, environ=rank_env)
            assert time.monotonic() - start < 5
            assert str(e.value).startswith(
                f"rank 1 of 2: the coordinator's port {port} serves job ")
            assert want in str(e.value), str(e.value)
        finally:
            _end(proc)


def test_job_identity():
    assert protocol.identity({})[0] == "unnamed"
    assert protocol.identity({"TORCHELASTIC_RUN_ID": "r 1"})[0] == "r_1"
    job, key, proven = protocol.identity(
        {protocol.SECRET_ENV: SECRET})
    assert job.startswith("s-") and proven and SECRET not in job
    assert key != protocol.identity({protocol.SECRET_ENV: SECRET + "x"})[1]
    with pytest.raises(ValueError, match="KERASDIST_JOB_SECRET has 5 "
                       "characters, fewer than 16"):
        protocol.identity({protocol.SECRET_ENV: "short"})
    # Ids that many jobs share by default count as none.
    for shared in ("none", "None", " "):
        assert protocol.identity({"TORCHELASTIC_RUN_ID": shared})[0] == \
            "unnamed"


# ---- one secret rule, from the environment or a mounted file -----------------

BAD_SECRETS = [("abc", "has 3 characters, fewer than 16"),
               (" " * 16, "is blank"),
               ("\t \n" * 8, "is blank"),
               (" " * 10 + "x" * 15, "has 15 characters, fewer than 16"),
               (b"\xff\xfe-not-utf-8-at-all-0123".decode(
                   "utf-8", "surrogateescape"), "is not valid UTF-8")]


@pytest.mark.parametrize("secret,why", BAD_SECRETS)
def test_one_secret_rule_for_kd_init(secret, why):
    with pytest.raises(ValueError, match=f"KERASDIST_JOB_SECRET {why}"):
        protocol.identity({protocol.SECRET_ENV: secret})
    launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", 9))
    with pytest.raises(protocol.RendezvousError,
                       match=f"KERASDIST_JOB_SECRET {why}"):
        client.join(launch, 1, environ={protocol.SECRET_ENV: secret})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret,why", BAD_SECRETS)
def test_one_secret_rule_for_kerasdist_run(secret, why):
    # The launcher refuses what kd.init() refuses, before it starts
    # anything (it would hand the secret to every rank).
    env = {k.encode(): v.encode() for k, v in launcher_env().items()
           if k != protocol.SECRET_ENV}
    env[protocol.SECRET_ENV.encode()] = secret.encode(
        "utf-8", "surrogateescape")
    out = subprocess.run(
        [sys.executable, "-m", "kerasdist.run", "-np", "1", "true"],
        env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 2, out
    assert out.stderr.startswith(
        f"kerasdist run: error: KERASDIST_JOB_SECRET {why}"), out.stderr


def test_the_secret_from_a_mounted_file(tmp_path):
    # Kubernetes: a Secret mounted in every pod, named by
    # KERASDIST_JOB_SECRET_FILE; one trailing newline is not part of it.
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    env = {protocol.SECRET_FILE_ENV: str(path)}
    assert protocol.identity(env) == protocol.identity(
        {protocol.SECRET_ENV: SECRET})
    # The variable wins over the file.
    other = "another-secret-of-32-characters!"
    assert protocol.identity(dict(env, **{protocol.SECRET_ENV: other})) == \
        protocol.identity({protocol.SECRET_ENV: other})
    path.write_text(" " * 20)
    with pytest.raises(ValueError, match="KERASDIST_JOB_SECRET is blank"
                       ".*read from KERASDIST_JOB_SECRET_FILE="):
        protocol.identity(env)
    with pytest.raises(ValueError, match="KERASDIST_JOB_SECRET_FILE=.* "
                       "cannot be read"):
        protocol.identity({protocol.SECRET_FILE_ENV: str(tmp_path / "no")})
    path.write_text("x" * 5000)
    with pytest.raises(ValueError, match="holds more than 4096 bytes"):
        protocol.identity(env)


@pytest.mark.timeout(60)
def test_a_job_with_its_secret_in_a_file_forms_and_exports_it(tmp_path):
    # kd.init() gives the core (its heartbeat) the secret it read.
    path = tmp_path / "secret"
    path.write_text(SECRET)
    env = {protocol.SECRET_FILE_ENV: str(path)}
    proc, port = _serve(2, 20, protocol.identity(env)[0], secret=SECRET)
    try:
        rank1_env, out = dict(env), {}
        launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", port))
        t = threading.Thread(target=lambda: out.update(
            {1: client.join(launch, 20, environ=rank1_env, watch=False)}))
        t.start()
        out[0] = _hello0(port, 2, env, 20)
        t.join(30)
        assert out[1].get("PMI_ID"), out
        assert rank1_env[protocol.SECRET_ENV] == SECRET
    finally:
        _end(proc)


# ---- a rank lost inside MPI_Init, a barrier that never completes ------------

@pytest.mark.timeout(60)
def test_a_rank_lost_inside_mpi_init_fails_the_barrier_at_once():
    proc, port = _serve(3, 30)
    try:
        joined = _join_all(port, 3, {})
        waiting = [Pmi(joined[r]) for r in (0, 1)]
        lost = Pmi(joined[2])
        for p in waiting:
            p.send("cmd=barrier_in")
        time.sleep(0.3)
        start = time.monotonic()
        lost.sock.close()  # rank 2 dies before its barrier
        lost.file.close()
        for p in waiting:
            reply = p.read()
            assert reply.startswith("cmd=barrier_out rc=1"), reply
            assert p.read() == ""  # and the connection ends
        assert time.monotonic() - start < 3
        assert proc.wait(timeout=10) == 0
    finally:
        err = _end(proc)
    assert ("ranks 2 of 3 did not reach MPI's barrier (the MPI of rank 2 "
            "ended without finalizing)") in err, err


_WATCHING_RANK = """
import json, sys, time
from kerasdist.rendezvous import client
from kerasdist.rendezvous.conventions import Launch
launch = Launch("torchrun", 1, 3, 1, 3, ("127.0.0.1", int(sys.argv[1])))
print(json.dumps(client.join(launch, 20, environ={})), flush=True)
time.sleep(60)  # as if in MPI_Init, waiting in its barrier
"""


def _serve_with_watching_rank1():
    """A server for 3 ranks, and rank 1 as a process of its own that joins
    (its hello's connection kept open), prints its variables and waits."""
    proc, port = _serve(3, 30)
    rank1 = subprocess.Popen([sys.executable, "-c", _WATCHING_RANK,
                              str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=launcher_env())
    return proc, port, rank1


@pytest.mark.timeout(60)
def test_every_rank_hears_who_is_missing_and_ends():
    # Rank 1 is a process of its own that joined (its hello's connection
    # kept open) and then waits, as in MPI_Init; rank 2's MPI dies before
    # the barrier: rank 1 prints the server's line naming rank 2 and ends.
    import json
    proc, port, rank1 = _serve_with_watching_rank1()
    try:
        joined = _join_all_but(port, 3, 1)
        joined[1] = json.loads(rank1.stdout.readline())
        pmi = {r: Pmi(joined[r]) for r in range(3)}
        for r in (0, 1):
            pmi[r].send("cmd=barrier_in")
        time.sleep(0.3)
        start = time.monotonic()
        pmi[2].sock.close()
        pmi[2].file.close()
        assert rank1.wait(timeout=10) == 1
        assert time.monotonic() - start < 5
        err = rank1.stderr.read()
    finally:
        if rank1.poll() is None:
            rank1.kill()
        _end(proc)
    assert err == ("kerasdist: rank 1 of 3: ranks 2 of 3 did not reach "
                   "MPI's barrier (the MPI of rank 2 ended without "
                   "finalizing); ending the job's MPI\n"), err


def _hello_kept(port, size, rank):
    """rank's hello as join() says it, its connection kept: (its PMI
    variables, the socket, the signer of its later lines)."""
    job, key, _ = protocol.identity({})
    launch = Launch("torchrun", rank, size, rank, size, ("127.0.0.1", port))
    kept = []
    reply = client._hello(("127.0.0.1", port), "here", launch, 20,
                              time.monotonic() + 20, job, key, kept)
    assert reply.startswith("cmd=kd_ready rc=0 "), reply
    sock, _, sign = kept[0]
    return ({"PMI_PORT": f"127.0.0.1:{port}",
             "PMI_ID": protocol.tokens(reply)["pmiid"]}, sock, sign)


def _on_threads(fn, ranks):
    """{rank: fn(rank)} for each of `ranks`, each on a thread of its own."""
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.update({r: fn(r)}))
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _kept_all(port, size, ranks):
    return _on_threads(lambda r: _hello_kept(port, size, r), ranks)


@pytest.mark.timeout(60)
def test_a_rank_lost_after_mpi_inits_last_barrier_ends_the_others():
    # Past MPI_Init's PMI barrier, a rank whose process ends leaves the
    # others waiting inside MPI_Init (for its shared memory) or init's
    # first collectives, with no barrier to fail and no heartbeat yet: the
    # server ends them at once, naming it, as the heartbeat would (75). A
    # kd_up without the hello's proof does not count: rank 2 is not up.
    import json
    proc, port, rank1 = _serve_with_watching_rank1()
    try:
        kept = _kept_all(port, 3, (0, 2))
        joined = {r: kept[r][0] for r in kept}
        joined[1] = json.loads(rank1.stdout.readline())
        pmi = {r: Pmi(joined[r]) for r in range(3)}
        for r in range(3):
            pmi[r].send("cmd=barrier_in")
        for r in range(3):
            assert pmi[r].read() == "cmd=barrier_out rc=0"
        kept[0][1].sendall((kept[0][2]("cmd=kd_up") + "\n").encode())
        kept[2][1].sendall(b"cmd=kd_up mac=" + b"0" * 64 + b"\n")
        time.sleep(0.3)
        start = time.monotonic()
        pmi[2].sock.close()
        pmi[2].file.close()
        assert rank1.wait(timeout=10) == protocol.EXIT_PEER_LOST
        assert time.monotonic() - start < 5
        err = rank1.stderr.read()
        # Rank 0's own connection hears it too (its process would end).
        kept[0][1].settimeout(10)
        said = protocol.read_line(kept[0][1])
        # Until rank 0's process has ended (its hello's connection
        # closed), its MPI's connection stays open: MPICH crashes inside
        # MPI_Init when that closes before the watch thread ends it.
        pmi[0].sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            pmi[0].sock.recv(1)
        assert proc.poll() is None
        kept[0][1].close()
        assert proc.wait(timeout=5) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()
        _end(proc)
    host = protocol.node_identity().partition("/")[0]
    line = (f"lost rank 2 on host {host}: its process ended while the job "
            f"was starting (its MPI's connection to the rendezvous closed "
            f"without MPI_Finalize before every rank's kd.init() had "
            f"finished, where MPI would wait for it for ever); ending this "
            f"rank.")
    assert err == f"kerasdist: rank 1: {line}\n", err
    assert said.startswith(f"cmd=kd_fail code=75 msg={line} mac="), said


@pytest.mark.timeout(60)
def test_once_every_rank_is_up_a_lost_rank_is_the_heartbeats():
    # Every rank's kd.init() finished (kd_up): a rank that ends then is
    # the heartbeat's to report (75, "lost rank ..."); the server says
    # nothing, and the others still finalize.
    proc, port = _serve(3, 30)
    try:
        kept = _kept_all(port, 3, range(3))
        pmi = {r: Pmi(kept[r][0]) for r in range(3)}
        for r in range(3):
            kept[r][1].sendall((kept[r][2]("cmd=kd_up") + "\n").encode())
        time.sleep(0.3)
        pmi[2].sock.close()
        pmi[2].file.close()
        kept[0][1].settimeout(0.5)
        with pytest.raises(socket.timeout):
            kept[0][1].recv(1)
        assert proc.poll() is None
        for r in (0, 1):
            assert pmi[r].ask("cmd=finalize") == "cmd=finalize_ack rc=0"
        assert proc.wait(timeout=10) == 0
    finally:
        err = _end(proc)
    assert err == "", err


@pytest.mark.timeout(60)
def test_the_server_tells_mpi_which_ranks_share_a_node():
    # Every hello here names this process's node: one node.
    proc, port = _serve(3, 30)
    try:
        joined = _join_all(port, 3, {})
        p = Pmi(joined[0])
        assert p.ask("cmd=get kvsname=k key=PMI_process_mapping") == \
            "cmd=get_result rc=0 value=(vector,(0,1,3))"
        p.close()
    finally:
        _end(proc)


def test_node_mapping_for_mpi():
    ids, mapping = node_ids, process_mapping
    assert ids(["a/1", "b/1", "a/1", "a/2"]) == [0, 1, 0, 2]
    assert mapping(["h/x"] * 4) == "(vector,(0,1,4))"
    # torchrun's and node mode's order: node-major blocks.
    assert mapping(["h0/x"] * 2 + ["h1/x"] * 2) == "(vector,(0,2,2))"
    # One host name, two IPC namespaces (two containers): two nodes.
    assert mapping(["h/ipc1", "h/ipc2"]) == "(vector,(0,2,1))"
    assert mapping(["a/1", "b/1", "a/1", "b/1", "b/1"]) == \
        "(vector,(0,2,1),(0,1,1),(1,1,2))"
    # A rank that named no node (an older client): MPI decides by host
    # name alone. Too many blocks for one PMI value: the same.
    assert mapping(["a/1", ""]) is None
    assert mapping([]) is None
    rng = random.Random(5)
    assert mapping([f"h{rng.randrange(50)}/x" for _ in range(2000)]) is None
    # Whatever it says, MPICH's reading of it (MPL_rankmap_str_to_array)
    # gives each rank its node's number.
    for _ in range(200):
        nodes = [f"h{rng.randrange(5)}/x" for _ in range(rng.randint(1, 40))]
        text = mapping(nodes)
        assert _mpich_reads(text, len(nodes)) == ids(nodes), (nodes, text)


def _mpich_reads(text, size):
    """The node of each rank as MPICH reads "(vector,(a,b,c),...)": c
    ranks on each of the nodes a .. a+b-1, in rank order."""
    import re
    assert re.fullmatch(r"\(vector(,\(\d+,\d+,\d+\))+\)", text), text
    out = []
    for a, b, c in re.findall(r"\((\d+),(\d+),(\d+)\)", text):
        for node in range(int(a), int(a) + int(b)):
            out += [node] * int(c)
    assert len(out) == size, (text, size)
    return out


_PRINT_NODE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("r", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.node_identity())
"""


def test_node_identity_tells_ipc_namespaces_apart():
    import shutil
    me = protocol.node_identity()
    assert me == protocol.node_identity()
    assert me.partition("/")[0] == socket.gethostname()[:64]
    assert len(me) <= protocol.NODE_MAX
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for namespaces of its own")
    for flags, other_node in ((["--ipc"], True), (["--mount"], False)):
        p = subprocess.run(["unshare", *flags, sys.executable, "-I", "-c",
                            _PRINT_NODE, protocol.__file__],
                           capture_output=True, text=True, timeout=30)
        if p.returncode:
            pytest.skip(f"unshare {flags}: {p.stderr.strip()}")
        other = p.stdout.strip()
        # The same host name; another IPC namespace is another node for
        # MPI, another mount namespace with the same /dev/shm is not.
        assert other.partition("/")[0] == me.partition("/")[0]
        assert (other != me) == other_node, (flags, other, me)


def _join_all_but(port, size, absent):
    """join() of every rank but `absent` (which joins elsewhere)."""
    def one(rank):
        if rank == 0:
            return _hello0(port, size, {}, 20)
        launch = Launch("torchrun", rank, size, rank, size,
                        ("127.0.0.1", port))
        return client.join(launch, 20, environ={}, watch=False)
    return _on_threads(one, [r for r in range(size) if r != absent])


@pytest.mark.timeout(60)
def test_the_pmi_barrier_has_a_deadline_naming_who_is_missing():
    proc, port = _serve(2, 2)
    try:
        joined = _join_all(port, 2, {})
        p0, p1 = Pmi(joined[0]), Pmi(joined[1])  # rank 1 never enters
        start = time.monotonic()
        reply = p0.ask("cmd=barrier_in")
        assert reply.startswith("cmd=barrier_out rc=1"), reply
        assert 1.5 < time.monotonic() - start < 6
        assert proc.wait(timeout=10) == 0
        p1.close()
    finally:
        err = _end(proc)
    assert "ranks 1 of 2 did not reach MPI's barrier (not within 2 s)" \
        in err, err


@pytest.mark.timeout(60)
def test_a_rank_may_not_use_another_ranks_pmi_id_or_key():
    proc, port = _serve(2, 20)
    try:
        joined = _join_all(port, 2, {})
        p0 = Pmi(joined[0])
        # Its PMI_ID is spent: a second connection with it is dropped.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"cmd=initack pmiid={joined[0]['PMI_ID']}\n".encode())
            assert s.recv(100) == b""
        assert p0.ask("cmd=put kvsname=k key=a value=0") == \
            "cmd=put_result rc=0"
        p1 = Pmi(joined[1])
        assert p1.ask("cmd=put kvsname=k key=a value=1") == \
            "cmd=put_result rc=1 msg=duplicate_key"
        assert p1.ask("cmd=get kvsname=k key=a") == \
            "cmd=get_result rc=0 value=0"
        p1.send("cmd=put kvsname=k key=b value=" + "v" * 2000)
        assert p1.read() == ""  # beyond the bounds: dropped
        p0.close()
    finally:
        _end(proc)


def test_a_rank_holds_a_bounded_number_of_pmi_keys():
    # At most MAX_KEYS_PER_RANK keys a rank (rewriting its own costs
    # none); the next one drops its connection.
    proc, port = _serve(2, 20)
    try:
        p0 = Pmi(_join_all(port, 2, {})[0])
        for i in range(protocol.MAX_KEYS_PER_RANK):
            p0.send(f"cmd=put kvsname=k key=k{i} value={i}")
        p0.send("cmd=put kvsname=k key=k0 value=again")
        replies = [p0.read()
                   for _ in range(protocol.MAX_KEYS_PER_RANK + 1)]
        assert replies == ["cmd=put_result rc=0"] * len(replies)
        p0.send("cmd=put kvsname=k key=one_more value=x")
        assert p0.read() == ""
        p0.close()
    finally:
        _end(proc)


# ---- fuzz -------------------------------------------------------------------

def _mutations(rng):
    valid = [b"cmd=kd_auth job=unnamed nonce=abc\n",
             b"cmd=kd_hello rank=0 size=2 proof=" + b"0" * 64 + b"\n",
             b"cmd=initack pmiid=12345\n", b"cmd=init pmi_version=1\n",
             b"cmd=put kvsname=k key=card[0] value=x\n",
             b"cmd=barrier_in\n", b"cmd=get kvsname=k key=card[1]\n",
             b"cmd=finalize\n", b"cmd=abort message=x\n"]
    while True:
        m = bytearray(b"".join(rng.choice(valid)
                               for _ in range(rng.randint(1, 4))))
        for _ in range(rng.randint(0, 8)):
            op, i = rng.randint(0, 3), rng.randrange(len(m) + 1)
            if op == 0 and m:
                m[min(i, len(m) - 1)] = rng.randrange(256)
            elif op == 1:
                m[i:i] = os.urandom(rng.randint(1, 64))
            elif op == 2:
                del m[i:i + rng.randint(1, 16)]
            else:
                m[i:i] = b"\\" * rng.randint(1, 4) + b" = \n"
        yield bytes(m) if rng.random() < 0.9 else os.urandom(
            rng.randint(1, 5000))


@pytest.mark.timeout(60)
def test_fuzzing_the_server_while_a_job_forms_changes_nothing():
    proc, port = _serve(2, 20, "job1")
    stop, sent = threading.Event(), []

    def fuzz():
        rng = random.Random(36)
        gen = _mutations(rng)
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port),
                                              timeout=1) as s:
                    s.settimeout(0.2)
                    for _ in range(rng.randint(1, 3)):
                        s.sendall(next(gen))
                    sent.append(1)
                    try:
                        s.recv(4096)
                    except OSError:
                        pass
            except OSError:
                pass

    threads = [threading.Thread(target=fuzz) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)  # fuzz alone, then while the job forms and runs
        _form_and_run(port, 2, {protocol.JOB_ID_ENV: "job1"})
        assert proc.wait(timeout=10) == 0
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        _end(proc)
    assert len(sent) > 20


# ---- where rank 0's server listens ------------------------------------------

def listening(pid):
    """[(address, port)] of the TCP sockets process `pid` listens on (from
    /proc, as `ss -ltnp` shows them)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            if width == 8:
                ip = socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1])
            else:
                raw = bytes.fromhex(hex_ip)
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(
                    raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out.append((ip, int(hex_port, 16)))
    return out


def _this_hosts_address():
    """A non-loopback IPv4 address of this host, or None."""
    with open("/proc/net/route") as f:
        next(f)
        for row in f:
            if row.split()[0] != "lo":
                try:
                    return protocol.address_toward("192.0.2.123")
                except OSError:
                    return None
    return None


def _serve_through_join(coordinator, local_size):
    """Forms a 2-rank job with join() itself (rank 0 starts its server);
    returns (where the server listens, rank 1's PMI_PORT, rank 0's)."""
    out = {}

    def one(rank):
        launch = Launch("torchrun", rank, 2, rank, local_size, coordinator)
        out[rank] = client.join(launch, 20, environ={
            protocol.JOB_ID_ENV: "where", protocol.SECRET_ENV: SECRET},
            watch=False)

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    server = client._server
    client._server = None
    try:
        assert set(out) == {0, 1}, out
        return (listening(server.pid), out[1]["PMI_PORT"],
                out[0]["PMI_PORT"])
    finally:
        server.stdin.close()
        server.wait(20)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_single_host_jobs_server_listens_on_loopback_only():
    port = _free_port()
    where, pmi1, pmi0 = _serve_through_join(("127.0.0.1", port), 2)
    assert where == [("127.0.0.1", port)]
    assert pmi0 == pmi1 == f"127.0.0.1:{port}"
    # A host's own name that resolves to loopback here: loopback when the
    # platform says every rank is on this host.
    port = _free_port()
    where, _, _ = _serve_through_join(("localhost", port), None)
    assert where == [("127.0.0.1", port)]


@pytest.mark.timeout(60)
def test_a_multi_host_jobs_server_listens_on_the_coordinators_address():
    address = _this_hosts_address()
    if address is None or address.startswith("127."):
        pytest.skip("this host has no address but loopback")
    port = _free_port()
    where, pmi1, pmi0 = _serve_through_join((address, port), 1)
    assert where == [(address, port)]
    assert pmi0 == pmi1 == f"{address}:{port}"
    # Nothing answers on loopback: no other interface exposes it.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_listen_address():
    la = client.listen_address
    one_host = Launch("torchrun", 0, 2, 0, 2, None)
    unknown = Launch("keras", 0, 2, None, None, None)
    spread = Launch("torchrun", 0, 4, 0, 2, None)
    assert la(unknown, "127.0.0.1", "127.0.0.1") == "127.0.0.1"
    assert la(spread, "localhost", "127.0.0.1") == "127.0.0.1"
    # A name that is loopback here alone (Debian's 127.0.1.1 for the host's
    # name) may be the host's address on the others: every interface,
    # unless the platform says that every rank is here.
    assert la(spread, "myhost", "127.0.1.1") == ""
    assert la(unknown, "myhost", "127.0.1.1") == ""
    assert la(one_host, "myhost", "127.0.1.1") == "127.0.1.1"
    # Not this host's (a Service's address, a NAT): every interface.
    assert la(spread, "svc", "203.0.113.9") == ""
    address = _this_hosts_address()
    if address and not address.startswith("127."):
        assert la(spread, "me", address) == address
