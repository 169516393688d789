"""Ray Train driver for tests/cluster/test_ray.py: one run of every check.

    RAY_ADDRESS=HEAD:PORT python tests/workers/ray_worker.py OUT_DIR

Runs a `DataParallelTrainer` of 2 workers with kerasdist's backend
(`kerasdist.ray.KerasdistConfig`) and FailureConfig(max_failures=1) on the
Ray cluster at RAY_ADDRESS. What it found goes to OUT_DIR: the workers'
fit.r<rank>.json and fault.a<attempt>.r<rank>.json, the driver's
driver.json (the run's Result), the Trainers' id records (see
trainer_fault_worker.py) and final states (ref.npy, fault.npy).

Ray's first worker group (attempt 0), on every worker:
  1. kd.init() as it would run without KerasdistConfig (the backend's
     variables hidden): it must raise, saying what to pass;
  2. kd.init(); kerasdist's rank, size, local rank and size must be Ray's,
     and its host its Ray node's;
  3. trainer_fault_worker.py's Trainer, uninterrupted (tag "ref"): the
     truth for 5;
  4. a Keras `model.fit` with DistributedOptimizer and the broadcast
     callback (different initial weights on each worker), which must end
     at the weights of a single-process fit on the concatenated batches;
  5. the same Trainer again (tag "fault"), with ReportCallback (every
     epoch, the newest checkpoint); worker 1 SIGKILLs itself after step 22
     (in epoch 2, once that epoch's step checkpoint is written).
Ray then starts a second group (attempt 1), whose Trainer resumes 5.
"""

import json
import os
import sys
import time

import ray
import ray.train
from ray.train import Checkpoint
from ray.train import FailureConfig
from ray.train import RunConfig
from ray.train import ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from kerasdist.ray import KerasdistConfig

WORKERS = os.path.dirname(os.path.abspath(__file__))


def _write(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)


def _quiet_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")


def _layout(kd):
    import socket
    ctx = ray.train.get_context()
    return {"rank": kd.rank(), "size": kd.size(),
            "local_rank": kd.local_rank(), "local_size": kd.local_size(),
            "ray_rank": ctx.get_world_rank(),
            "ray_size": ctx.get_world_size(),
            "ray_local_rank": ctx.get_local_rank(),
            "ray_local_size": ctx.get_local_world_size(),
            "host": socket.gethostname(),
            "node_ip": ray.util.get_node_ip_address(),
            "attempt": os.environ.get("KERASDIST_RESTART_ATTEMPT")}


def _fit_check(kd):
    """Distributed fit == single-process fit on the concatenated batches."""
    import keras
    import numpy as np

    size, rank, batch, steps = kd.size(), kd.rank(), 4, 6
    rng = np.random.default_rng(0)
    x = rng.normal(size=(size * batch * steps, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    def model(seed):
        m = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
        r = np.random.default_rng(seed)
        m.set_weights([r.normal(size=w.shape).astype("float32") * 0.5
                       for w in m.get_weights()])
        return m

    def mine(a):  # rank r's rows of every global batch
        g = a.reshape(steps, size, batch, *a.shape[1:])
        return g[:, rank].reshape(steps * batch, *a.shape[1:])

    truth = model(100)  # rank 0's initial weights, which the broadcast sets
    truth.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    truth.fit(x, y, batch_size=size * batch, shuffle=False, verbose=0)
    dist = model(100 + rank)
    dist.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1)), loss="mse")
    dist.fit(mine(x), mine(y), batch_size=batch, shuffle=False, verbose=0,
             callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    flat = [np.concatenate([np.ravel(w) for w in m.get_weights()])
            for m in (dist, truth, model(100))]
    return {"max_diff": float(np.max(np.abs(flat[0] - flat[1]))),
            "moved": float(np.max(np.abs(flat[1] - flat[2])))}


def _init_without_the_backend(kd):
    """kd.init() as in a worker group without KerasdistConfig (the
    backend's variables hidden): the error it raises, or None."""
    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k.startswith("KERASDIST_")}
    try:
        kd.init()
    except RuntimeError as e:
        return str(e)
    finally:
        os.environ.update(saved)
    return None


def _trainer_args(out, tag):
    import argparse
    return argparse.Namespace(ckpt_dir=os.path.join(out, tag), log_dir=out,
                              tag=tag)


def loop(config):
    """Attempt 0 (Ray's first worker group): the checks, the reference
    Trainer, then the Trainer that worker 1 kills; attempt 1: its resume."""
    _quiet_tf()
    import kerasdist as kd
    from kerasdist.ray import ReportCallback
    out = config["out"]
    attempt = int(os.environ["KERASDIST_RESTART_ATTEMPT"])
    error = _init_without_the_backend(kd) if attempt == 0 else None
    kd.init()
    sys.path.insert(0, WORKERS)
    import trainer_fault_worker as tfw
    if attempt == 0:
        record = _layout(kd)
        record["error_without_backend"] = error
        args = _trainer_args(out, "ref")
        tfw.open_log(out, "ref")
        trainer, record["loss"] = tfw.train(args)
        tfw.finish(args, trainer, record["loss"])
        record.update(_fit_check(kd))
        _write(os.path.join(out, f"fit.r{kd.rank()}.json"), record)
    args = _trainer_args(out, "fault")
    tfw.open_log(out, "fault")
    callbacks = [tfw.Killer(args.ckpt_dir, 1, 22),
                 ReportCallback(args.ckpt_dir)]
    trainer, loss = tfw.train(args, callbacks=callbacks)
    tfw.finish(args, trainer, loss)
    record = _layout(kd)
    record["loss"] = loss
    _write(os.path.join(out, f"fault.a{attempt}.r{kd.rank()}.json"), record)


def main():
    out = os.path.abspath(sys.argv[1])
    ray.init(log_to_driver=True)
    # A previous run's workers may still be giving their CPUs back.
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)
    start = time.monotonic()
    trainer = DataParallelTrainer(
        loop, train_loop_config={"out": out},
        backend_config=KerasdistConfig(),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="kerasdist", storage_path=os.path.join(out, "ray"),
            failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    record = {"metrics": result.metrics, "error": repr(result.error)
              if result.error else None}
    if result.checkpoint is not None:
        record["checkpoint"] = sorted(os.listdir(result.checkpoint.path))
        record["checkpoint_path"] = result.checkpoint.path
    assert isinstance(result.checkpoint, (Checkpoint, type(None)))
    _write(os.path.join(out, "driver.json"), record)
    print(f"DRIVER DONE in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
