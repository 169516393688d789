"""Images/s of a small CNN trained with model.fit on synthetic 32x32x3 data.

    python -m kerasdist.run -np 2 python examples/keras_synthetic_benchmark.py
    python -m kerasdist.run -np 2 \\
        python examples/keras_synthetic_benchmark.py \\
        --steps 50 --np1-img-sec 870

Prints images/s per rank and in total; with --np1-img-sec (a figure from an
np=1 run) also the scaling efficiency total / (size x np1). It runs on the
Keras backend KERAS_BACKEND names (tensorflow, jax or torch), unchanged.
"""

import argparse
import time

import keras
import numpy as np

import kerasdist as kd


def cnn():
    """Three blocks of two Conv3x3 and a MaxPool, Dense(384), Dense(10)."""
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
    return keras.Sequential(layers)


class _StepTimes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="per rank")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps first")
    parser.add_argument("--np1-img-sec", type=float, default=None,
                        help="images/s of an np=1 run, for the efficiency")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")

    kd.init()
    rng = np.random.default_rng(kd.rank())
    n = (args.warmup + args.steps) * args.batch_size
    x = rng.random((n, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(n,))

    model = cnn()
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    # TensorFlow: a tf.function without XLA (on this benchmark's CPU rows
    # XLA's convolutions cost more than they save). JAX: its jitted step
    # calls the collectives as XLA custom calls. PyTorch: eager (Keras'
    # default).
    model.compile(optimizer=opt,
                  jit_compile=keras.backend.backend() == "jax",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    kd.broadcast_variables(model.variables, root_rank=0)

    times = _StepTimes()
    model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[times])
    # Wall clock from the end of the last warm-up step to the last step.
    elapsed = times.times[-1] - times.times[args.warmup - 1]
    img_sec = args.steps * args.batch_size / elapsed
    total = float(kd.allreduce(np.array(img_sec, np.float32), op=kd.Sum,
                               name="bench.img_sec"))
    print(f"rank {kd.rank()}: {img_sec:.1f} img/s", flush=True)
    if kd.rank() == 0:
        print(f"total: {total:.1f} img/s on {kd.size()} ranks "
              f"(batch {args.batch_size} per rank, {args.steps} steps)",
              flush=True)
        if args.np1_img_sec:
            eff = total / (kd.size() * args.np1_img_sec)
            print(f"scaling efficiency: {eff:.2f}", flush=True)


if __name__ == "__main__":
    main()
