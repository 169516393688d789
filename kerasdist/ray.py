"""Ray Train backend: a kerasdist job under Ray's `DataParallelTrainer`.

    import ray.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    from kerasdist.ray import KerasdistConfig, ReportCallback

    def train_loop_per_worker(config):
        import kerasdist as kd
        kd.init()                     # one job of all the Ray workers
        ...                           # an ordinary kerasdist script

    trainer = DataParallelTrainer(
        train_loop_per_worker,
        backend_config=KerasdistConfig(),
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(storage_path="/shared/ray",
                             failure_config=FailureConfig(max_failures=3)))
    result = trainer.fit()

Before the loop runs, the backend picks rank 0's address (the node of
Ray's worker 0) and a free port there, and sets kerasdist's launch
convention in every worker: ``KERASDIST_NUM_PROCESSES`` (the number of
workers), ``KERASDIST_RANK`` (Ray's world rank), ``KERASDIST_COORDINATOR``
(host:port) and ``KERASDIST_RESTART_ATTEMPT`` (0 for the run's first worker
group, 1 after Ray restarted it once, ...). `kd.init()` in the loop then
forms one MPI job of the workers, as for any platform that starts the
processes itself (docs/platforms.md, "Without `kerasdist run`"); rank and
size are Ray's world rank and size, and `kd.local_rank()` is Ray's local
rank (Ray numbers the workers of a node consecutively, as MPI does), so
`gpus[kd.local_rank()]` is the worker's own GPU under ``use_gpu=True``
(every worker of a node sees all the node's GPUs of the run, as under
Ray's torch backend). When the loop returns, kerasdist is shut down in
that worker (a goodbye to its peers).

When a worker dies, the others end within kerasdist's heartbeat bound;
Ray's `FailureConfig(max_failures=K)` then starts a new worker group,
whose `kd.init()` forms the job anew on a new port, and a
`kerasdist.Trainer`'s `fit()` resumes from its newest checkpoint (keep
``checkpoint_dir`` on storage every node sees). `ReportCallback` reports
the Keras logs, and the Trainer's newest checkpoint, to Ray.

Needs Ray Train v2 (``pip install "kerasdist[ray]"``; v2 is the default
from Ray 2.50 on, ``RAY_TRAIN_V2_ENABLED``).
"""

import contextlib
import dataclasses
import os
import secrets
import shutil
import socket
import tempfile

import ray
import ray.train
from ray.train.backend import Backend
from ray.train.backend import BackendConfig

# ReportCallback too (defined on first use: see __getattr__ below).
__all__ = ["KerasdistConfig", "worker_environment"]

# The variables this backend sets in every worker (the `kerasdist`
# convention, kerasdist/rendezvous/conventions.py, and the restart count).
_VARIABLES = ("KERASDIST_NUM_PROCESSES", "KERASDIST_RANK",
              "KERASDIST_COORDINATOR", "KERASDIST_RESTART_ATTEMPT")
# Variables of other conventions that, left in a worker's environment (a
# runtime_env, the raylet's own environment), would contradict these.
_OTHER_CONVENTIONS = (
    "PMI_FD", "PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
    "PMIX_NAMESPACE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "KERASDIST_PROCESSES_PER_HOST", "KERASDIST_LOCAL_RANK",
    "JOB_COMPLETION_INDEX")


@dataclasses.dataclass
class KerasdistConfig(BackendConfig):
    """Ray Train's backend config for kerasdist.

    Args:
        coordinator_port: the port rank 0 serves the rendezvous on, on the
            node of Ray's worker 0. Default: a free port there, picked anew
            for every worker group (so a restarted group never meets the
            previous one's server).
        rendezvous_timeout_s: seconds `kd.init()` waits for every worker to
            arrive (``KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS``); None keeps
            kerasdist's default (300) or the workers' own setting.
    """

    coordinator_port: int = None
    rendezvous_timeout_s: float = None

    @property
    def backend_cls(self):
        return _KerasdistBackend

    @property
    def train_func_context(self):
        return _train_func_context

    def to_dict(self):
        return {"coordinator_port": self.coordinator_port,
                "rendezvous_timeout_s": self.rendezvous_timeout_s}


def _address_and_port(port):
    """This node's address as Ray knows it, and `port` or a free port."""
    address = ray.util.get_node_ip_address()
    if port:
        return address, int(port)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        return address, s.getsockname()[1]


def worker_environment(rank, size, address, port, attempt,
                       rendezvous_timeout_s=None, secret=None):
    """The variables the backend sets in worker `rank` of `size`; `secret`:
    the job's KERASDIST_JOB_SECRET (on_start makes one per worker group:
    SECURITY.md)."""
    host = f"[{address}]" if ":" in address else address
    env = {"KERASDIST_NUM_PROCESSES": str(size),
           "KERASDIST_RANK": str(rank),
           "KERASDIST_COORDINATOR": f"{host}:{port}",
           "KERASDIST_RESTART_ATTEMPT": str(attempt)}
    if rendezvous_timeout_s is not None:
        env["KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS"] = str(
            float(rendezvous_timeout_s))
    if secret is not None:
        env["KERASDIST_JOB_SECRET"] = secret
    return env


def _set_environment(env):
    """Runs in a worker: sets `env`, drops what would contradict it."""
    for name in _OTHER_CONVENTIONS:
        os.environ.pop(name, None)
    os.environ.update(env)
    return os.getpid()


@contextlib.contextmanager
def _train_func_context():
    """Wraps the loop on every worker (in the thread that runs it): once
    the loop has returned, kerasdist says goodbye to its peers and stops
    (so a worker that finished is never taken for lost when Ray ends the
    group). After an exception nothing is done: the peers may be inside
    a collective, and Ray ends the whole group."""
    yield
    from kerasdist import basics
    if basics.is_initialized():
        basics.shutdown()


class _KerasdistBackend(Backend):
    # Every worker of a node sees the GPUs Ray gave the node's workers, in
    # local rank order: `gpus[kd.local_rank()]` is the worker's own.
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config):
        size = len(worker_group)
        # One count per run: the callback that calls this holds one config
        # for the run's life, and a new worker group after a failure is
        # the next attempt (KERASDIST_RESTART_ATTEMPT, as `kerasdist run
        # --max-restarts` counts them; the Trainer logs it).
        attempt = getattr(backend_config, "_attempts", 0)
        backend_config._attempts = attempt + 1
        address, port = worker_group.execute_single(
            0, _address_and_port, backend_config.coordinator_port)
        # A secret per run, which its workers prove to each other (the
        # driver's own KERASDIST_JOB_SECRET where it has one): the same
        # for the next attempt's group, whose rank 0 may find this one's
        # server still ending on a fixed coordinator_port.
        secret = getattr(backend_config, "_secret", None) or (
            os.environ.get("KERASDIST_JOB_SECRET") or secrets.token_hex(32))
        backend_config._secret = secret
        ray.get([worker_group.execute_single_async(
            i, _set_environment, worker_environment(
                i, size, address, port, attempt,
                backend_config.rendezvous_timeout_s, secret))
            for i in range(size)])



def __getattr__(name):
    # ReportCallback is a Keras callback: defined on first use, so that
    # the driver, which only needs KerasdistConfig, never imports Keras.
    if name == "ReportCallback":
        cls = _report_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _report_callback_class():
    import keras

    class ReportCallback(keras.callbacks.Callback):
        """Reports each epoch's Keras logs to Ray (`ray.train.report`), and
        with `checkpoint_dir` (a `kerasdist.Trainer`'s) its newest checkpoint.

        Every worker reports (Ray's report is a barrier of all workers); rank 0
        attaches the newest checkpoint in `checkpoint_dir` (the epoch's, which
        the Trainer has written by then: its callbacks run before yours), both
        files, as a `ray.train.Checkpoint` that Ray copies to the run's
        storage (``RunConfig(storage_path=...)``) and lists in `Result`.

        Args:
            checkpoint_dir: the Trainer's ``checkpoint_dir``, or None to report
                the logs only.
            every_epochs: report every N epochs (and never in between).
        """

        def __init__(self, checkpoint_dir=None, every_epochs=1):
            super().__init__()
            if int(every_epochs) < 1:
                raise ValueError(f"every_epochs must be 1 or more, got "
                                 f"{every_epochs!r}.")
            self.checkpoint_dir = checkpoint_dir
            self.every_epochs = int(every_epochs)

        def on_epoch_end(self, epoch, logs=None):
            if (epoch + 1) % self.every_epochs:
                return
            metrics = {k: float(v) for k, v in (logs or {}).items()
                       if _is_number(v)}
            metrics["epoch"] = epoch + 1
            from kerasdist import basics
            if self.checkpoint_dir is None or basics.rank() != 0:
                ray.train.report(metrics)
                return
            from kerasdist.trainer import checkpoints
            manifest = checkpoints.latest(self.checkpoint_dir)
            if manifest is None:
                ray.train.report(metrics)
                return
            with tempfile.TemporaryDirectory(prefix="kerasdist-ray-") as tmp:
                name = checkpoints.manifest_name(
                    int(manifest["epoch"]), int(manifest.get("samples", 0)))
                shutil.copy2(manifest["weights_path"], tmp)
                shutil.copy2(os.path.join(self.checkpoint_dir, name), tmp)
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                ray.train.report(metrics, checkpoint=checkpoint)

    ReportCallback.__module__ = __name__
    ReportCallback.__qualname__ = "ReportCallback"
    return ReportCallback


def _is_number(value):
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
