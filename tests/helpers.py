"""Helpers for tests that run `kerasdist run` as a subprocess.

    from tests.helpers import launch, python_cmd, rank_lines

    out = launch(2, python_cmd("print('hi')"), timeout=60)
    assert out.returncode == 0, out.stdout
    assert rank_lines(out.stdout, 1) == ["hi"]

Standard library only; never imports TensorFlow.
"""

import os
import re
import signal
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PREFIX_RE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")


def python_cmd(code):
    """Returns [sys.executable, "-c", code]."""
    return [sys.executable, "-c", code]


def launcher_env(env=None):
    """Returns `env` (default os.environ) with the repo root on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + old if old else "")
    return env


def rank_env(drop=(), **extra):
    """os.environ for launched ranks: TF quiet unless set, the `drop`
    variables removed, `extra` set (values turned into strings)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for k in drop:
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(np, args, timeout=300, env=None, launcher_args=(), cwd=None,
           prefix=()):
    """Runs `python -m kerasdist.run [launcher_args] -np NP ARGS...`.

    Args:
        np: number of ranks, or None to give no -np.
        args: the command to run on every rank (a list).
        timeout: seconds before the whole process group is killed.
        env: environment (default os.environ); the repo root is prepended
            to its PYTHONPATH.
        launcher_args: launcher flags placed before -np.
        cwd: working directory (default the repo root).
        prefix: argv put before the launcher's (e.g. a namespace to run
            it in); it must exec the launcher.

    Returns:
        A subprocess.CompletedProcess; `stdout` holds stdout and stderr
        together as text.

    Raises:
        AssertionError: the launcher ran past `timeout`; the message holds
            the output so far.
    """
    argv = [*prefix, sys.executable, "-m", "kerasdist.run", *launcher_args,
            *([] if np is None else ["-np", str(np)]), *args]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=launcher_env(env),
        cwd=REPO_ROOT if cwd is None else cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out = "(no output: the pipe stayed open after the kill)"
        raise AssertionError(
            f"launcher timed out after {timeout} s: {argv}\n"
            f"--- output so far ---\n{out}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def _kill_tree(proc):
    # The launcher's own session holds the launcher only: mpiexec runs in a
    # session of its own, so end it gracefully first, then kill the group.
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=25)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def rank_lines(output, rank, stream="stdout"):
    """Returns the lines `[rank]<stream>:...` of `output`, prefix stripped."""
    lines = []
    for line in output.splitlines():
        m = _PREFIX_RE.match(line)
        if m and int(m.group(1)) == rank and m.group(2) == stream:
            lines.append(m.group(3))
    return lines
