"""kerasdist under Ray Train (kerasdist.ray) on a real Ray cluster of two
test hosts: `ray start --head` in kdt0 (bound to its address), `ray start
--address` in kdt1, one CPU each (so the 2 workers land one per host), no
dashboard, a small object store; the driver runs in kdt0. One Ray cluster
for the module, stopped (`ray stop --force` in each host) however the
tests end. Drivers: tests/workers/ray_worker.py.
"""

import json
import os

import pytest

from tests.support import trainer_records as tr
from tests.support.cluster import Cluster, require
from tests.support.helpers import start_processes, worker_cmd
from tests.support.ray_cluster import RayCluster

pytestmark = pytest.mark.cluster

ray = pytest.importorskip("ray", reason="needs ray[train] (kerasdist[ray])")


@pytest.fixture(scope="module")
def ray_cluster():
    require()
    with Cluster(2) as c, RayCluster(c, cpus=1) as rc:
        yield rc


def _drive(cluster, mode, out_dir, timeout=240):
    """Runs ray_worker.py MODE in kdt0's namespace; returns its output
    and what it wrote ({name: record})."""
    [(rc, out)] = start_processes(
        cluster.head.nsenter() + worker_cmd("ray_worker.py", mode,
                                            str(out_dir)),
        [cluster.driver_env()], timeout=timeout)
    records = {p[:-5]: json.loads(open(out_dir / p).read())
               for p in os.listdir(out_dir) if p.endswith(".json")}
    return rc, out, records


@pytest.fixture(scope="module")
def fit_run(ray_cluster, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ray_fit")
    rc, out, records = _drive(ray_cluster, "fit", out_dir)
    assert rc == 0 and "DRIVER DONE fit" in out, out[-5000:]
    return out_dir, out, records


def test_ray_workers_form_one_job_and_fit_matches_one_process(
        ray_cluster, fit_run):
    _, out, records = fit_run
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
        ray_cluster, fit_run, tmp_path):
    import numpy as np

    ref_dir, _, _ = fit_run
    rc, out, records = _drive(ray_cluster, "fault", tmp_path, timeout=300)
    assert rc == 0 and "DRIVER DONE fault" in out, out[-6000:]
    assert "kills itself: after step 22" in out, out[-4000:]
    # The second worker group (attempt 1) resumed inside epoch 2.
    m = tr.RESUMED.search(out)
    assert m, out[-4000:]
    epoch, samples = int(m.group(1)) - 1, int(m.group(2) or 0)
    assert epoch == 1 and samples > 0, m.group(0)
    assert "restart attempt 2 (KERASDIST_RESTART_ATTEMPT=1)" in out
    assert set(n for n in records if n.startswith("fault.a")) == {
        "fault.a1.r0", "fault.a1.r1"}, sorted(records)
    # No example lost or trained twice: attempt 0's steps up to the
    # checkpoint, then attempt 1's, are the uninterrupted job's steps.
    resumed_step = int(m.group(3))
    ref = tr.job_steps(tr.steps(ref_dir, "ref", 0, 2))
    got = (tr.job_steps(tr.steps(tmp_path, "fault", 0, 2),
                        until=resumed_step)
           + tr.job_steps(tr.steps(tmp_path, "fault", 1, 2)))
    assert got == ref
    for ids in tr.epochs(got):
        assert sorted(ids) == list(range(tr.N))
    np.testing.assert_array_equal(np.load(tmp_path / "fault.npy"),
                                  np.load(ref_dir / "ref.npy"))
    # Ray holds the Trainer's last epoch checkpoint, and the last epoch's
    # metrics.
    driver = records["fault"]
    assert driver["error"] is None, driver
    assert driver["metrics"]["epoch"] == 3, driver
    assert "loss" in driver["metrics"], driver
    assert driver["checkpoint"] == ["epoch-000003.json",
                                    "epoch-000003.weights.h5"], driver
