"""What the recovery-in-place tests (tests/cluster/test_recovery*.py)
share: tests/workers/recovery_worker.py's data and step as a module, its
training in numpy (the truth), and the JSON files its ranks write."""

import importlib.util
import json
import os

from tests.support.helpers import WORKERS


def worker_module(name="recovery_worker"):
    """tests/workers/<name>.py, imported (its data and step)."""
    path = os.path.join(WORKERS, name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sgd(m, w, first, last, size):
    """The worker `m`'s steps first..last-1 at `size` ranks, in numpy,
    from the weights `w`."""
    x, y = m.data()
    for step in range(first, last):
        g = sum(m.gradient(w, x, y, m.rows_for(step, r, size))
                for r in range(size)) / size
        w = w - m.LR * g
    return w


def read_json(directory, name):
    """The JSON file `name` a rank wrote in `directory`."""
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def grown_ends(out, directory, why):
    """The end.<rank>.json of the 3 ranks of a job that grew from 2 to 3
    ranks in place (rank 0 said so, `why` its reason, in `out`, the
    launcher's output, with no second attempt), after checking that
    ranks 0 and 1 kept their processes and rank 2 started at 3 ranks."""
    assert out.returncode == 0, out.stdout
    assert (f"grew in place to 3 rank(s) (was 2; {why}): the new ranks "
            f"started in " in out.stdout), out.stdout
    assert "attempt 2" not in out.stdout, out.stdout
    assert read_json(directory, "asked.json")["heard"], out.stdout
    ends = [read_json(directory, f"end.{rank}.json") for rank in range(3)]
    commit = ends[0]["resumed"][0]
    for rank, end in enumerate(ends):
        start = read_json(directory, f"start.{rank}.json")
        assert (end["pid"], end["rank"], end["size"]) == (
            start["pid"], rank, 3), (start, end)
        assert start["size"] == (2 if rank < 2 else 3), start
        assert end["resumed"] == ([commit] if rank < 2 else []), end
    return ends


def check_survivors(directory, survivors, kill_step, steps, every):
    """After a rank lost at `kill_step` (of `steps`, a commit every
    `every`): each of `survivors` (start ranks, in order) kept its process,
    is now rank i of len(survivors), resumed once from the last commit,
    and holds numpy's weights for that commit (made at 3 ranks) continued
    at the smaller size. Returns the commit's step."""
    import numpy as np
    commit = kill_step // every * every
    m = worker_module()
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 3), commit,
                steps, len(survivors))
    for new_rank, rank in enumerate(survivors):
        start = read_json(directory, f"start.{rank}.json")
        end = read_json(directory, f"end.{rank}.json")
        assert (start["size"], end["pid"], end["rank"], end["size"],
                end["resumed"]) == (3, start["pid"], new_rank,
                                    len(survivors), [commit]), (start, end)
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
    return commit
