"""A worker's named checks (tests/support/checks.py) as pytest tests.

    from tests.support.worker_checks import WorkerChecks

    NP2 = WorkerChecks("keras_optimizer_worker.py", np=2,
                       groups=("equiv", "math"))
    np2_job = NP2.fixture("np2_job")

    @NP2.parametrize
    def test_optimizer_np2(check, np2_job):
        np2_job.assert_passed(check)

One test per check, named after it (`pytest -k fit_adam`). The names are
read from the worker's source at collection (no TensorFlow import). The
module-scoped fixture launches the worker once, with `--only` every check
of its tests that the session selected, and each test asserts its own
check's result on every rank.

Many jobs of one worker (sizes, modes), one test function each::

    add_job_tests(globals(), {
        f"test_jax_{mode}_np{np_}": WorkerChecks(
            "frontend_collectives_worker.py", np=np_, args=("jax", mode))
        for mode in ("eager", "jit") for np_ in (1, 2)})

gives tests `test_jax_eager_np2[allreduce]`, ..., one launch per job.
"""

import json
import os
import sys

import pytest

from tests.support import checks
from tests.support.helpers import WORKERS
from tests.support.helpers import launch
from tests.support.helpers import worker_env


class WorkerChecks:
    """The checks of one worker (in tests/workers) run at one size.

    Args:
        script: the worker's file name in tests/workers.
        np: the number of ranks.
        groups: only the checks of these groups (default: all).
        args: the worker's own arguments; "{tmp}" in one is replaced by a
            fresh directory for the job.
        timeout: seconds for the launch.
        env: extra environment variables for the ranks.
        launcher_args: flags for `kerasdist run`.
        requires: modules the job needs (the tests skip without them).
        fast: the checks whose tests are marked `fast` (`make test-fast`):
            True for every one, or a tuple of names (False: none).
    """

    def __init__(self, script, np, groups=None, args=(), timeout=400,
                 env=None, launcher_args=(), requires=(), fast=()):
        self.path = os.path.join(WORKERS, script)
        self.np, self.args, self.timeout = np, tuple(args), timeout
        self.env, self.launcher_args = dict(env or {}), tuple(launcher_args)
        self.requires = tuple(requires)
        self.names = [n for n, _ in checks.check_names(self.path, groups)]
        if not self.names:
            raise ValueError(f"{script}: no checks in groups {groups}")
        self.fast = set(self.names if fast is True else fast or ())
        if self.fast - set(self.names):
            raise ValueError(f"{script}: fast checks "
                             f"{sorted(self.fast - set(self.names))} are "
                             f"not among {self.names}")

    @property
    def parametrize(self):
        """Parametrises a test over this worker's check names ("check")."""
        return pytest.mark.parametrize("check", [
            pytest.param(n, id=n, marks=[pytest.mark.fast] * (n in self.fast))
            for n in self.names])

    def fixture(self, name):
        """A module-scoped fixture called `name` (assign it to that module
        attribute) that runs the job once and returns its Job."""
        def job(request, tmp_path_factory):
            for module in self.requires:
                pytest.importorskip(module)
            wanted = set()
            for item in request.session.items:
                if (name in getattr(item, "fixturenames", ())
                        and item.path == request.path
                        and hasattr(item, "callspec")):
                    wanted.add(item.callspec.params.get("check"))
            selected = [n for n in self.names if n in wanted] or self.names
            tmp = tmp_path_factory.mktemp(name)
            results = tmp / "results"
            results.mkdir()
            args = [a.replace("{tmp}", str(tmp)) for a in self.args]
            argv = [sys.executable, self.path, *args,
                    "--only", ",".join(selected), "--results", str(results)]
            out = launch(self.np, argv, timeout=self.timeout,
                         env=worker_env(**self.env),
                         launcher_args=self.launcher_args)
            return Job(out, results, self.np, selected, tmp)
        job.__name__ = name
        return pytest.fixture(scope="module", name=name)(job)


class Job:
    """One launch of a worker: its output and every rank's results."""

    def __init__(self, out, results_dir, np, selected, directory):
        self.out, self.np, self.selected = out, np, selected
        self.directory = directory  # the job's "{tmp}"
        self.ranks = {}
        for r in range(np):
            path = os.path.join(results_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    self.ranks[r] = json.load(f)

    def _tail(self):
        return (f"exit code {self.out.returncode}; output:\n"
                + self.out.stdout[-6000:])

    def _passed(self, rank, check):
        got = self.ranks.get(rank, {}).get("results", {}).get(check)
        return bool(got and got["passed"])

    def assert_passed(self, check):
        """Fails unless every rank ran `check` and it passed; also when every
        selected check passed but the job still failed."""
        assert check in self.selected, f"{check} was not run in this job"
        for r in range(self.np):
            rec = self.ranks.get(r)
            if rec is None:
                pytest.fail(f"rank {r} wrote no results\n{self._tail()}")
            got = rec["results"].get(check)
            if got is None:
                failed = [n for n, v in rec["results"].items()
                          if not v["passed"]]
                why = (f"the rank stopped at failed check {failed[0]}"
                       if failed else "the rank stopped before it")
                pytest.fail(f"rank {r} did not run {check}: {why}\n"
                            f"{self._tail()}")
            if not got["passed"]:
                pytest.fail(f"rank {r}: check {check} failed:\n"
                            f"{got['error']}\n{self._tail()}")
        everything = all(self._passed(r, c) for r in range(self.np)
                         for c in self.selected)
        finished = all(self.ranks[r].get("done") for r in range(self.np))
        if everything and (self.out.returncode != 0 or not finished):
            pytest.fail(f"every check passed but the job failed\n"
                        f"{self._tail()}")

    def rank_output(self, rank, stream="stdout"):
        """The lines rank `rank` printed, prefix stripped."""
        from tests.support.helpers import rank_lines
        return rank_lines(self.out.stdout, rank, stream)


def add_job_tests(namespace, jobs, marks=()):
    """For each `test_name: WorkerChecks` in `jobs`, adds to `namespace` (a
    test module's globals()) a module-scoped fixture that launches that job
    once and a test `test_name`, parametrised over the job's checks, that
    asserts its check passed on every rank; `marks` (pytest marks) apply
    to those tests."""
    for test_name, job in jobs.items():
        if not test_name.startswith("test_"):
            raise ValueError(f"{test_name!r}: test names start with test_")
        fixture = f"{test_name[len('test_'):]}_job"
        namespace[fixture] = job.fixture(fixture)
        test = _job_test(job, fixture, test_name)
        for mark in marks:
            test = mark(test)
        namespace[test_name] = test


def _job_test(job, fixture, test_name):
    # usefixtures puts the fixture in the tests' fixturenames, which is how
    # the fixture finds the checks the session selected.
    @pytest.mark.usefixtures(fixture)
    @job.parametrize
    def test(check, request):
        request.getfixturevalue(fixture).assert_passed(check)
    test.__name__ = test.__qualname__ = test_name
    return test
