"""Helpers for tests that run `kerasdist run` as a subprocess.

    from tests.support.helpers import launch, python_cmd, rank_lines

    out = launch(2, python_cmd("print('hi')"), timeout=60)
    assert out.returncode == 0, out.stdout
    assert rank_lines(out.stdout, 1) == ["hi"]

Standard library only; never imports TensorFlow.
"""

import contextlib
import os
import re
import subprocess
import sys
import time

from kerasdist.run import _rank

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
WORKERS = os.path.join(REPO_ROOT, "tests", "workers")

_PREFIX_RE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")


def python_cmd(code):
    """Returns [sys.executable, "-c", code]."""
    return [sys.executable, "-c", code]


def launcher_env(env=None, root=None):
    """Returns `env` (default os.environ) with the repo root (or `root`, a
    directory holding another build of the kerasdist package) first on
    PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = (root or REPO_ROOT) + (os.pathsep + old if old
                                               else "")
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


def worker_env(**extra):
    """os.environ for ranks that run a tests/workers script: the repo root
    first on PYTHONPATH (workers import tests.support), TF quiet unless
    set, then `extra` (values turned into strings; may replace either)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def worker_cmd(name, *args):
    """[python, tests/workers/NAME, *args]."""
    return [sys.executable, os.path.join(WORKERS, name), *args]


def launch(np, args, timeout=300, env=None, launcher_args=(), cwd=None,
           prefix=(), root=None):
    """Runs `python -m kerasdist.run [launcher_args] -np NP ARGS...`.

    Whatever ends the wait early (the timeout, or pytest-timeout's exception
    in the middle of it), the launcher's whole process tree is killed first,
    mpiexec's session and every rank included.

    Args:
        np: number of ranks, or None to give no -np.
        args: the command to run on every rank (a list).
        timeout: seconds before the launcher and every process of its job
            are killed.
        env: environment (default os.environ); the repo root is prepended
            to its PYTHONPATH.
        launcher_args: launcher flags placed before -np.
        cwd: working directory (default `root`, else the repo root).
        prefix: argv put before the launcher's (e.g. a namespace to run
            it in); it must exec the launcher.
        root: a directory whose kerasdist package (another build of it)
            the launcher and the ranks import, first on PYTHONPATH.

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
        env=launcher_env(env, root),
        # `python -m` puts the working directory first on sys.path.
        cwd=cwd or root or REPO_ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as e:
        kill_tree(proc)
        if not isinstance(e, subprocess.TimeoutExpired):
            proc.wait()
            raise
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out = "(no output: the pipe stayed open after the kill)"
        raise AssertionError(
            f"launcher timed out after {timeout} s: {argv}\n"
            f"--- output so far ---\n{out}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def kill_tree(proc):
    """SIGKILLs a process started with start_new_session=True and every
    process of its tree: its descendants, the sessions it and they lead
    (mpiexec's), and their process groups. Returns the pids killed."""
    # A reaped process's pid may have been given to another one: then only
    # its session (whose id stays taken while it has a process) is safe.
    roots = (proc.pid,) if proc.returncode is None else ()
    return _rank.kill_job(roots=roots, sessions=(proc.pid,))


def rank_lines(output, rank, stream="stdout"):
    """Returns the lines `[rank]<stream>:...` of `output`, prefix stripped."""
    lines = []
    for line in output.splitlines():
        m = _PREFIX_RE.match(line)
        if m and int(m.group(1)) == rank and m.group(2) == stream:
            lines.append(m.group(3))
    return lines


def pid_file_code(directory, body):
    """Python code for a rank: it records its pid in DIRECTORY/pid.<rank>,
    then runs `body`, which may use os, sys, time, signal, subprocess, r
    (the rank, an int) and D (the directory)."""
    return (
        "import os, sys, time, signal, subprocess\n"
        "r = int(os.environ['PMI_RANK'])\n"
        f"D = {str(directory)!r}\n"
        "open(os.path.join(D, f'pid.{r}'), 'w').write(str(os.getpid()))\n"
        + body
    )


# A pid_file_code body: the rank starts two children that ignore SIGTERM,
# one in a process group of its own and one in a session of its own (so
# neither a signal to the rank's group nor one to mpiexec's session reaches
# it), records their pids in D/pid.<rank>.group and D/pid.<rank>.session,
# prints "up" and sleeps.
STRAY_CHILDREN = (
    "stray = [sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']\n"
    "for kind, kw in (('group', {'process_group': 0}),\n"
    "                 ('session', {'start_new_session': True})):\n"
    "    p = subprocess.Popen(stray, **kw)\n"
    "    open(os.path.join(D, f'pid.{r}.{kind}'), 'w').write(str(p.pid))\n"
    "print('up', flush=True)\n"
    "time.sleep(600)\n"
)


def recorded_pids(directory):
    """{file name: pid} of the pid.* files pid_file_code's ranks wrote."""
    return {p.name: int(p.read_text())
            for p in sorted(directory.glob("pid.*"))}


def assert_all_gone(directory, within=5, also=()):
    """Asserts that every process recorded by pid_file_code in `directory`,
    and every pid in `also`, has ended (a zombie counts as ended) within
    `within` seconds."""
    pids = recorded_pids(directory)
    assert pids, "no rank recorded its pid"
    pids.update({f"pid {p}": p for p in also})
    deadline = time.monotonic() + within
    while True:
        alive = {n: p for n, p in pids.items() if is_running(p)}
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    assert not alive, f"processes still running: {alive}"


def parent_pid(pid):
    """The parent of live process `pid`, by /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


def is_running(pid):
    """Whether `pid` is a live process (not gone, not a zombie), by /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def free_port():
    """A TCP port on the loopback nobody listens on now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank, size, port, local_rank=None, local_size=None,
                 addr="127.0.0.1", **extra):
    """rank_env() with exactly the variables torchrun gives each process
    (RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT),
    and none of an MPI launcher's."""
    env = rank_env(drop=[k for k in os.environ if k.startswith(
        ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "KERAS_DISTRIBUTION_"))])
    env.update(RANK=rank, WORLD_SIZE=size,
               LOCAL_RANK=rank if local_rank is None else local_rank,
               LOCAL_WORLD_SIZE=size if local_size is None else local_size,
               MASTER_ADDR=addr, MASTER_PORT=port)
    env.update(extra)
    return launcher_env({k: str(v) for k, v in env.items()})


def start_processes(args, envs, delays=None, timeout=120, ended=None):
    """Starts one process of `args` per environment of `envs`, as a
    platform would (no mpiexec): each in a session of its own, process i
    `delays[i]` seconds after the first. Waits for all of them.

    Whatever ends the wait early (the timeout, or pytest-timeout's
    exception), every process's whole tree is killed first. `ended`, a
    list, receives each process's end (time.monotonic(), to 0.05 s).

    Returns:
        [(returncode, stdout and stderr together)] in the order of `envs`.

    Raises:
        AssertionError: they ran past `timeout`; the message holds what
            each printed so far.
    """
    import tempfile
    delays = delays or [0] * len(envs)
    order = sorted(range(len(envs)), key=lambda i: delays[i])
    procs, files = [None] * len(envs), []
    start = time.monotonic()
    try:
        for i in order:
            time.sleep(max(0.0, start + delays[i] - time.monotonic()))
            f = tempfile.TemporaryFile(mode="w+")
            files.append((i, f))
            procs[i] = subprocess.Popen(
                args, stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=envs[i], cwd=REPO_ROOT,
                start_new_session=True)
        deadline = start + timeout
        ends = [None] * len(procs)
        while None in ends:
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.monotonic()
            if None in ends:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, timeout)
                time.sleep(0.05)
        if ended is not None:
            ended[:] = ends
    except BaseException as e:
        for p in procs:
            if p is not None:
                kill_tree(p)
                p.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise AssertionError(
                f"processes ran past {timeout} s: {args}\n" + "\n".join(
                    f"--- process {i} ---\n{_read(f)}"
                    for i, f in sorted(files))) from None
        raise
    finally:
        out = {i: _read(f) for i, f in files}
        for _, f in files:
            f.close()
    for p in procs:
        kill_tree(p)  # what a process left behind (none should)
    return [(p.returncode, out[i]) for i, p in enumerate(procs)]


def _read(f):
    f.flush()
    f.seek(0)
    return f.read()


@contextlib.contextmanager
def without_rank_site_finders():
    """sys.meta_path without tests/support/rank_site's import finders while
    the block runs: jedi (an editor's static analysis, which the tests run
    in-process) resolves modules through sys.meta_path and finds nothing
    through those finders, which a test worker started with the rank site
    first on PYTHONPATH has."""
    saved = list(sys.meta_path)
    sys.meta_path[:] = [f for f in saved
                        if type(f).__module__ != "sitecustomize"]
    try:
        yield
    finally:
        sys.meta_path[:] = saved


def chained_job(worker, np_, mode, root, checks, timeout):
    """One launch of `worker` (tests/workers/) with the arguments `mode`
    and `root`, in a chain of jobs (np2, then np3, then np1) each reading
    what the one before wrote: skipped if the one before failed; every
    rank must pass `checks` in order and end with DONE. Marks `mode` done
    and returns the launch's result."""
    import pytest

    before = {"np3": "np2", "np1": "np3"}.get(mode)
    if before and not (root / f"{before}.ok").exists():
        pytest.skip(f"the {before} job before it failed")
    out = launch(np_, worker_cmd(worker, mode, str(root)), timeout=timeout,
                 env=worker_env())
    assert out.returncode == 0, out.stdout[-6000:]
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        done = [line[3:] for line in lines if line.startswith("OK ")]
        assert done == checks, (r, done, out.stdout[-6000:])
        assert lines[-1] == "DONE", out.stdout[-3000:]
    (root / f"{mode}.ok").write_text("")
    return out
