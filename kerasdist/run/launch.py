"""`kerasdist run`: starts N ranks of a command under MPI's mpiexec (hydra),
or itself over the TCP transport (KERASDIST_TRANSPORT=tcp, tcp_launch.py).

    kerasdist run -np 4 python train.py
    kerasdist run -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 \\
        python train.py
    kerasdist run --nnodes 2 --node-rank 1 --master-addr node1 \\
        --nproc-per-node 4 python train.py

The last is node mode (node.py): run on every host, it starts that host's
ranks itself, without mpiexec or ssh.

`main` reads the command line into a frozen LaunchConfig
(launch_config.py), checks what it can before a rank starts, and hands the
job to node mode or to the attempt loop (attempt_loop.py), which builds
the MPI launcher's command line (mpi_command.py) for each attempt.

Standard library only: never imports TensorFlow; from the rest of kerasdist
only the ctypes binding of the core library, for the settings' names (see
settings.py). It starts in milliseconds. See docs/launcher.md.
"""

import os
import secrets
import shlex
import shutil
import sys
import tempfile
import time

from kerasdist._core import site_mpi
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import tcp_job
from kerasdist.run import _rank
from kerasdist.run import attempt_loop
from kerasdist.run import hosts as hosts_lib
from kerasdist.run import intel_mpi
from kerasdist.run import job
from kerasdist.run import launch_config
from kerasdist.run import mpi_command
from kerasdist.run import node
from kerasdist.run import remote
from kerasdist.run.launch_config import PROG


def main(argv=None):
    """Entry point of `kerasdist run`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    log = job.Log()
    try:
        config = launch_config.parse_args(argv)
    except launch_config.UsageError as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 2
    try:
        # The one rule of a job's secret, as kd.init() checks it where a
        # platform started the ranks (protocol.secret_problem).
        protocol.secret_of(os.environ)
    except ValueError as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 2
    problem = _rank.command_problem(config.command[0])
    if problem is not None:
        log.raw(f"{PROG}: error: {problem}.\n".encode())
        return 2
    if config.node is not None:
        return _run_node(config, log)
    return _run_mpi(config, log)


def _run_mpi(config, log):
    """The job under the MPI launcher: its attempts (attempt_loop.py)."""
    if config.platform_hostfile is not None:
        name, path = config.platform_hostfile
        log.line(f"hosts from {name}={path}: "
                 f"{hosts_lib.hydra_hosts_arg(config.hosts)}")
    tcp = tcp_job.wanted(os.environ)  # checked by launch_config
    try:
        # Over TCP the launcher starts the ranks itself (tcp_launch.py).
        mpiexec = None if tcp else mpi_command.find_mpiexec()
        attempt_loop.rank_env(config, 0)  # the core library names the variables
    except (FileNotFoundError, ImportError) as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 1

    if not _check_remote_hosts(config, log):
        return 1
    with _elastic_dir(config), _job_secret(), _marker_tokens():
        if tcp:
            with tempfile.TemporaryDirectory(prefix="kerasdist-run-") as wd:
                return attempt_loop.run(config, None, log, wd)
        # Intel MPI's mpiexec gets its hosts in a file (intel_mpi.py).
        if (config.ssh_argv is None or len(config.ssh_argv) == 1) and \
                not intel_mpi.is_intel_mpiexec(mpiexec):
            return attempt_loop.run(config, mpiexec, log)
        with tempfile.TemporaryDirectory(prefix="kerasdist-run-") as workdir:
            return attempt_loop.run(config, mpiexec, log, workdir)


class _job_secret:
    """Every job gets a random secret of its own in KERASDIST_JOB_SECRET
    (unless one is set already), which its ranks prove on every control
    connection (the heartbeat, kerasdist/rendezvous/; SECURITY.md).
    It travels in the environment (hydra's -genvall, Open MPI's -x), never
    on a command line."""

    def __enter__(self):
        self.made = not os.environ.get(protocol.SECRET_ENV)
        if self.made:
            os.environ[protocol.SECRET_ENV] = secrets.token_hex(32)
        # And the token of the per-rank wrappers' exit markers (_rank.py).
        os.environ[_rank.MARKER_TOKEN_ENV] = secrets.token_hex(16)
        return self

    def __exit__(self, *exc):
        if self.made:
            os.environ.pop(protocol.SECRET_ENV, None)
        os.environ.pop(_rank.MARKER_TOKEN_ENV, None)
        return False


class _marker_tokens:
    """The job's random tokens of the markers the launcher reads
    (_rank.py): the per-rank wrappers' exit markers, and the markers the
    rank writes (progress, resizable), so that no line a program prints
    passes for one. Under mpiexec and in node mode alike (under mpiexec
    it replaces _job_secret's exit token, which it makes redundant)."""

    _NAMES = (_rank.MARKER_TOKEN_ENV, _rank.RANK_MARKER_TOKEN_ENV)

    def __enter__(self):
        for name in self._NAMES:
            os.environ[name] = secrets.token_hex(16)
        return self

    def __exit__(self, *exc):
        for name in self._NAMES:
            os.environ.pop(name, None)
        return False


class _elastic_dir:
    """A job that may be relaunched (--max-restarts, or one that grows and
    shrinks) gets a directory of its own for `hvd.elastic`'s commits
    (kerasdist/elastic.py), in KERASDIST_ELASTIC_DIR for every rank and
    attempt, removed when the job ends; unless KERASDIST_ELASTIC_DIR is
    set already (a directory every host sees, for jobs whose rank 0 may
    move to another host), which is kept."""

    def __init__(self, config):
        self.wanted = (config.max_restarts > 0 or
                       config.host_discovery_script is not None) and \
            not os.environ.get(_rank.ELASTIC_DIR_ENV)
        self.path = None

    def __enter__(self):
        if self.wanted:
            self.path = tempfile.mkdtemp(prefix="kerasdist-elastic-")
            os.environ[_rank.ELASTIC_DIR_ENV] = self.path
        return self

    def __exit__(self, *exc):
        if self.path is not None:
            os.environ.pop(_rank.ELASTIC_DIR_ENV, None)
            shutil.rmtree(self.path, ignore_errors=True)
        return False


def _run_node(config, log):
    """Node mode: this host's ranks under node.py's process manager."""
    plan = config.node
    if config.node_from_pet:
        log.line(f"node mode from the PET_* variables: node "
                 f"{plan.node_rank} of {plan.nnodes}, "
                 f"{plan.nproc_per_node} rank(s) here, master "
                 f"{plan.master_addr}:{plan.master_port}")
    wrong = None if tcp_job.wanted(os.environ) else site_mpi.check_rendezvous(
        "kerasdist run --nnodes (node mode)")
    if wrong:
        log.raw(f"{PROG}: error: {wrong}\n".encode())
        return 2
    try:
        rank_env = attempt_loop.rank_env(config, 0)
    except ImportError as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 1
    wrapper = mpi_command.rank_wrapper_argv(
        **mpi_command.wrapper_options(config))
    deadline = (None if config.timeout is None else
                time.monotonic() + config.timeout)
    with job.Interrupts() as interrupts, _marker_tokens():
        outcome = node.run(plan, config.command, rank_env, wrapper,
                           interrupts, deadline, config.timeout, log,
                           verbose=config.verbose,
                           keep_survivors=config.recover_in_place,
                           join=config.join)
    return outcome.exit_code


def _check_remote_hosts(config, log):
    """Names each remote host its remote shell cannot reach; True if none."""
    if config.slurm is not None and config.ssh_argv is None:
        return True  # hydra starts the ranks with srun, not a remote shell
    shell = remote.effective_command(config.ssh_argv, os.environ)
    remote_hosts = [h for h, _ in config.hosts or () if not remote.is_local(h)]
    if not remote_hosts or shell is None:
        return True
    failed = remote.check_hosts(remote_hosts, shell)
    for host, reason in failed:
        log.raw(f"{PROG}: error: cannot start ranks on host {host}: "
                f"`{shlex.join(shell)} {host} true` failed: {reason}. Check "
                f"the host name and that this command works without a "
                f"password, or give another remote shell with "
                f"--ssh-command.\n".encode())
    return not failed
