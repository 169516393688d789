"""`kerasdist.run(fn, np=...)`: Horovod's `horovod.run`, on `kerasdist run`.

The launching process pickles `(fn, args, kwargs)` (cloudpickle, so a
function defined in a script travels by value), starts
`python -m kerasdist.run -np N [-H ...] python -m kerasdist.run.function
PAYLOAD` and passes the job's output through. Every rank unpickles the
call, runs it and writes its pickled result on stdout as marked lines of
32 KiB (a result of any size: a trained model's weights, a history); the
launcher prefixes them with the rank, and this process takes those lines
out of the output, joins them and returns the results in rank order. No
file is shared between hosts unless the call is too large for a command
line.

Standard library only (cloudpickle when installed), like the rest of the
launcher; never imports a framework.
"""

import base64
import hashlib
import hmac
import inspect
import os
import pickle
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile

__all__ = ["run"]

# Marks a rank's result in its stdout; a line may hold output before it
# (the function's last print without a newline).
_MARKER = "\x1ekerasdist-run-result:"
_PREFIXED = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")
# A random key per call, handed to the ranks in their environment only:
# the call and each result carry its HMAC and are unpickled only when it
# holds, so neither a file in the shared directory nor a line another
# program printed into a rank's output can run code here or on a rank.
_KEY_ENV = "KERASDIST_RUN_FUNCTION_KEY"
# A result travels as lines of at most this many characters, each marked
# `<index>/<count>:`: the launcher's rank wrapper passes output on in
# pieces of 64 KiB, and a longer line would be cut by another rank's.
_RESULT_LINE = 32 * 1024
# At most this many lines a result (32 GiB): a count above it in a line a
# program printed is not a result's, and nothing is allocated from it.
_RESULT_LINES_MOST = 2**20
# Payloads up to this many base64 characters travel on the command line
# (Linux takes 128 KiB per argument); larger ones in a file.
_ARGV_LIMIT = 64 * 1024


def _dumps(obj, what):
    try:
        import cloudpickle as pickler
    except ImportError:  # pragma: no cover
        pickler = pickle
    try:
        return pickler.dumps(obj)
    except Exception as e:
        hint = ("" if pickler is not pickle else
                " (pip install cloudpickle to send functions defined in a "
                "script or a notebook)")
        raise TypeError(f"kerasdist.run: cannot pickle {what}: "
                        f"{type(e).__name__}: {e}{hint}.") from None


def _sign(key, encoded):
    """`encoded` (base64 text) preceded by its HMAC-SHA256 under `key`."""
    mac = hmac.new(key, encoded.encode(), hashlib.sha256).hexdigest()
    return f"{mac}.{encoded}"


def _unpickle(key, signed, what):
    """The object in `signed` (from `_sign`), if its HMAC holds."""
    mac, _, encoded = signed.partition(".")
    want = hmac.new(key, encoded.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, want):
        raise RuntimeError(f"kerasdist.run: {what} does not carry this "
                           "call's key (not written by it); refused.")
    return pickle.loads(base64.b64decode(encoded))


def _check_np(np, num_proc):
    if np is not None and num_proc is not None and np != num_proc:
        raise ValueError(f"kerasdist.run: np={np!r} and num_proc="
                         f"{num_proc!r} disagree; give one of them.")
    n = np if np is not None else num_proc
    if (not isinstance(n, int) or isinstance(n, bool)) or n < 1:
        raise ValueError("kerasdist.run: np (Horovod's num_proc) must be a "
                         f"positive int, the number of ranks; got {n!r}.")
    return n


def _horovod_args(min_np=None, max_np=None, reset_limit=None,
                  start_timeout=None, ssh_port=None, ssh_identity_file=None,
                  network_interface=None, use_gloo=None, use_mpi=None,
                  slots=None, cooldown_range=None, output_filename=None,
                  mpi_args=None, disable_cache=None):
    """`horovod.run`'s arguments as `kerasdist run` flags and rank
    variables: (flags, env). An argument kerasdist has no meaning for is
    refused with one line saying what to do instead."""
    refused = {
        "use_gloo": (use_gloo, "kerasdist has no Gloo controller: its "
                     "ranks meet and reduce over MPI; drop use_gloo"),
        "slots": (slots, "give each host's slots in hosts "
                  "('host1:4,host2:4') or the hostfile"),
        "cooldown_range": (cooldown_range, "kerasdist keeps no list of "
                           "failed hosts to cool down; drop it"),
        "output_filename": (output_filename, "the ranks' output comes to "
                            "this process's stdout, each line prefixed "
                            "with its rank; redirect it"),
        "mpi_args": (mpi_args, "kerasdist run builds the mpiexec command "
                     "itself; set the MPI's own variables in env instead"),
    }
    for name, (value, what) in refused.items():
        if value:
            raise ValueError(f"kerasdist.run: {name}={value!r} is not "
                             f"supported: {what}.")
    if use_mpi is not None and not use_mpi:
        raise ValueError("kerasdist.run: use_mpi=False is not supported: "
                         "kerasdist's ranks always run over MPI; drop it.")
    flags, env = [], {}
    for flag, value in (("--min-np", min_np), ("--max-np", max_np),
                        ("--max-restarts", reset_limit),
                        ("--network-interface", network_interface)):
        if value is not None:
            flags += [flag, str(value)]
    if ssh_port is not None or ssh_identity_file is not None:
        ssh = ["ssh"]
        if ssh_port is not None:
            ssh += ["-p", str(int(ssh_port))]
        if ssh_identity_file is not None:
            ssh += ["-i", os.fspath(ssh_identity_file)]
        flags += ["--ssh-command", shlex.join(ssh)]
    if start_timeout is not None:
        env["KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"] = str(start_timeout)
    return flags, env


def run(fn, args=(), kwargs=None, np=None, hosts=None, hostfile=None,
        env=None, executable=None, verbose=False, launcher_args=(),
        num_proc=None, **horovod):
    """Runs `fn(*args, **kwargs)` on `np` ranks and returns their results.

    Horovod's `horovod.run(fn, args, kwargs, num_proc=..., hosts=...)`:
    `fn` runs in `np` new processes started by `kerasdist run` (with its
    CPU binding, fail-fast teardown and output prefixes), and calls
    `kerasdist.init()` itself, as any rank script does. The ranks' output
    is passed through as the launcher prints it.

    Args:
        fn: the function to run on every rank. It is pickled with
            cloudpickle, so functions defined in a script (`main`) or a
            notebook travel by value; the modules it imports must be
            importable on every host.
        args: positional arguments for `fn` (pickled with it).
        kwargs: keyword arguments for `fn`.
        np: the number of ranks (Horovod's `num_proc`, also accepted).
        hosts: "host1:slots,host2:slots", as `kerasdist run -H`.
        hostfile: a hostfile, as `kerasdist run --hostfile`.
        env: variables to set for the ranks, on top of this process's
            environment.
        executable: the Python the ranks run (default: this one).
        verbose: `kerasdist run --verbose`.
        launcher_args: more `kerasdist run` flags, e.g.
            `["--bind-to", "none"]`.
        num_proc: Horovod's name for `np`.
        **horovod: the rest of `horovod.run`'s arguments: `min_np`,
            `max_np` and `reset_limit` (`--min-np`, `--max-np`,
            `--max-restarts`), `network_interface`
            (`--network-interface`), `ssh_port` and `ssh_identity_file`
            (`--ssh-command "ssh -p PORT -i FILE"`), `start_timeout` (the
            seconds the ranks have to meet,
            KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS), `use_mpi=True` and
            `use_gloo=False` (what kerasdist does anyway), `disable_cache`
            (kerasdist caches nothing between runs). `use_gloo=True`,
            `use_mpi=False`, `slots`, `cooldown_range`, `output_filename`
            and `mpi_args` are refused with one line each saying what to
            do instead.

    Returns:
        A list of `size()` values: rank r's return value at index r.

    Raises:
        ValueError: for a missing or bad `np`, both `hosts` and
            `hostfile`, or a refused Horovod argument.
        TypeError: if `fn`, its arguments or a rank's result cannot be
            pickled.
        RuntimeError: if the job fails (a rank raised or died): the
            ranks' output above it says why.

    Example:
    >>> import kerasdist as kd
    >>> def work(scale):
    ...     kd.init()
    ...     return kd.rank() * scale
    >>> kd.run(work, args=(10,), np=2)
    [0, 10]
    """
    n = _check_np(np, num_proc)
    unknown = sorted(set(horovod) - set(
        inspect.signature(_horovod_args).parameters))
    if unknown:
        raise TypeError(f"kerasdist.run: unknown argument(s) "
                        f"{', '.join(unknown)}.")
    horovod_flags, horovod_env = _horovod_args(**horovod)
    if not callable(fn):
        raise TypeError(f"kerasdist.run: fn must be callable; got "
                        f"{type(fn).__name__}.")
    if hosts is not None and hostfile is not None:
        raise ValueError("kerasdist.run: give hosts or hostfile, not both.")
    if "--no-prefix" in launcher_args:
        raise ValueError("kerasdist.run: launcher_args cannot hold "
                         "--no-prefix: the results are told apart by the "
                         "ranks' prefixes.")
    key = secrets.token_bytes(32)
    payload = _sign(key, base64.b64encode(
        _dumps((fn, tuple(args), dict(kwargs or {})),
               "the function or its arguments")).decode())
    workdir = None
    if len(payload) > _ARGV_LIMIT:
        # Too long for a command line: a file, which ranks on other hosts
        # see only on a shared file system.
        workdir = tempfile.mkdtemp(prefix="kerasdist-run-")
        path = os.path.join(workdir, "call.b64")
        with open(path, "w") as f:
            f.write(payload)
        payload = "@" + path
    cmd = [sys.executable, "-m", "kerasdist.run", "-np", str(n)]
    if hosts is not None:
        cmd += ["-H", str(hosts)]
    if hostfile is not None:
        cmd += ["--hostfile", os.fspath(hostfile)]
    if verbose:
        cmd.append("--verbose")
    cmd += horovod_flags + [str(a) for a in launcher_args]
    cmd += [executable or sys.executable, "-m", "kerasdist.run.function",
            payload]
    child_env = dict(os.environ, **horovod_env)
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    child_env[_KEY_ENV] = key.hex()
    # The ranks import kerasdist, and the caller's modules that `fn`
    # refers to, from where this process found them.
    package_root = os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))
    script_dir = os.path.abspath(sys.path[0]) if sys.path[0] else os.getcwd()
    extra = [p for p in (script_dir, package_root)
             if p not in child_env.get("PYTHONPATH", "").split(os.pathsep)]
    child_env["PYTHONPATH"] = os.pathsep.join(
        extra + [p for p in [child_env.get("PYTHONPATH")] if p])
    results = {}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=child_env,
                                text=True, errors="replace")
        try:
            for line in proc.stdout:
                line = _take_result(line, results)
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"kerasdist.run: the job failed (exit code "
                           f"{code}); the ranks' output above says why.")
    return _results(key, results, n)


def _results(key, results, n):
    """The n ranks' results from the pieces `_take_result` recorded."""
    missing = [r for r in range(n) if r not in results]
    if missing:
        raise RuntimeError(f"kerasdist.run: rank(s) {missing} returned no "
                           "result although the job succeeded (an "
                           "os._exit in fn?).")
    out = []
    for r in range(n):
        pieces = results[r]
        if None in pieces:
            raise RuntimeError(
                f"kerasdist.run: rank {r}'s result arrived incomplete "
                f"({pieces.count(None)} of its {len(pieces)} lines are "
                "missing); refused.")
        out.append(_unpickle(key, "".join(pieces), f"rank {r}'s result"))
    return out


def _take_result(line, results):
    """Records a piece of a result marked in `line` (a launcher output
    line) in `results[rank]` and returns the rest of the line to print
    ('' for none)."""
    m = _PREFIXED.match(line.rstrip("\n"))
    if not m or _MARKER not in m.group(2):
        return line
    before, _, marked = m.group(2).partition(_MARKER)
    place, _, piece = marked.partition(":")
    index, _, count = place.partition("/")
    if not (index.isdigit() and count.isdigit()
            and int(index) < int(count) <= _RESULT_LINES_MOST):
        return line  # not a piece of a result: printed as it came
    pieces = results.setdefault(int(m.group(1)), [None] * int(count))
    if len(pieces) == int(count):
        pieces[int(index)] = piece.strip()
    return f"[{m.group(1)}]<stdout>:{before}\n" if before else ""


def _rank_main(argv):
    """A rank: runs the pickled call and prints its marked result."""
    if len(argv) != 1:
        sys.exit("usage: python -m kerasdist.run.function PAYLOAD (started "
                 "by kerasdist.run(fn, ...), not by hand)")
    payload = argv[0]
    key = bytes.fromhex(os.environ.pop(_KEY_ENV, ""))
    if not key:
        sys.exit(f"kerasdist.run.function: no {_KEY_ENV} (started by "
                 "kerasdist.run(fn, ...), not by hand)")
    if payload.startswith("@"):
        with open(payload[1:]) as f:
            payload = f.read()
    fn, args, kwargs = _unpickle(key, payload, "the call")
    result = fn(*args, **kwargs)
    signed = _sign(key, base64.b64encode(_dumps(result, "the result"))
                   .decode())
    count = max(1, -(-len(signed) // _RESULT_LINE))
    sys.stdout.flush()
    for i in range(count):
        piece = signed[i * _RESULT_LINE:(i + 1) * _RESULT_LINE]
        sys.stdout.write(f"{_MARKER}{i}/{count}:{piece}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
