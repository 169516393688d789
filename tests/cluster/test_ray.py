"""kerasdist under Ray Train (kerasdist.ray) on a real Ray cluster of two
test hosts: `ray start --head` in kdt0 (bound to its address), `ray start
--address` in kdt1, one CPU each (so the 2 workers land one per host), no
dashboard, a small object store; the driver runs in kdt0. One Ray cluster
for the module, stopped (`ray stop --force` in each host) however the
tests end, and one Ray Train run (tests/workers/ray_worker.py) whose two
worker groups (the second after a SIGKILLed worker) do every check; each
test asserts its part.
"""

import json
import os

import pytest

from tests.support import trainer_records as tr
from tests.support.cluster import Cluster
from tests.support.cluster import require
from tests.support.helpers import start_processes
from tests.support.helpers import worker_cmd
from tests.support.ray_cluster import RayCluster

pytestmark = pytest.mark.cluster

ray = pytest.importorskip("ray", reason="needs ray[train] (kerasdist[ray])")


@pytest.fixture(scope="module")
def ray_cluster():
    require()
    with Cluster(2) as c, RayCluster(c, cpus=1) as rc:
        yield rc


@pytest.fixture(scope="module")
def ray_run(ray_cluster, tmp_path_factory):
    """One Ray Train run of ray_worker.py, driven from kdt0: (its output,
    its directory, {name: record} of what it wrote)."""
    out_dir = tmp_path_factory.mktemp("ray")
    [(rc, out)] = start_processes(
        ray_cluster.head.nsenter() + worker_cmd("ray_worker.py",
                                                str(out_dir)),
        [ray_cluster.driver_env()], timeout=600)
    assert rc == 0 and "DRIVER DONE" in out, out[-6000:]
    records = {p[:-5]: json.loads((out_dir / p).read_text())
               for p in os.listdir(out_dir) if p.endswith(".json")}
    return out, out_dir, records


def test_ray_workers_form_one_job_and_fit_matches_one_process(
        ray_cluster, ray_run):
    out, _, records = ray_run
    hosts = {h.address: h.name for h in ray_cluster.cluster.hosts}
    workers = [records[f"fit.r{r}"] for r in (0, 1)]
    for r, w in enumerate(workers):
        assert (w["rank"], w["size"]) == (w["ray_rank"], w["ray_size"]) \
            == (r, 2), w
        assert (w["local_rank"], w["local_size"]) == \
            (w["ray_local_rank"], w["ray_local_size"]) == (0, 1), w
        assert hosts[w["node_ip"]] == w["host"], w
        assert w["attempt"] == "0", w
        assert w["max_diff"] < 1e-5 and w["moved"] > 1e-2, w
        # kd.init() in a worker group not given KerasdistConfig.
        error = w["error_without_backend"]
        assert error and "group of 2" in error and \
            "backend_config=kerasdist.ray.KerasdistConfig()" in error, error
    assert {w["host"] for w in workers} == {"kdt0", "kdt1"}, workers
    assert "launch convention kerasdist: rank 0 of 2" in out, out[-3000:]


def test_ray_restarts_a_killed_worker_and_the_trainer_resumes_exactly(
        ray_run):
    import numpy as np

    out, root, records = ray_run
    assert "kills itself: after step 22" in out, out[-4000:]
    # The second worker group (attempt 1) resumed inside epoch 2.
    m = tr.RESUMED.search(out)
    assert m, out[-4000:]
    epoch, samples = int(m.group(1)) - 1, int(m.group(2) or 0)
    assert epoch == 1 and samples > 0, m.group(0)
    assert "restart attempt 2 (KERASDIST_RESTART_ATTEMPT=1)" in out
    assert {n for n in records if n.startswith("fault.a")} == {
        "fault.a1.r0", "fault.a1.r1"}, sorted(records)
    assert {records[f"fault.a1.r{r}"]["attempt"] for r in (0, 1)} == {"1"}
    # No example lost or trained twice: attempt 0's steps up to the
    # checkpoint, then attempt 1's, are the uninterrupted job's steps.
    resumed_step = int(m.group(3))
    ref = tr.job_steps(tr.steps(root, "ref", 0, 2))
    got = (tr.job_steps(tr.steps(root, "fault", 0, 2), until=resumed_step)
           + tr.job_steps(tr.steps(root, "fault", 1, 2)))
    assert got == ref
    for ids in tr.epochs(got):
        assert sorted(ids) == list(range(tr.N))
    np.testing.assert_array_equal(np.load(root / "fault.npy"),
                                  np.load(root / "ref.npy"))
    # Ray holds the Trainer's last epoch checkpoint, and the last epoch's
    # metrics.
    driver = records["driver"]
    assert driver["error"] is None, driver
    assert driver["metrics"]["epoch"] == 3, driver
    assert "loss" in driver["metrics"], driver
    assert driver["checkpoint"] == ["epoch-000003.json",
                                    "epoch-000003.weights.h5"], driver
