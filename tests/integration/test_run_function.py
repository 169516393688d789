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


def test_results_of_any_size_come_back_whole(tmp_path):
    # A trained model's weights: 100 MB from rank 1, and 60 KB (what a
    # single line could not carry) beside a history from rank 0. With
    # Horovod's own arguments, as `horovod.run` examples pass them.
    code, out = _driver(tmp_path, """
        import hashlib, random
        import kerasdist as kd

        def work():
            kd.init()
            size = 100 * 2**20 if kd.rank() == 1 else 60 * 1024
            blob = random.Random(kd.rank()).randbytes(size)
            print("tail without a newline", end="")
            return {"weights": blob, "history": {"loss": [0.5, 0.25]}}

        results = kd.run(work, np=2, use_mpi=True, use_gloo=False,
                         start_timeout=120, disable_cache=True)
        for r, res in enumerate(results):
            size = 100 * 2**20 if r == 1 else 60 * 1024
            want = random.Random(r).randbytes(size)
            print("RANK", r, len(res["weights"]), res["weights"] == want,
                  res["history"])
    """, timeout=300)
    assert code == 0, out[-3000:]
    lines = out.splitlines()
    assert "RANK 0 61440 True {'loss': [0.5, 0.25]}" in lines, out[-3000:]
    assert f"RANK 1 {100 * 2**20} True {{'loss': [0.5, 0.25]}}" in lines, \
        out[-3000:]
    assert "[1]<stdout>:tail without a newline" in lines, out[-3000:]
    assert "kerasdist-run-result" not in out and len(out) < 20000, \
        out[-3000:]


def test_a_result_missing_a_line_is_refused():
    results = {}
    key = b"k" * 32
    for line in ("[0]<stdout>:\x1ekerasdist-run-result:0/3:abc\n",
                 "[0]<stdout>:\x1ekerasdist-run-result:2/3:def\n",
                 "[0]<stdout>:\x1ekerasdist-run-result:9/3:junk\n",
                 "[0]<stdout>:\x1ekerasdist-run-result:0/99999999999:x\n"):
        printed = function._take_result(line, results)
        assert printed == (line if "9/3" in line or "999" in line else ""), \
            printed
    assert results == {0: ["abc", None, "def"]}
    with pytest.raises(RuntimeError, match="rank 0's result arrived "
                       "incomplete \\(1 of its 3 lines are missing\\)"):
        function._results(key, results, 1)


def test_horovods_run_arguments_become_the_launchers_flags():
    flags, env = function._horovod_args(
        min_np=1, max_np=4, reset_limit=2, network_interface="eth1",
        ssh_port=2222, ssh_identity_file="id key", start_timeout=45,
        use_mpi=True, use_gloo=False, disable_cache=True)
    assert flags == ["--min-np", "1", "--max-np", "4", "--max-restarts", "2",
                     "--network-interface", "eth1", "--ssh-command",
                     "ssh -p 2222 -i 'id key'"], flags
    assert env == {"KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS": "45"}
    with pytest.raises(TypeError, match="unknown argument.*use_glo"):
        function.run(print, np=1, use_glo=True)


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
    ({"np": 2, "use_gloo": True}, "use_gloo=True is not supported: "
     "kerasdist has no Gloo controller"),
    ({"np": 2, "use_mpi": False}, "use_mpi=False is not supported"),
    ({"np": 2, "slots": 4}, "slots=4 is not supported: give each host's"),
    ({"np": 2, "cooldown_range": (10, 100)}, "cooldown_range"),
    ({"np": 2, "output_filename": "out"}, "output_filename"),
    ({"np": 2, "mpi_args": "-x FOO"}, "mpi_args='-x FOO' is not supported"),
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
