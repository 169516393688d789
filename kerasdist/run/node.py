"""Node mode of `kerasdist run`: one launcher per host, no mpiexec, no ssh.

Where a platform starts one process per host (a Kubernetes pod per node,
a batch system's one task per node, torchrun's habit), each host runs

    kerasdist run --nnodes 2 --node-rank 1 --master-addr h0 \\
        --master-port 29500 --nproc-per-node 2 python train.py

and starts that host's ranks itself, with torchrun's variables (RANK =
node_rank * nproc_per_node + local rank, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK, GROUP_WORLD_SIZE).
kd.init() on every rank then meets the others at MASTER_ADDR:MASTER_PORT,
where rank 0 (on node 0) serves the rendezvous (kerasdist/rendezvous/),
and MPI starts as one job of all of them.

The launcher runs this file as a small process of its own, the node's
process manager (`python -I -S node.py SPEC`, standard library only), in
the place where the mpiexec path runs mpiexec: it starts one per-rank
wrapper (_rank.py) per local rank, with the launcher's stdout and stderr,
forwards the signals the launcher sends it to every wrapper (a second
ending signal SIGKILLs them), and exits once every wrapper has, with the
first failure's code. So the launcher's relaying, exit markers, --timeout
and fail-fast teardown (kerasdist/run/job.py) apply unchanged. Should a
wrapper fail and no stop come from the launcher within STOP_WAIT_S, the
manager stops the other wrappers itself (as hydra does).

Ranks of other nodes are not this node's to stop: they end through the
heartbeat (ops/core/comm/liveness.cc), which ends every rank once one is
lost.

The pure part (`plan`, `rank_env`) is imported by the launcher.
"""

import collections
import json
import os
import secrets
import signal
import subprocess
import sys
import time

DEFAULT_PORT = 29500  # torchrun's
# Over the TCP transport (kerasdist/rendezvous/tcp_job.py), node mode may
# recover in place (--recover-in-place), no MPI involved.
RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"
JOIN_ENV = "KERASDIST_JOIN"  # rendezvous/joining.py's (stdlib only)
# Seconds the manager waits, after a wrapper failed, for the launcher to
# stop the node (it does so about half a second after the failure).
STOP_WAIT_S = 3.0
_PR_SET_PDEATHSIG = 1
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
_ENDING = ("SIGINT", "SIGTERM", "SIGHUP")

# Variables of other launch conventions that the ranks must not inherit
# (they would contradict the ones node mode sets): prefixes, and names.
DROPPED_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_",
                    "KERAS_DISTRIBUTION_", "TORCHELASTIC_")

Plan = collections.namedtuple(
    "Plan", ["nnodes", "node_rank", "nproc_per_node", "master_addr",
             "master_port", "world_size"])
Plan.__doc__ = """One node's part of a job.

master_port is None when it is to be chosen at start (a job of one node
and no --master-port: any free port of this host).
"""


def _count(text, flag, what, most, of):
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{flag} {text!r} is not a positive integer; give "
                         f"{what}.")
    if value > most:
        raise ValueError(f"{flag} {str(text).strip()} is above {most}, the "
                         f"most {of}; give {what}.")
    return value


def plan(nnodes=None, node_rank=None, nproc_per_node=None, master_addr=None,
         master_port=None, np=None):
    """Checks node mode's flags (strings as given, None where left out) and
    returns the node's Plan.

    Defaults as torchrun's: one node, node rank 0, one rank per node;
    --master-addr defaults to this host (127.0.0.1) for one node only,
    --master-port to 29500 (one node: a free port chosen at start).

    Raises:
        ValueError: one line naming the flag and what to give.
    """
    # The bounds (docs/launcher.md): the launcher's, imported here only
    # (the manager side runs this file by path, standard library only).
    from kerasdist.run import hosts

    if nnodes is None:
        nnodes = 1
    else:
        text = str(nnodes).strip()
        low, sep, high = text.partition(":")
        if sep:
            if low.strip() != high.strip():
                raise ValueError(
                    f"--nnodes {text}: a range of nodes (growing or "
                    f"shrinking jobs) is not supported in node mode; give "
                    f"the number of nodes, e.g. --nnodes "
                    f"{high.strip() or low.strip()}, or start the job from "
                    f"one host with --host-discovery-script (and --min-np, "
                    f"--max-np), which grows and shrinks it.")
            text = low
        nnodes = _count(text, "--nnodes", "the number of hosts, e.g. 2",
                        hosts.MAX_RANKS, "hosts of a kerasdist job")
    nproc = (1 if nproc_per_node is None else
             _count(nproc_per_node, "--nproc-per-node",
                    "the number of ranks to start on this host, e.g. 2",
                    hosts.MAX_RANKS_PER_HOST,
                    "ranks kerasdist runs on one host"))
    if node_rank is None:
        node_rank = 0
    else:
        try:
            node_rank = int(str(node_rank).strip())
        except ValueError:
            raise ValueError(
                f"--node-rank {node_rank!r} is not an integer; give this "
                f"host's number, 0 to {nnodes - 1}.") from None
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f"--node-rank {node_rank} is out of range for --nnodes "
            f"{nnodes}; give each host its own number, 0 to {nnodes - 1}.")
    if master_addr is not None:
        master_addr = master_addr.strip()
        if not master_addr:
            raise ValueError("--master-addr is empty; give node 0's host "
                             "name or address.")
    elif nnodes > 1:
        raise ValueError(
            f"--master-addr is required with --nnodes {nnodes}: give node "
            f"0's host name or address, the same on every node.")
    else:
        master_addr = "127.0.0.1"
    if master_port is not None:
        try:
            port = int(str(master_port).strip())
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise ValueError(
                f"--master-port {master_port!r} is not a TCP port; give a "
                f"port in 1-65535 that is free on node 0's host, the same "
                f"on every node.")
        master_port = port
    elif nnodes > 1:
        master_port = DEFAULT_PORT
    world = nnodes * nproc
    if world > hosts.MAX_RANKS:
        raise ValueError(
            f"--nnodes {nnodes} x --nproc-per-node {nproc} = {world} ranks "
            f"is above {hosts.MAX_RANKS}, the most ranks of a kerasdist "
            f"job; give fewer nodes or fewer ranks per node.")
    if np is not None and np != world:
        raise ValueError(
            f"-np {np} does not match --nnodes {nnodes} x --nproc-per-node "
            f"{nproc} = {world} ranks; leave out -np in node mode.")
    return Plan(nnodes, node_rank, nproc, master_addr, master_port, world)


def ranks_of(p):
    """The global ranks of this node, in local-rank order."""
    first = p.node_rank * p.nproc_per_node
    return list(range(first, first + p.nproc_per_node))


def rank_env(p, local_rank, port=None, join=False, first=None):
    """The variables node mode sets for one local rank (torchrun's); with
    `join` (--join), those of a process that joins a running job, which
    numbers it (KERASDIST_JOIN=1: kerasdist/rendezvous/joining.py).
    `first`: the node's first rank, where nodes hold different numbers of
    ranks (tcp_launch.py; default node_rank * nproc_per_node)."""
    port = p.master_port if port is None else port
    if first is None:
        first = p.node_rank * p.nproc_per_node
    if join:
        return {JOIN_ENV: "1", "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(p.nproc_per_node),
                "MASTER_ADDR": p.master_addr, "MASTER_PORT": str(port)}
    return {
        "RANK": str(first + local_rank),
        "WORLD_SIZE": str(p.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(p.nproc_per_node),
        "GROUP_RANK": str(p.node_rank),
        "GROUP_WORLD_SIZE": str(p.nnodes),
        "MASTER_ADDR": p.master_addr,
        "MASTER_PORT": str(port),
    }


def describe(p, port=None, join=False):
    """One line: which node, which ranks, where the coordinator is."""
    if join:
        return (f"{p.nproc_per_node} process(es) joining the running job "
                f"at {p.master_addr}:{p.master_port}")
    ranks = ranks_of(p)
    span = (f"rank {ranks[0]}" if len(ranks) == 1 else
            f"ranks {ranks[0]}-{ranks[-1]}")
    port = p.master_port if port is None else port
    return (f"node {p.node_rank} of {p.nnodes}: {span} of {p.world_size}, "
            f"coordinator {p.master_addr}:{port}")


SECRET_ENV = "KERASDIST_JOB_SECRET"  # rendezvous.SECRET_ENV (stdlib only)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ------------------------------------------------------- launcher side


def run(p, command, settings_env, wrapper_argv, interrupts, deadline,
        timeout, log, verbose=False, keep_survivors=False, join=False):
    """Runs this node's ranks once under the node's process manager and
    returns the launcher's job.Outcome (kerasdist/run/job.py).
    `keep_survivors` (--recover-in-place over TCP): a rank killed by a
    signal stops no other; the survivors re-form without it. `join`
    (--join): the processes join a running job (rank_env)."""
    from kerasdist.run import job

    port = p.master_port if p.master_port is not None else free_port()
    # The plan, not one set of variables a rank: the manager makes those,
    # so that the spec stays small whatever the ranks (one argument holds
    # at most 128 KiB) and nothing of their number is built here, in the
    # thread that handles the launcher's signals.
    spec = {"argv": list(wrapper_argv) + list(command), "plan": list(p),
            "port": port, "stdin_rank": 0 if p.node_rank == 0 else -1,
            "keep_survivors": bool(keep_survivors), "join": bool(join)}
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__),
            json.dumps(spec)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(DROPPED_PREFIXES)}
    env.update(settings_env)
    if keep_survivors:
        env[RECOVER_ENV] = "1"
    if p.nnodes == 1 and not join and not env.get(SECRET_ENV):
        # Every rank is this launcher's: the job gets a secret of its own,
        # as under mpiexec (launch.py), so that no other job on the port
        # can join it. Agents on several hosts share none unless it is set
        # (SECURITY.md).
        env[SECRET_ENV] = secrets.token_hex(32)
    if verbose or join:
        log.line(describe(p, port, join))
    return job.run_attempt(argv, env, interrupts, deadline, timeout, log,
                           banner=verbose, manager="the node's process "
                           "manager", keep_survivors=keep_survivors)


# ------------------------------------------------------- manager side


class Manager:
    """The node's process manager (the module's doc): `spec` is the
    launcher's (run()), with "first" (rank_env's) where tcp_launch.py
    starts it."""

    def __init__(self, spec):
        self.spec = spec
        plan_ = Plan(*spec["plan"])
        self.ranks = [rank_env(plan_, local, spec["port"],
                               spec.get("join", False), spec.get("first"))
                      for local in range(plan_.nproc_per_node)]
        self.procs = []      # Popen of each wrapper, in local-rank order
        self.signals = 0     # ending signals received
        self.stopping = False

    def _on_signal(self, signum, frame):
        ending = signum in {getattr(signal, n) for n in _ENDING}
        if ending:
            self.signals += 1
            self.stopping = True
        if ending and self.signals > 1:
            self._send_all(signal.SIGKILL)
        else:
            self._send_all(signum)

    def _send_all(self, signum):
        for proc in self.procs:
            if proc.returncode is None:
                try:
                    proc.send_signal(signum)
                except OSError:
                    pass

    def run(self):
        for name in _FORWARDED:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._on_signal)
        for local, variables in enumerate(self.ranks):
            if self.stopping:
                break
            env = dict(os.environ, **variables)
            stdin = (None if local == self.spec.get("stdin_rank", -1)
                     else subprocess.DEVNULL)
            try:
                self.procs.append(subprocess.Popen(
                    self.spec["argv"], env=env, stdin=stdin,
                    close_fds=True))
            except OSError as e:
                sys.stderr.write(f"kerasdist: cannot start rank "
                                 f"{variables.get('RANK', '?')}: "
                                 f"{e.strerror or e}\n")
                sys.stderr.flush()
                self._send_all(signal.SIGTERM)
                self.stopping = True
                break
        if self.stopping:  # a stop that came while they were starting
            self._send_all(signal.SIGTERM)
        return self._wait()

    def _wait(self):
        code = 0
        failed_at = None
        pending = list(self.procs)
        keep = self.spec.get("keep_survivors")
        lost = finished = 0  # with keep: ranks killed, ranks ended well
        while pending:
            for proc in list(pending):
                if proc.poll() is not None:
                    pending.remove(proc)
                    status = proc.returncode
                    if keep and status < 0:  # lost: the others go on
                        lost = lost or 128 - status
                        continue
                    finished += status == 0
                    status = 128 - status if status < 0 else status
                    if status != 0 and code == 0:
                        code = status
                        failed_at = time.monotonic()
            if (failed_at is not None and not self.stopping and pending
                    and time.monotonic() - failed_at > STOP_WAIT_S):
                self.stopping = True  # no launcher stopped us: stop them
                self._send_all(signal.SIGTERM)
            if pending:
                time.sleep(0.05)
        if code == 0 and len(self.procs) < len(self.ranks):
            code = 1  # stopped, or failed, before all ranks started
        if code == 0 and lost and not finished:
            code = lost  # no survivor here: the node lost its ranks
        return code


def _die_with_parent():
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: node.py SPEC (the launcher's JSON)\n")
        return 2
    _die_with_parent()
    return Manager(json.loads(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
