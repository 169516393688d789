"""Loading and saving sharded weights with real ranks
(tests/workers/weights_load_worker.py), on every Keras backend: a sharded
fit saved (`kd.save_model`) and loaded (`kd.load_model(path,
shard="weights")`) at np 2 continues as one uninterrupted process; plain
Keras' files and the np-2 file load sharded at np 3 and replicated and
sharded at np 1, each continuing as plain Keras does; every sharded load
reads each rank's slices of the weights and slots only (h5py's reads
counted), and `model.load_weights` of a `.weights.h5` does too;
`kd.save_model` writes each weight as it gathers it, never the whole
model at once.

One launch a size; each reads what the one before wrote, so the tests of a
backend run in this order and a failure skips those after it.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import launch  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402
from tests.support.helpers import worker_cmd  # noqa: E402
from tests.support.helpers import worker_env  # noqa: E402

pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

_TIMEOUT = 420
BACKENDS = ["jax", "torch", "tensorflow"]
CHECKS = {
    "np2": ["save_load_sharded_continues_like_one_process",
            "load_weights_reads_slices", "save_streams_the_weights"],
    "np3": ["plain_keras_file_loads_sharded_np3",
            "sharded_np2_file_loads_sharded_np3"],
    "np1": ["files_load_replicated_and_sharded_np1",
            "load_model_shard_weights_refusals"],
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return {b: tmp_path_factory.mktemp(f"weights_load_{b}")
            for b in BACKENDS}


def _job(np_, mode, root, backend):
    before = {"np3": "np2", "np1": "np3"}.get(mode)
    if before and not (root / f"{before}.ok").exists():
        pytest.skip(f"the {before} job before it failed")
    out = launch(np_, worker_cmd("weights_load_worker.py", mode, str(root)),
                 timeout=_TIMEOUT, env=worker_env(KERAS_BACKEND=backend))
    assert out.returncode == 0, out.stdout[-6000:]
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        done = [line[3:] for line in lines if line.startswith("OK ")]
        assert done == CHECKS[mode], (r, done, out.stdout[-6000:])
        assert lines[-1] == "DONE", out.stdout[-3000:]
    (root / f"{mode}.ok").write_text("")


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_model_shard_weights_np2_saves_loads_by_slices(roots, backend):
    _job(2, "np2", roots[backend], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_model_shard_weights_np3_any_file(roots, backend):
    _job(3, "np3", roots[backend], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_model_shard_weights_np1_replicated_and_sharded(roots,
                                                             backend):
    _job(1, "np1", roots[backend], backend)
