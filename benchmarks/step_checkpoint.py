"""What step checkpoints cost the training step (Trainer, np=1 or more).

    python benchmarks/step_checkpoint.py [--rounds 5] [--epochs 3] \
        [--every 50] [--width 512]
    python -m kerasdist.run -np 2 python benchmarks/step_checkpoint.py

An MLP (64 -> width -> width -> 10, Adam) trained by `kerasdist.Trainer`
with epoch checkpoints, alternately without and with
`checkpoint_every_steps=EVERY`, a fresh Trainer and checkpoint directory
per run, the two taking turns round by round (the machine is shared and
its speed drifts). A callback placed after the Trainer's own times each
step from its `on_train_batch_begin` to its `on_train_batch_end`: the
train step plus every Trainer callback of that step, the snapshot
included; the epoch-end work (the epoch checkpoint, the same in both) is
outside. The background write shows up as it slows the steps it overlaps.

Reports per round the mean step time of each run over its epochs after
the first (the first traces the train step), which spreads the
snapshot's cost over the steps as a job pays it, the ratio with/without,
and the median of the ratios; also the median time of the steps where a
snapshot was due against the others.
"""

import argparse
import os
import statistics
import tempfile
import time

import _common  # noqa: F401 - puts the repo on sys.path
import numpy as np


def make_trainer(kd, keras, width, n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 64)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int64")

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []
            self._t = 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._t)

    class MLP(kd.Trainer):
        def build_model(self):
            return keras.Sequential([
                keras.Input((64,)),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(10, activation="softmax")])

        def train_data(self):
            return x, y

        def callbacks(self):
            self.timer = Timer()
            return [self.timer]

    return MLP


def run_once(kd, trainer_cls, args, every):
    # Rank 0 writes into its directory; the others' stay empty.
    with tempfile.TemporaryDirectory() as directory:
        trainer = trainer_cls(epochs=args.epochs, batch_size=args.batch,
                              checkpoint_dir=directory, verbose=0,
                              checkpoint_every_steps=every)
        trainer.fit()
        times = np.array(trainer.timer.times)
        steps = len(times) // args.epochs
        # The steps after which a snapshot was due (taken then unless the
        # previous write was still in flight).
        marks = np.zeros(len(times), bool)
        if every:
            for e in range(args.epochs):
                for i in range(every - 1, steps - 1, every):
                    marks[e * steps + i] = True
        # The first epoch traces the train step: leave it out.
        return (times[steps:], marks[steps:],
                trainer.model.count_params())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--examples", type=int, default=8192)
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import kerasdist as kd
    kd.init()
    cls = make_trainer(kd, keras, args.width, args.examples)
    rows, snap, plain = [], [], []
    params = 0
    for r in range(args.rounds):
        order = [None, args.every] if r % 2 == 0 else [args.every, None]
        means = {}
        for every in order:
            times, marks, params = run_once(kd, cls, args, every)
            means[every] = times.mean()
            if every:
                snap.extend(times[marks])
                plain.extend(times[~marks])
        rows.append((means[None], means[args.every]))
    if kd.rank() != 0:
        return
    print(f"# step checkpoints: MLP 64-{args.width}-{args.width}-10 "
          f"({params} weights, Adam), batch {args.batch}, "
          f"{args.examples // (args.batch * kd.size())} steps an epoch, "
          f"np={kd.size()}, checkpoint_every_steps={args.every}")
    print(f"#{'round':>6} {'off(ms/step)':>13} {'on(ms/step)':>12} "
          f"{'on/off':>7}")
    for i, (off, on) in enumerate(rows):
        print(f"{i:>7} {off * 1e3:13.3f} {on * 1e3:12.3f} {on / off:7.3f}")
    ratio = statistics.median(on / off for off, on in rows)
    print(f"# median ratio on/off: {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f}% step time)")
    print(f"# median step where a snapshot was due: "
          f"{statistics.median(snap) * 1e3:.3f} ms, other steps: "
          f"{statistics.median(plain) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
