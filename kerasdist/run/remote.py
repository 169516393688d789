"""The remote shell that starts ranks on other hosts.

hydra's mpiexec starts one proxy per host through a remote shell: `ssh` by
default, or any command given with `--ssh-command` / KERASDIST_SSH_COMMAND
that is called like ssh (`CMD [options] HOST COMMAND...`). Before a job, the
launcher runs `CMD HOST true` on every remote host at once, as horovodrun
does, so that a host that does not resolve or refuses the remote shell is
named in one line instead of in hydra's error trace. Standard library only.
"""

import os
import shlex
import shutil
import socket
import subprocess
import time

SSH_COMMAND = "KERASDIST_SSH_COMMAND"  # read by the launcher only
DEFAULT_SSH = "ssh"


def split_command(text):
    """Splits an --ssh-command value into argv.

    Raises:
        ValueError: it is empty or not valid shell syntax.
    """
    try:
        argv = shlex.split(text or "")
    except ValueError as e:
        raise ValueError(f"--ssh-command: cannot split {text!r}: {e}") from None
    if not argv:
        raise ValueError("--ssh-command: expected a command such as 'ssh -p "
                         f"2222', got {text!r}")
    return argv


def is_local(host):
    """Whether `host` names this machine, without any name lookup.

    True for localhost, this machine's host name and addresses this machine
    can bind; a name that resolves to this machine under another name is
    taken as remote (the check then reaches it through the remote shell).
    """
    me = socket.gethostname()
    names = {"localhost", me, me.split(".")[0]}
    if host in names:
        return True
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((host, 0))
                return True
            except OSError:
                return False
    return False


def launcher_exec(argv, directory):
    """The single executable hydra's `-launcher-exec` takes for `argv`.

    hydra runs its value as one file name, so a command with arguments is
    written to a small script in `directory` that runs it with hydra's
    arguments appended.
    """
    if len(argv) == 1:
        return shutil.which(argv[0]) or argv[0]
    path = os.path.join(directory, "remote-shell")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.join(argv)} "$@"\n')
    os.chmod(path, 0o700)
    return path


def effective_command(argv, environ):
    """The remote shell hydra will use: `argv` (from --ssh-command), else
    hydra's own HYDRA_LAUNCHER_EXEC, else ssh; None when HYDRA_LAUNCHER
    picks a launcher that is not a remote shell (slurm, fork, ...)."""
    if argv:
        return list(argv)
    if environ.get("HYDRA_LAUNCHER", "ssh") not in ("ssh", "rsh"):
        return None
    exe = environ.get("HYDRA_LAUNCHER_EXEC")
    return [exe] if exe else [environ.get("HYDRA_LAUNCHER", DEFAULT_SSH)]


def _check_argv(argv, timeout):
    if os.path.basename(argv[0]) == "ssh":
        # Never wait for a password or a host-key question: the job could not
        # answer them either.
        argv = argv + ["-o", "BatchMode=yes",
                       "-o", f"ConnectTimeout={max(1, int(timeout))}"]
    return argv


def check_hosts(hosts, argv, timeout=15.0, command=("true",)):
    """Runs `argv HOST true` on every remote host at once.

    Args:
        hosts: host names.
        argv: the remote shell command (a list).
        timeout: seconds to wait for all of them together.
        command: what to run there instead of `true` (a list).

    Returns:
        [(host, reason), ...] for the hosts that failed, in `hosts` order;
        `reason` is the remote shell's last line of error output, or what
        happened instead.
    """
    base = _check_argv(list(argv), timeout)
    procs = {}
    failures = {}
    for host in hosts:
        try:
            procs[host] = subprocess.Popen(
                base + [host, *command], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True)
        except OSError as e:
            failures[host] = f"cannot run {argv[0]!r}: {e.strerror or e}"
    deadline = time.monotonic() + timeout
    for host, proc in procs.items():
        try:
            # Past the deadline a host that has already answered still
            # counts: give it a moment to be read.
            _, err = proc.communicate(
                timeout=max(0.2, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            failures[host] = f"no answer within {timeout:g} s"
            continue
        if proc.returncode != 0:
            lines = [l for l in err.decode(errors="replace").splitlines()
                     if l.strip()]
            failures[host] = (lines[-1].strip() if lines else
                              f"it exited with code {proc.returncode}")
    return [(host, failures[host]) for host in hosts if host in failures]


def _kill(proc):
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        pass
