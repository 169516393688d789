"""What `kd.init()` checks inside a Ray worker process (kerasdist/ray.py is
the Ray Train backend): a Ray Train worker group of more than one whose
trainer was not given `kerasdist.ray.KerasdistConfig` would train as N jobs
of one, each alone. Imports no kerasdist module (basics uses it)."""

import os


def in_ray_worker(environ=os.environ):
    """Whether this process is one a Ray node started (its raylet sets
    RAY_RAYLET_PID in every worker it starts)."""
    return bool(environ.get("RAY_RAYLET_PID", "").strip())


def check_no_convention():
    """Raises where this process is a worker of a Ray Train group of more
    than one (and found no launch convention); else returns."""
    try:
        import ray.train
        size = ray.train.get_context().get_world_size()
    except Exception:  # no Ray Train here, or not inside its worker
        return
    if size > 1:
        raise RuntimeError(
            f"kerasdist.init() runs in a Ray Train worker group of {size}, "
            f"but no kerasdist job was set up for it, so each worker would "
            f"train alone; pass backend_config=kerasdist.ray."
            f"KerasdistConfig() to the DataParallelTrainer.")
