"""`kerasdist.run(fn, np=...)`, Horovod's `horovod.run`: real launches of a
function defined in a script (so it travels by value), no framework.

Every launch has a timeout that kills the whole tree.
"""

import re
import subprocess
import sys
import textwrap

import pytest

from kerasdist.run import function
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import kill_tree
from tests.support.helpers import launcher_env

pytestmark = pytest.mark.parallel


def _driver(tmp_path, body, timeout=120):
    """Runs `body` as a script (its functions live in __main__)."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(body))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env=launcher_env(), cwd=REPO_ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        proc.wait()
        raise
    return proc.returncode, out


def test_returns_each_ranks_result_in_rank_order(tmp_path):
    code, out = _driver(tmp_path, """
        import kerasdist as kd
        import kerasdist as horovod   # Horovod: import horovod

        def work(scale, offset=0):
            kd.init()
            total = kd.allgather_object(kd.rank())
            print("rank", kd.rank(), "of", kd.size(), end="")
            return kd.rank() * scale + offset, total

        print("RESULT", kd.run(work, args=(10,), kwargs={"offset": 1}, np=2))
        print("HOROVOD", horovod.run(work, args=(1,), num_proc=2))
    """)
    assert code == 0, out
    lines = out.splitlines()
    assert "RESULT [(1, [0, 1]), (11, [0, 1])]" in lines, out
    assert "HOROVOD [(0, [0, 1]), (1, [0, 1])]" in lines, out
    # The ranks' own output passes through, prefixed; the results do not.
    assert lines.count("[1]<stdout>:rank 1 of 2") == 2, out
    assert "kerasdist-run-result" not in out, out


def test_a_failing_rank_raises_after_its_traceback(tmp_path):
    code, out = _driver(tmp_path, """
        import kerasdist as kd

        def work():
            kd.init()
            if kd.rank() == 1:
                raise ValueError("rank one has no data")
            kd.barrier()

        try:
            kd.run(work, np=2)
        except RuntimeError as e:
            print("RAISED", e)
    """)
    assert code == 0, out
    assert "[1]<stderr>:ValueError: rank one has no data" in out, out
    assert ("RAISED kerasdist.run: the job failed (exit code 1); the ranks' "
            "output above says why.") in out, out


@pytest.mark.parametrize("kwargs, message", [
    ({}, "np (Horovod's num_proc) must be a positive int"),
    ({"np": 0}, "np (Horovod's num_proc) must be a positive int"),
    ({"np": 2, "num_proc": 3}, "disagree"),
    ({"np": 2, "hosts": "a:2", "hostfile": "h"}, "not both"),
    ({"np": 2, "launcher_args": ["--no-prefix"]}, "--no-prefix"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        function.run(print, **kwargs)


def test_unpicklable_arguments_say_so():
    import threading
    with pytest.raises(TypeError, match="cannot pickle the function"):
        function.run(print, args=(threading.Lock(),), np=1)


class _Plant:
    """Unpickling it writes a file: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _touch(path):
    with open(path, "w") as f:
        f.write("ran")


def test_a_call_or_result_without_the_calls_key_is_never_unpickled(
        tmp_path):
    # What a rank's output or the shared payload file could carry from
    # elsewhere: a pickle whose unpickling runs code, signed with another
    # key or not at all. Refused before pickle.loads sees it.
    import base64
    import pickle
    ran = tmp_path / "ran"
    encoded = base64.b64encode(pickle.dumps(_Plant(str(ran)))).decode()
    key = b"k" * 32
    for forged in (function._sign(b"x" * 32, encoded), encoded,
                   "0" * 64 + "." + encoded):
        with pytest.raises(RuntimeError, match="does not carry this call's"):
            function._unpickle(key, forged, "rank 0's result")
    assert not ran.exists()
    assert function._unpickle(key, function._sign(key, encoded), "x") is None
    assert ran.read_text() == "ran"  # the signed one is what runs
    # A rank started by hand, without the key, refuses the call.
    out = subprocess.run(
        [sys.executable, "-m", "kerasdist.run.function",
         function._sign(key, encoded)], capture_output=True, text=True,
        env=dict(launcher_env(), **{function._KEY_ENV: ""}), cwd=REPO_ROOT,
        timeout=60)
    assert out.returncode != 0 and "KERASDIST_RUN_FUNCTION_KEY" in \
        out.stderr, out.stderr
