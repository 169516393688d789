"""Runs Horovod's own TensorFlow test suite against kerasdist.

    python tools/horovod_suite.py --git HOROVOD_GIT_DIR [--commit REV]
    python tools/horovod_suite.py --checkout HOROVOD_CHECKOUT
        [--file FILE] [--np 2] [--test-timeout 120] [--timeout 2400] [-k EXPR]
        [--kerasdist-root DIR] [--keep DIR] [--json FILE]

Takes Horovod's `test/parallel/test_tensorflow.py` (or `--file`, another of
its test files, e.g. `test/parallel/test_tensorflow_process_sets.py`) with
its helper files
(`test/parallel/base_test_tensorflow.py`, `test/utils/common.py`) from a
checkout or from a git directory at a commit (default HEAD), copies them
into a temporary directory in Horovod's layout, and changes only their
import lines:

    import horovod.tensorflow as hvd
        -> import kerasdist as hvd
    from horovod.tensorflow.util import _executing_eagerly
        -> from tensorflow import executing_eagerly as _executing_eagerly
    from horovod.runner.util.threads import in_thread      (common.py)
        -> the same small function, from a module written next to it
    import mock                                             (common.py)
        -> from unittest import mock

Any other line importing horovod is left as it is and listed. Then it runs
the file with pytest on every rank of `kerasdist run -np NP` (the
kerasdist package of `--kerasdist-root`, default the tree this file is in,
first on PYTHONPATH; build its native libraries first) and prints how many
tests passed, failed and were skipped (most skips are GPU-only tests on a
machine without one), the skip reasons, and each failure's one-line reason.
A test fails if it fails on any rank; the reason is the lowest such rank's.

Per-test timeout: a test that runs longer than `--test-timeout` seconds on
any rank (a rank left waiting in a collective its peer never joins) ends
the job: the launcher's whole process tree is killed, the test is counted
as failed ("timed out"), and a new job runs the tests that did not finish
on every rank. A rank that dies is handled the same way. (The ranks run
with KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS=0 unless it is set, so that
the core does not end the runtime under the tests that follow one that
waits.) `--timeout` bounds the whole run (every job); what did not run by
then is counted as failed ("not run").

Between tests a small pytest plugin restarts kerasdist's numbering of
unnamed eager collectives (the ranks match those by call order), so that
one test that fails on one rank only does not leave the ranks' numbering
apart for every later test; `--no-name-reset` turns that off.

`--json FILE` writes every test's outcome and reason. `--keep DIR` keeps
the copied files, the per-rank records and each job's output in DIR.
Not part of CI: it needs a Horovod source tree, and runs for minutes.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEST_FILE = "test/parallel/test_tensorflow.py"
HELPER_FILES = ("test/parallel/base_test_tensorflow.py",
                "test/utils/common.py")
EXIT_GRACE_S = 60  # for a job to end once every rank finished its tests

# (pattern of a whole line, replacement); indentation is kept.
IMPORTS = [
    (r"import horovod\.tensorflow as hvd", "import kerasdist as hvd"),
    (r"from horovod\.tensorflow\.util import _executing_eagerly",
     "from tensorflow import executing_eagerly as _executing_eagerly"),
    (r"from horovod\.runner\.util\.threads import in_thread",
     "from kd_suite_compat import in_thread"),
    (r"import mock", "from unittest import mock"),
    (r"from horovod\.runner\.common\.util\.env import get_env_rank_and_size",
     "from kd_suite_compat import get_env_rank_and_size"),
    # test_tensorflow2_keras.py (it also needs `pip install parameterized`)
    (r"import horovod\.tensorflow\.keras as hvd", "import kerasdist as hvd"),
    (r"import horovod\.keras as hvd_keras", "import kerasdist as hvd_keras"),
    (r"from horovod\.common\.util import is_version_greater_equal_than",
     "from kd_suite_compat import is_version_greater_equal_than"),
]

COMPAT = '''"""What Horovod's test files imported from Horovod's runner."""
import os
import threading


def get_env_rank_and_size():
    """(rank, size) from the launcher's environment, before init."""
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
    return 0, 1


def is_version_greater_equal_than(ver, target):
    from packaging import version
    return version.parse(ver) >= version.parse(target)


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    if not isinstance(args, tuple):
        raise ValueError("args must be a tuple")

    def run():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
'''

# The pytest plugin every rank loads: one JSON line per event in
# $KD_SUITE_RECORDS/rank<r>.jsonl; $KD_SUITE_SELECT (a file of node ids)
# restricts the run to those tests.
PLUGIN = r'''
import json, os, time

_rank = None
_out = None


def _rank_of():
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def _write(**event):
    global _out, _rank
    if _out is None:
        _rank = _rank_of()
        path = os.path.join(os.environ["KD_SUITE_RECORDS"],
                            f"rank{_rank}.jsonl")
        _out = open(path, "a", buffering=1)
    event["t"] = time.time()
    _out.write(json.dumps(event) + "\n")
    _out.flush()


def _line(text):
    text = str(text).strip()
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def _reason(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        return _line(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return _line(crash.message)
    return _line(report.longrepr)


def pytest_collection_modifyitems(session, config, items):
    select = os.environ.get("KD_SUITE_SELECT")
    if select:
        with open(select) as f:
            wanted = set(line.strip() for line in f if line.strip())
        items[:] = [i for i in items if i.nodeid in wanted]


def pytest_collection_finish(session):
    _write(event="collected", tests=[i.nodeid for i in session.items])


def pytest_sessionfinish(session, exitstatus):
    _write(event="session_done")


def pytest_collectreport(report):
    if report.failed:
        _write(event="collect_error", where=report.nodeid,
               reason=_reason(report))


def pytest_runtest_setup(item):
    if os.environ.get("KD_SUITE_NAME_RESET") == "1":
        try:
            from kerasdist._core import host
            with host._lock:
                host._counters.clear()
        except Exception:
            pass


def pytest_runtest_logstart(nodeid, location):
    _write(event="start", test=nodeid)


def pytest_runtest_logreport(report):
    _write(event="report", test=report.nodeid, when=report.when,
           outcome=report.outcome, reason=_reason(report)
           if report.outcome != "passed" else "")


def pytest_runtest_logfinish(nodeid, location):
    _write(event="finish", test=nodeid)
'''


def read_sources(args):
    """{path: text} of the test file (--file) and HELPER_FILES, from the
    checkout or the git directory."""
    out = {}
    for path in (args.file,) + HELPER_FILES:
        if args.checkout:
            with open(os.path.join(args.checkout, path)) as f:
                out[path] = f.read()
        else:
            out[path] = subprocess.run(
                ["git", f"--git-dir={args.git}", "show",
                 f"{args.commit}:{path}"],
                check=True, capture_output=True, text=True).stdout
    return out


def rewrite_imports(text):
    """`text` with the import lines of IMPORTS replaced; also the lines
    that still import horovod."""
    lines, left = [], []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        ending = line[len(body):]
        indent = body[:len(body) - len(body.lstrip())]
        for pattern, replacement in IMPORTS:
            if re.fullmatch(r"\s*" + pattern + r"\s*", body):
                body = indent + replacement
                break
        if re.match(r"\s*(import|from)\s+horovod\b", body):
            left.append(body.strip())
        lines.append(body + ending)
    return "".join(lines), left


def prepare(args, work):
    """Writes the rewritten suite, the compat module and the plugin under
    `work`; returns the lines that still import horovod."""
    left = []
    for path, text in read_sources(args).items():
        new, still = rewrite_imports(text)
        left += [f"{path}: {s}" for s in still]
        dest = os.path.join(work, path)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "w") as f:
            f.write(new)
    plugins = os.path.join(work, "plugins")
    os.makedirs(plugins, exist_ok=True)
    with open(os.path.join(plugins, "kd_suite_compat.py"), "w") as f:
        f.write(COMPAT)
    with open(os.path.join(plugins, "kd_suite_plugin.py"), "w") as f:
        f.write(PLUGIN)
    return left


class Records:
    """Every rank's events so far, read from the plugin's files."""

    def __init__(self, directory, np_):
        self.directory, self.np = directory, np_
        self.events = {r: [] for r in range(np_)}
        self._offsets = {r: 0 for r in range(np_)}

    def poll(self):
        for r in range(self.np):
            path = os.path.join(self.directory, f"rank{r}.jsonl")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self._offsets[r])
                data = f.read()
            complete = data[:data.rfind("\n") + 1]
            self._offsets[r] += len(complete)
            for line in complete.splitlines():
                if line.strip():
                    self.events[r].append(json.loads(line))

    def collected(self):
        for r in range(self.np):
            for e in self.events[r]:
                if e["event"] == "collected":
                    return e["tests"]
        return None

    def all_done(self):
        """The time by which every rank had finished its pytest session,
        or None."""
        times = []
        for r in range(self.np):
            done = [e["t"] for e in self.events[r]
                    if e["event"] == "session_done"]
            if not done:
                return None
            times.append(done[0])
        return max(times)

    def collect_errors(self):
        return [e for r in range(self.np) for e in self.events[r]
                if e["event"] == "collect_error"]

    def running(self):
        """{rank: (test, start time)} of tests started and not finished."""
        out = {}
        for r in range(self.np):
            current = None
            for e in self.events[r]:
                if e["event"] == "start":
                    current = (e["test"], e["t"])
                elif e["event"] == "finish":
                    current = None
            if current:
                out[r] = current
        return out

    def finished(self, rank):
        return {e["test"] for e in self.events[rank]
                if e["event"] == "finish"}

    def reports(self, test):
        """{rank: [report events]} for `test`."""
        return {r: [e for e in self.events[r]
                    if e["event"] == "report" and e["test"] == test]
                for r in range(self.np)}


def rank_outcome(reports):
    """(outcome, reason) of one rank's reports for one test."""
    for rep in reports:
        if rep["outcome"] == "failed":
            return "failed", f"{rep['reason']}" + (
                f" (in {rep['when']})" if rep["when"] != "call" else "")
    for rep in reports:
        if rep["outcome"] == "skipped":
            return "skipped", rep["reason"]
    if any(rep["when"] == "call" and rep["outcome"] == "passed"
           for rep in reports):
        return "passed", ""
    return None, ""


def combine(test, records, np_):
    """(outcome, reason) of `test` over every rank, or (None, '') when some
    rank has not finished it."""
    per_rank = {r: rank_outcome(reps)
                for r, reps in records.reports(test).items()}
    for r in range(np_):
        if per_rank[r][0] == "failed":
            return "failed", f"rank {r}: {per_rank[r][1]}"
    if any(test not in records.finished(r) for r in range(np_)):
        return None, ""
    if any(o == "skipped" for o, _ in per_rank.values()):
        reason = next(why for o, why in per_rank.values() if o == "skipped")
        return "skipped", reason
    if all(o == "passed" for o, _ in per_rank.values()):
        return "passed", ""
    return "failed", "no result on some rank"


def kill_tree(proc):
    sys.path.insert(0, REPO_ROOT)
    from kerasdist.run import _rank
    roots = (proc.pid,) if proc.poll() is None else ()
    _rank.kill_job(roots=roots, sessions=(proc.pid,))


def run_job(args, work, job, select, deadline):
    """One `kerasdist run` of the suite (the tests in `select`, or all).
    Returns (records, why it ended: "done", "timeout" with the blamed test,
    "exit", "deadline")."""
    records_dir = os.path.join(work, "records", f"job{job}")
    os.makedirs(records_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [args.kerasdist_root, os.path.join(work, "plugins")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # A test left waiting is ended by the per-test timeout, and the tests
    # after it run in a fresh job; the core's deadlock shutdown would end
    # the runtime under the later tests of this one.
    env.setdefault("KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS", "0")
    env["KD_SUITE_RECORDS"] = records_dir
    env["KD_SUITE_NAME_RESET"] = "0" if args.no_name_reset else "1"
    env.pop("KD_SUITE_SELECT", None)
    if select is not None:
        path = os.path.join(records_dir, "select.txt")
        with open(path, "w") as f:
            f.write("\n".join(select) + "\n")
        env["KD_SUITE_SELECT"] = path
    parallel = os.path.join(work, "test", "parallel")
    argv = [sys.executable, "-m", "kerasdist.run", "-np", str(args.np),
            sys.executable, "-m", "pytest", "-p", "kd_suite_plugin",
            "-p", "no:cacheprovider", "-q", "--rootdir", parallel,
            os.path.basename(args.file)]
    if args.k and select is None:
        argv += ["-k", args.k]
    log_path = os.path.join(work, "logs", f"job{job}.txt")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    records = Records(records_dir, args.np)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env,
                                cwd=parallel, start_new_session=True)
        try:
            while True:
                time.sleep(0.5)
                records.poll()
                if proc.poll() is not None:
                    time.sleep(0.5)
                    records.poll()
                    return records, ("exit", proc.returncode)
                now = time.time()
                if now > deadline:
                    return records, ("deadline", None)
                done = records.all_done()
                if done is not None and now - done > EXIT_GRACE_S:
                    # Every rank finished its tests but the job does not
                    # end (a rank waiting at shutdown): end it.
                    return records, ("exit", "killed after the tests")
                running = records.running()
                late = [(t, start, r) for r, (t, start) in running.items()
                        if now - start > args.test_timeout]
                if late:
                    order = records.collected() or []
                    late.sort(key=lambda x: order.index(x[0])
                              if x[0] in order else len(order))
                    stuck = sorted(r for t, _, r in late if t == late[0][0])
                    return records, ("timeout", (late[0][0], stuck))
        finally:
            if proc.poll() is None:
                kill_tree(proc)
                proc.wait()
            else:
                kill_tree(proc)


def run_suite(args, work):
    deadline = time.time() + args.timeout
    results, order, select, job = {}, None, None, 0
    collect_errors = []
    while True:
        records, (why, detail) = run_job(args, work, job, select, deadline)
        job += 1
        collected = records.collected()
        if order is None:
            order = collected
            collect_errors = records.collect_errors()
            if not order:
                return None, collect_errors, job
        pending = select if select is not None else order
        for test in pending:
            outcome, reason = combine(test, records, args.np)
            if outcome is not None:
                results[test] = (outcome, reason)
        if why == "timeout":
            test, ranks = detail
            if test not in results:
                results[test] = ("failed", f"timed out after "
                                 f"{args.test_timeout:g} s on rank(s) "
                                 f"{', '.join(map(str, ranks))}")
        elif why == "exit":
            for r, (test, _) in records.running().items():
                if test not in results:
                    results[test] = ("failed", f"rank {r} ended (exit code "
                                     f"{detail}) in this test")
        remaining = [t for t in order if t not in results]
        if not remaining:
            return [(t,) + results[t] for t in order], collect_errors, job
        if why == "deadline" or time.time() > deadline:
            for t in remaining:
                results[t] = ("failed", f"not run: the whole run passed "
                              f"{args.timeout:g} s")
            return [(t,) + results[t] for t in order], collect_errors, job
        if why == "exit" and not records.running() and select == remaining:
            # The job ended without starting a test it was given.
            for t in remaining:
                results[t] = ("failed", f"not run: the job ended with exit "
                              f"code {detail} before it")
            return [(t,) + results[t] for t in order], collect_errors, job
        select = remaining


def summarize(rows, collect_errors, left, jobs, seconds):
    lines = []
    if left:
        lines.append("lines still importing horovod (left as they are):")
        lines += [f"  {s}" for s in left]
    if collect_errors:
        lines.append("collection errors:")
        seen = sorted({(e["where"], e["reason"]) for e in collect_errors})
        lines += [f"  {where}: {why}" for where, why in seen]
    if rows is None:
        lines.append("the suite collected no test.")
        return "\n".join(lines)
    counts = {}
    for _, outcome, _ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    skips = {}
    for _, outcome, reason in rows:
        if outcome == "skipped":
            skips[reason] = skips.get(reason, 0) + 1
    lines.append(f"{len(rows)} tests in {jobs} job(s), {seconds:.0f} s: "
                 f"{counts.get('passed', 0)} passed, "
                 f"{counts.get('failed', 0)} failed, "
                 f"{counts.get('skipped', 0)} skipped")
    if skips:
        lines.append("skipped:")
        lines += [f"  {n:3d} x {why}" for why, n in
                  sorted(skips.items(), key=lambda kv: -kv[1])]
    failed = [(t, why) for t, outcome, why in rows if outcome == "failed"]
    if failed:
        lines.append("failed:")
        lines += [f"  {t.split('::')[-1]}: {why}" for t, why in failed]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--git", help="a Horovod git directory")
    src.add_argument("--checkout", help="a Horovod source tree")
    p.add_argument("--commit", default="HEAD",
                   help="the commit of --git (default HEAD)")
    p.add_argument("--file", default=TEST_FILE,
                   help="the test file, relative to Horovod's root "
                        f"(default {TEST_FILE})")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--test-timeout", type=float, default=120.0,
                   help="seconds one test may run on a rank")
    p.add_argument("--timeout", type=float, default=2400.0,
                   help="seconds for the whole run")
    p.add_argument("-k", default="", help="pytest -k expression")
    p.add_argument("--kerasdist-root", default=REPO_ROOT,
                   help="the directory holding the kerasdist package to "
                        "test (default: this tree)")
    p.add_argument("--no-name-reset", action="store_true")
    p.add_argument("--keep", help="keep the work files in this directory")
    p.add_argument("--json", help="write every test's outcome here")
    args = p.parse_args(argv)
    args.kerasdist_root = os.path.abspath(args.kerasdist_root)
    if args.keep:
        work = os.path.abspath(args.keep)
        if os.path.exists(work):
            sys.exit(f"--keep {work}: exists already; give a new directory")
        os.makedirs(work)
    else:
        work = tempfile.mkdtemp(prefix="horovod_suite_")
    start = time.time()
    try:
        left = prepare(args, work)
        rows, errors, jobs = run_suite(args, work)
        print(summarize(rows, errors, left, jobs, time.time() - start))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tests": [{"test": t, "outcome": o, "reason": w}
                                     for t, o, w in rows or []],
                           "collect_errors": errors}, f, indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if rows is not None else 1


if __name__ == "__main__":
    sys.exit(main())
