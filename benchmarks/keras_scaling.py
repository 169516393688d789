"""W3 (BENCHMARKS.md): model.fit images/s at np=1 and np=2 with kerasdist.

    python benchmarks/keras_scaling.py [--steps-cnn 40] [--steps-mlp 200]

Runs each model under `python -m kerasdist.run -np N` (N = 1, 2), batch 64
per rank, 1024 random in-memory images per rank (repeated), SGD(0.01,
momentum 0.9), sparse CE from logits, no metrics, jit_compile=False, one
intra- and one inter-op thread per process. Steps are timed by wall clock
between batch ends after a warm-up. After training every rank's weights are
allgathered and compared with rank 0's (`same` column).

Prints a table: model, np, img/s per rank, total, scaling efficiency
(total at np=2 / (2 x np=1)). MultiWorkerMirroredStrategy is not compared
here (see the report). Run it alone: the machine has 2 cores.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64


def _build(name):
    import keras

    if name == "cnn":
        layers = [keras.Input((32, 32, 3))]
        for filters in (32, 64, 128):
            layers += [keras.layers.Conv2D(filters, 3, padding="same",
                                           activation="relu"),
                       keras.layers.Conv2D(filters, 3, padding="same",
                                           activation="relu"),
                       keras.layers.MaxPooling2D()]
        layers += [keras.layers.Flatten(),
                   keras.layers.Dense(384, activation="relu"),
                   keras.layers.Dense(10)]
    else:  # mlp20
        layers = [keras.Input((32, 32, 3)), keras.layers.Flatten()]
        layers += [keras.layers.Dense(256, activation="relu")
                   for _ in range(20)]
        layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def worker(model_name, steps, warmup):
    """One rank: train, time, check weights; rank 0 prints a RESULT line."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import kerasdist as kd

    kd.init()
    rng = np.random.default_rng(kd.rank())
    x = rng.random((1024, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(1024,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
    model = _build(model_name)
    model.compile(
        optimizer=kd.DistributedOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False)
    kd.broadcast_variables(model.variables, root_rank=0)

    ends = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(
            time.perf_counter()))
    model.fit(data.prefetch(2), steps_per_epoch=warmup + steps, epochs=1,
              verbose=0, callbacks=[timer])
    img_sec = steps * BATCH / (ends[-1] - ends[warmup - 1])

    mine = np.concatenate([w.ravel() for w in model.get_weights()])
    every = kd.allgather(tf.constant(mine[None, :]), name="bench.weights")
    same = all(np.array_equal(row, every[0].numpy()) for row in every.numpy())
    rates = kd.allgather(tf.constant([img_sec], tf.float64),
                         name="bench.rates").numpy().tolist()
    if kd.rank() == 0:
        print("RESULT " + json.dumps({
            "model": model_name, "np": kd.size(), "rates": rates,
            "params": int(model.count_params()),
            "tensors": len(model.trainable_variables), "same": same}),
            flush=True)


def _launch(np_, model_name, steps, warmup):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "kerasdist.run", "-np", str(np_),
            sys.executable, os.path.abspath(__file__), "--worker",
            "--model", model_name, "--steps", str(steps),
            "--warmup", str(warmup)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=REPO_ROOT, timeout=900)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"np={np_} {model_name} failed (exit "
                       f"{out.returncode}):\n{out.stdout[-3000:]}"
                       f"{out.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps per run")
    parser.add_argument("--steps-cnn", type=int, default=40)
    parser.add_argument("--steps-mlp", type=int, default=200)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.steps, args.warmup)
        return

    print("# W3: model.fit, batch 64 per rank, SGD momentum, "
          "kerasdist DistributedOptimizer")
    print(f"# {'model':>6} {'params':>9} {'tensors':>7} {'np':>3} "
          f"{'img/s/rank':>11} {'total':>9} {'eff':>5} {'same':>5}")
    for model_name, steps in (("cnn", args.steps_cnn),
                              ("mlp20", args.steps_mlp)):
        single = None
        for np_ in (1, 2):
            r = _launch(np_, model_name, steps, args.warmup)
            total = sum(r["rates"])
            per_rank = total / np_
            if np_ == 1:
                single = total
            eff = total / (np_ * single)
            print(f"  {model_name:>6} {r['params']:>9} {r['tensors']:>7} "
                  f"{np_:>3} {per_rank:>11.1f} {total:>9.1f} {eff:>5.2f} "
                  f"{str(r['same']):>5}", flush=True)


if __name__ == "__main__":
    main()
