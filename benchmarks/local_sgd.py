"""Local SGD (ModelAverageCallback) against synchronous DistributedOptimizer.

    python benchmarks/local_sgd.py [--epochs-cnn 5] [--epochs-mlp 30]
                                   [--plot out.png]

W3 setup from BENCHMARKS.md (CNN and MLP-20, batch 64 per rank, 1024
in-memory 32x32x3 images per rank, SGD(0.01, momentum 0.9), sparse CE from
logits, jit_compile=False, one intra- and one inter-op thread per rank),
except that the labels are learnable: an image is 0.5 x its class's fixed
random prototype image + 0.5 x uniform noise (then centred and scaled), so
the final loss says something about convergence. Every rank starts from the
same weights (same seed) and sees its own 1024 images.

One launch per model at np=1 runs plain Keras (the baseline for scaling
efficiency); one launch at np=2 runs, in turn, synchronous
`DistributedOptimizer` training and local SGD with
`ModelAverageCallback(K)` for K = 1, 4, 16 (each rank's momentum stays
local). Images/s per rank is the median over epochs 2..E of (images in the
epoch) / (time from the previous epoch's last batch end to this one's), so
it includes the epoch-end average. Efficiency = total img/s at np=2 /
(2 x img/s at np=1). The final loss is the cross-entropy of the trained
model on all ranks' data (evaluated per shard, averaged), after E epochs.

Run it alone: the machine has 2 cores, and np=2 uses both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
BATCH = 64
N_PER_RANK = 1024
KS = (1, 4, 16)
SIGNAL = 0.5  # weight of the class prototype in an image (noise: the rest)


def _build(name):
    from keras_scaling import _build as build  # the W3 models
    return build(name)


def _data(rank):
    """Noisy copies of 10 fixed random "prototype" images (the same on every
    rank); each rank draws its own labels and noise."""
    import numpy as np

    prototypes = np.random.default_rng(1234).random((10, 32, 32, 3))
    rng = np.random.default_rng(100 + rank)
    y = rng.integers(0, 10, size=N_PER_RANK).astype("int32")
    noise = rng.random((N_PER_RANK, 32, 32, 3))
    x = SIGNAL * prototypes[y] + (1 - SIGNAL) * noise
    x = (4.0 * (x - 0.5)).astype("float32")  # centred, unit-ish scale
    return x, y


def _train(model_name, config, epochs, x, y):
    """Trains one configuration; returns (median img/s per rank, loss)."""
    import keras
    import tensorflow as tf

    import kerasdist as kd

    keras.utils.set_random_seed(0)  # identical initial weights on all ranks
    model = _build(model_name)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    callbacks = []
    if config == "sync":
        opt = kd.DistributedOptimizer(opt)
    elif config.startswith("k"):
        callbacks.append(kd.callbacks.ModelAverageCallback(int(config[1:])))
    model.compile(
        optimizer=opt, jit_compile=False,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ends = []
    callbacks.append(keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: ends.append(time.perf_counter())))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache()
    model.fit(ds.prefetch(2), epochs=epochs, verbose=0, callbacks=callbacks)
    per_epoch = N_PER_RANK / statistics.median(
        b - a for a, b in zip(ends[:-1], ends[1:]))
    loss = model.evaluate(ds, verbose=0)
    loss = float(kd.allreduce(tf.constant(loss, tf.float64),
                              name=f"bench.loss.{config}"))
    return per_epoch, loss


def worker(model_name, configs, epochs):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import kerasdist as kd

    kd.init()
    x, y = _data(kd.rank())
    for config in configs:
        rate, loss = _train(model_name, config, epochs, x, y)
        rates = kd.allgather(tf.constant([rate], tf.float64),
                             name=f"bench.rates.{config}").numpy()
        if kd.rank() == 0:
            print("RESULT " + json.dumps({
                "model": model_name, "np": kd.size(), "config": config,
                "rates": rates.tolist(), "loss": loss,
                "epochs": epochs}), flush=True)


def _launch(np_, model_name, configs, epochs):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "kerasdist.run", "-np", str(np_),
            sys.executable, os.path.abspath(__file__), "--worker",
            "--model", model_name, "--configs", ",".join(configs),
            "--epochs", str(epochs)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=REPO_ROOT, timeout=1800)
    results = [json.loads(line.split("RESULT ", 1)[1])
               for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or len(results) != len(configs):
        raise RuntimeError(f"np={np_} {model_name} failed (exit "
                           f"{out.returncode}):\n{out.stdout[-3000:]}"
                           f"{out.stderr[-3000:]}")
    return results


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    models = sorted({r["model"] for r in rows})
    configs = [c for c in ("sync", *[f"k{k}" for k in KS])]
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        by = {r["config"]: r for r in rows if r["model"] == m}
        xs = [j + i * width for j in range(len(configs))]
        axes[0].bar(xs, [by[c]["eff"] for c in configs], width, label=m)
        axes[1].bar(xs, [by[c]["loss"] / by["single"]["loss"]
                         for c in configs], width, label=m)
    for ax, title in ((axes[0], "scaling efficiency at np=2"),
                      (axes[1], "final loss / single-process loss")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels(["sync"] + [f"local K={k}" for k in KS])
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="gray", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default="", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--epochs-cnn", type=int, default=5)
    parser.add_argument("--epochs-mlp", type=int, default=30)
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.configs.split(","), args.epochs)
        return

    configs = ["sync"] + [f"k{k}" for k in KS]
    print("# local SGD vs synchronous, np=2, batch 64 per rank, SGD(0.01, "
          "momentum 0.9); loss = final CE on all data")
    print(f"# {'model':>6} {'config':>8} {'epochs':>6} {'np':>3} "
          f"{'img/s/rank':>11} {'total':>9} {'eff':>5} {'loss':>8}")
    rows = []
    for model_name, epochs in (("cnn", args.epochs_cnn),
                               ("mlp20", args.epochs_mlp)):
        single = _launch(1, model_name, ["plain"], epochs)[0]
        single["config"] = "single"
        results = [single] + _launch(2, model_name, configs, epochs)
        base = single["rates"][0]
        for r in results:
            total = sum(r["rates"])
            r["eff"] = total / (r["np"] * base)
            rows.append(r)
            print(f"  {model_name:>6} {r['config']:>8} {epochs:>6} "
                  f"{r['np']:>3} {total / r['np']:>11.1f} {total:>9.1f} "
                  f"{r['eff']:>5.2f} {r['loss']:>8.4f}", flush=True)
    if args.plot:
        _plot(rows, args.plot)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()
