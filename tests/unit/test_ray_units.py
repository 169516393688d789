"""kerasdist.ray's pieces that need no Ray cluster: the variables the
backend sets are the `kerasdist` launch convention kd.init() reads, and the
check kd.init() makes in a Ray worker. The backend on a real Ray cluster:
tests/cluster/test_ray.py."""

import pytest

from kerasdist._core import ray_worker as _ray_worker
from kerasdist.rendezvous import conventions

pytest.importorskip("ray.train", reason="needs ray[train] (kerasdist[ray])")


def test_ray_worker_environment_is_the_kerasdist_convention():
    from kerasdist.ray import worker_environment

    env = worker_environment(3, 4, "10.1.2.3", 29512, attempt=2)
    assert env == {"KERASDIST_NUM_PROCESSES": "4", "KERASDIST_RANK": "3",
                   "KERASDIST_COORDINATOR": "10.1.2.3:29512",
                   "KERASDIST_RESTART_ATTEMPT": "2"}
    assert conventions.detect(env) == conventions.Launch(
        "kerasdist", 3, 4, None, None, ("10.1.2.3", 29512))
    six = worker_environment(0, 2, "fd00::5", 29513, 0,
                             rendezvous_timeout_s=60)
    assert six["KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"] == "60.0"
    assert conventions.detect(six).coordinator == ("fd00::5", 29513)


def test_ray_config_backend_and_fields():
    from kerasdist.ray import KerasdistConfig

    config = KerasdistConfig(coordinator_port=29500)
    assert config.backend_cls.share_cuda_visible_devices is True
    assert config.to_dict() == {"coordinator_port": 29500,
                                "rendezvous_timeout_s": None}


def test_ray_worker_check_outside_a_train_worker_passes():
    assert _ray_worker.in_ray_worker({"RAY_RAYLET_PID": "123"})
    assert not _ray_worker.in_ray_worker({})
    # Ray imported, but this is no Ray Train worker: nothing to say.
    assert _ray_worker.check_no_convention() is None

