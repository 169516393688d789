"""The attempt loop of `kerasdist run` under mpiexec: restarts and resizes.

`run(config, mpiexec, log)` starts the job's ranks under the MPI launcher
(mpi_command.py), waits for them (job.run_attempt: output, heartbeat,
--timeout, signals) and, where the attempt failed and --max-restarts
allows, or the ranks stopped for a resize (resize.py), starts the next one
on the hosts that answer then (elastic.py), backing off between attempts
that fail at once. `Attempts` counts them.

Standard library only (see launch.py).
"""

import os
import shlex
import signal
import time

from kerasdist.run import _rank
from kerasdist.run import elastic
from kerasdist.run import grow
from kerasdist.run import hosts as hosts_lib
from kerasdist.run import intel_mpi
from kerasdist.run import job
from kerasdist.run import mpi_command
from kerasdist.run import node
from kerasdist.run import remote
from kerasdist.run import resize
from kerasdist.run import settings
from kerasdist.run import shm
from kerasdist.run import tcp_launch

QUIET_TF_ENV = "TF_CPP_MIN_LOG_LEVEL"


def rank_env(config, attempt):
    """The KERASDIST_* settings (and others) every rank of attempt `attempt`
    gets, from `config` (a LaunchConfig)."""
    env = settings.build_env(
        attempt,
        fusion_threshold_mb=config.fusion_threshold_mb,
        cycle_time_ms=config.cycle_time_ms,
        timeline_filename=config.timeline_filename,
        autotune=config.autotune,
        network_interface=config.network_interface,
    )
    if config.host_discovery_script is not None and config.node is None:
        env[_rank.ELASTIC_ENV] = "1"  # see kerasdist/run/resize.py
    # TensorFlow's C++ start-up lines (CPU features, oneDNN, absl's notice)
    # would come once per rank before the first epoch: warnings and errors
    # only, unless the caller chose a level.
    if QUIET_TF_ENV not in os.environ:
        env[QUIET_TF_ENV] = "1"
    return env


class Attempts:
    """Counts a job's attempts: a failed one uses up one of --max-restarts,
    a resize (the ranks stopped at a checkpoint because hosts joined or
    left) does not.

    Attributes:
        started: attempts started so far (the next one's
            KERASDIST_RESTART_ATTEMPT).
        restarts: relaunches after a failure so far.
        resizes: relaunches after a resize so far.
    """

    def __init__(self, max_restarts):
        self.max_restarts = max_restarts
        self.started = self.restarts = self.resizes = 0
        self.repeated = None  # the error two attempts in a row ended with
        self._last_error = None

    def start(self):
        """Notes an attempt's start; returns its number from 0."""
        self.started += 1
        return self.started - 1

    def after(self, outcome):
        """"resize" or "restart" to go on after `outcome`, None to stop."""
        if outcome.resized:
            self.resizes += 1
            return "resize"
        # An attempt that saved progress (a checkpoint) is compared with
        # neither neighbour: it did not repeat the one before, and the next
        # one starts from a later point.
        last, self._last_error = self._last_error, (
            None if outcome.progressed else outcome.error)
        if not outcome.retryable or self.restarts >= self.max_restarts:
            return None
        if self._last_error is not None and self._last_error == last:
            # The same ranks failed with the same words again, with no
            # progress saved in between: a relaunch would only repeat it.
            self.repeated = outcome.error
            return None
        self.restarts += 1
        return "restart"

    @property
    def most(self):
        """The most attempts the job may have, as far as known now."""
        return self.max_restarts + self.resizes + 1




def run(config, mpiexec, log, workdir=None):
    """Runs the job of `config` (a LaunchConfig) under `mpiexec`, attempt
    after attempt, until one ends it; returns the job's exit code.

    Args:
        config: the LaunchConfig.
        mpiexec: the MPI launcher (mpi_command.find_mpiexec).
        log: the job.Log.
        workdir: a directory for the remote shell's wrapper script
            (remote.launcher_exec) and Intel MPI's machinefile, or None
            where neither is needed.
    """
    loop = _Loop(config, mpiexec, log, workdir)
    with job.Interrupts() as interrupts:
        return loop.run(interrupts)


class _Loop:
    """One job's attempts: what `run` knows between two of them."""

    def __init__(self, config, mpiexec, log, workdir):
        self.config, self.mpiexec, self.log = config, mpiexec, log
        self.workdir = workdir
        self.launcher_exec = (None if config.ssh_argv is None else
                              remote.launcher_exec(config.ssh_argv, workdir))
        # mpiexec None: over the TCP transport, no MPI (tcp_launch.py).
        self.intel = mpiexec is not None and \
            intel_mpi.is_intel_mpiexec(mpiexec)
        self.coordinator = None  # over TCP: the attempt's (addr, port)
        self.attempts = Attempts(config.max_restarts)
        self.deadline = (None if config.timeout is None else
                         time.monotonic() + config.timeout)
        # The last attempt's job.Outcome, what comes after it ("restart",
        # "resize") and the size its resize asked for.
        self.outcome = self.then = self.announced = None
        self.began = None  # when the last attempt started (monotonic)
        self.quick = 0  # attempts in a row that failed within _QUICK_S

    def run(self, interrupts):
        """The attempts, one after the other; returns the exit code."""
        while True:
            placed = _place(self.config, self.log, self.attempts.started > 0)
            if placed is None:
                if self.outcome is None or self.outcome.resized:
                    return 1
                return self.outcome.exit_code
            self.outcome = self.attempt(interrupts, *placed)
            self.then = self.attempts.after(self.outcome)
            if self.then is None:
                self.say_why_it_ended()
                return self.outcome.exit_code
            if self.then == "restart":
                stopped = self.back_off(interrupts)
                if stopped is not None:
                    return stopped

    def attempt(self, interrupts, np_, hosts):
        """Runs one attempt on np_ ranks on `hosts`; returns its Outcome."""
        attempt = self.attempts.start()
        self.announce(attempt, np_, hosts)
        argv, env = self.command(attempt, np_, hosts)
        watcher = _watcher(self.config, self.log, np_, hosts,
                           None if self.mpiexec is not None else self)
        self.began = time.monotonic()
        began_at = time.time()
        outcome = job.run_attempt(argv, env, interrupts, self.deadline,
                                  self.config.timeout, self.log,
                                  banner=self.config.verbose,
                                  manager=("mpiexec" if self.mpiexec else
                                           "the job's process manager"),
                                  watcher=watcher, ranks=np_,
                                  keep_survivors=self.config.recover_in_place)
        if outcome.exit_code != 0:
            # What MPICH's dead ranks left in /dev/shm on this host.
            shm.remove_orphans(began_at - 1.0)
        if outcome.resized:
            self.announced = (watcher.requested or
                              watcher.in_place).new_np
        return outcome

    def announce(self, attempt, np_, hosts):
        """Says why attempt `attempt` (from 0) starts, after the first."""
        if self.then == "restart":
            where = ("" if not _moved(self.config, np_, hosts) else
                     f" on {np_} rank(s)"
                     + (f" ({hosts_lib.hydra_hosts_arg(hosts)})"
                        if hosts else ""))
            self.log.line(f"attempt {attempt + 1} of {self.attempts.most}"
                          f"{where} (the last attempt ended because "
                          f"{self.outcome.reason})")
        elif self.then == "resize" and np_ != self.announced:
            self.log.line(f"starting {np_} rank(s) instead "
                          f"({hosts_lib.hydra_hosts_arg(hosts)}): the hosts "
                          f"changed again")

    def command(self, attempt, np_, hosts):
        """The attempt's (mpiexec argv, environment)."""
        env = rank_env(self.config, attempt)
        if self.mpiexec is None:
            argv, self.coordinator = tcp_launch.command(
                self.config, np_, hosts, _rank_argv(self.config),
                _tcp_shell(self.config), self.workdir, remote.is_local,
                self.config.network_interface)
            if self.config.verbose:
                self.log.line(f"over TCP: {len(tcp_launch.layout(np_, hosts))}"
                              f" host(s), coordinator {self.coordinator[0]}:"
                              f"{self.coordinator[1]}")
            if self.config.recover_in_place:
                env[node.RECOVER_ENV] = "1"
            return argv, dict({k: v for k, v in os.environ.items()
                               if not k.startswith(node.DROPPED_PREFIXES)},
                              **env)
        machinefile = None
        if self.intel:
            # Intel MPI's mpiexec gets its hosts in a file (intel_mpi.py).
            env.update(intel_mpi.rank_env(os.environ))
            if hosts:
                machinefile = intel_mpi.write_machinefile(hosts, self.workdir)
        argv = mpi_command.mpiexec_argv(self.config, self.mpiexec, np_, hosts,
                                        env, self.launcher_exec, machinefile)
        if self.config.verbose:
            self.log.line(f"running: {shlex.join(argv)}")
        return argv, dict(os.environ, **env)

    def back_off(self, interrupts):
        """Waits before a restart (_back_off); the exit code when the job
        ends instead, else None."""
        # An attempt that saved progress (a checkpoint) is no start-up
        # failure, however short it was.
        quick = (time.monotonic() - self.began < _QUICK_S
                 and not self.outcome.progressed)
        self.quick = self.quick + 1 if quick else 0
        return _back_off(self.quick, self.deadline, self.config.timeout,
                         interrupts, self.log)

    def say_why_it_ended(self):
        """The last line of a job that tried more than once in vain."""
        attempts = self.attempts
        if attempts.repeated is not None:
            rank, _, said = attempts.repeated[0]
            self.log.line(f"not restarting: attempt {attempts.started} "
                          f"failed as attempt {attempts.started - 1} did "
                          f"(rank {rank}: {said}), an error a restart "
                          f"repeats.")
        elif self.outcome.retryable and attempts.max_restarts > 0:
            self.log.line(f"giving up after {attempts.started} attempts.")


def _moved(config, np_, hosts):
    """Whether an attempt runs on other ranks or hosts than -np and the
    hosts the command line gave."""
    return np_ != config.np or (
        None if hosts is None else tuple(hosts)) != config.hosts


# Restarts back off: an attempt that failed within _QUICK_S seconds is
# followed by a pause, doubling from _BACKOFF_S up to _BACKOFF_MOST_S while
# they keep failing that fast (a job that cannot start must not restart
# ten times a second). An attempt that saved progress resets the count.
_QUICK_S = 60.0
_BACKOFF_S = 0.5
_BACKOFF_MOST_S = 30.0


def _back_off(quick, deadline, timeout, interrupts, log):
    """Waits before a restart; returns the exit code when --timeout or a
    signal ends the job instead, else None."""
    pause = 0.0 if quick == 0 else min(_BACKOFF_S * 2 ** (quick - 1),
                                       _BACKOFF_MOST_S)
    if pause:
        log.line(f"the attempt failed within {_QUICK_S:g} s of its start; "
                 f"waiting {pause:g} s before the next.")
    end = time.monotonic() + pause
    while True:
        if interrupts.signum is not None:
            log.line(f"received {signal.Signals(interrupts.signum).name}; "
                     f"not restarting.")
            return 128 + interrupts.signum
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            log.line(f"the job timed out after {timeout:g} s; not "
                     f"restarting.")
            return 124
        if now >= end:
            return None
        time.sleep(min(0.05, end - now))


def _watcher(config, log, np_, hosts, tcp_loop=None):
    """The attempt's resize.Watcher, or None outside an elastic job;
    `tcp_loop`: the _Loop of a job over TCP (its new ranks join)."""
    if config.host_discovery_script is None or hosts is None:
        return None
    shell = remote.effective_command(config.ssh_argv, os.environ)

    def answering(candidates):
        return elastic.answering(candidates, shell, config.network_interface)

    argv = _rank_argv(config)
    grows = grow.writer(config, argv)
    if tcp_loop is not None and config.recover_in_place:
        grows = tcp_launch.joiner(
            tcp_launch.requests_dir(tcp_loop.workdir), argv,
            _tcp_shell(config), lambda: tcp_loop.coordinator,
            remote.is_local)
    return resize.Watcher(
        lambda: elastic.discover(config.host_discovery_script), answering,
        np_, hosts, config.min_np, config.max_np, config.discovery_interval,
        log, grow=grows, signal_in_place=tcp_loop is None)


def _rank_argv(config):
    """The per-rank wrapper and the command."""
    return mpi_command.rank_wrapper_argv(
        **mpi_command.wrapper_options(config)) + list(config.command)


def _tcp_shell(config):
    """The remote shell over TCP: --ssh-command's, hydra's own variables
    where they name one, else ssh (no hydra runs)."""
    return remote.effective_command(config.ssh_argv, os.environ) or \
        [remote.DEFAULT_SSH]


def _candidate_hosts(config, log):
    if config.host_discovery_script is None:
        return config.hosts
    try:
        return elastic.discover(config.host_discovery_script)
    except ValueError as e:
        log.line(f"{e}; taking no hosts from it this time.")
        return []


def _place(config, log, restarting):
    """(np, hosts) for the next attempt, or None when too few hosts answer.

    The first attempt runs where it was asked (hosts from the discovery
    script, if any); a restart, or a run with --host-discovery-script, only
    on the hosts that answer now (elastic.answering), with up to -np ranks
    (the first attempt) or --max-np (the later ones).
    """
    hosts = _candidate_hosts(config, log)
    if hosts is None:
        return config.np, None  # this machine, or the Slurm allocation
    if restarting or config.host_discovery_script is not None:
        shell = remote.effective_command(config.ssh_argv, os.environ)
        hosts, failed = elastic.answering(hosts, shell,
                                          config.network_interface)
        for host, reason in failed:
            log.line(f"host {host} does not answer ({reason}); leaving it "
                     "out.")
    # The first attempt starts -np ranks; later ones as many as fit, up to
    # --max-np (which is -np unless the job may grow).
    target = config.max_np if restarting else config.np
    np_ = elastic.ranks_for(target, config.min_np, hosts)
    if np_ is None:
        slots = hosts_lib.total_slots(hosts) if hosts else 0
        log.line(f"giving up: the hosts that answer have {slots} slot(s) "
                 f"({hosts_lib.hydra_hosts_arg(hosts) or 'none'}), fewer "
                 f"than --min-np {config.min_np}.")
        return None
    return np_, hosts
