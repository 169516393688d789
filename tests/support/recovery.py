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
