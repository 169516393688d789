"""Data-parallel Keras training with kerasdist: the handful of changes.

Dataset: scikit-learn's 8x8 handwritten digits (`sklearn.datasets.load_digits`,
1,797 images of the digits 0-9, 64 pixels each), shipped inside the
scikit-learn package: no download. It stands in for MNIST (28x28, which
needs a download) so that this example runs anywhere in under a minute.

    python -m kerasdist.run -np 2 python examples/keras_mnist.py \
        --epochs 5 --checkpoint-dir /tmp/digits-ckpt

The kerasdist changes to a single-process script are marked (1)-(5):
(1) init, (2) shard the data, (3) scale the learning rate and wrap the
optimizer, (4) broadcast / average / warm up callbacks, (5) checkpoints on
rank 0 only (and resume from the latest one, or read it on every rank
after fit).
"""

import argparse
import os

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kerasdist as kd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="per rank; one step uses batch-size * size().")
    parser.add_argument("--lr", type=float, default=0.002,
                        help="single-process learning rate.")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    kd.init()  # (1)
    keras.utils.set_random_seed(1234)

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y)
    x_train, y_train = kd.data.shard((x_train, y_train))  # (2)

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10, activation="softmax"),
    ])
    lr = args.lr * kd.size()  # (3) the global batch is size() times larger
    optimizer = kd.DistributedOptimizer(keras.optimizers.Adam(lr))
    # Keras's default jit_compile fits every backend: the collectives are
    # XLA custom calls inside JAX's jitted step and TensorFlow's compiled
    # one. Where a collective the step needs has no XLA kernel (a sharded
    # optimizer's on a GPU), kerasdist turns XLA off with a warning
    # (jit_compile=False silences it).
    model.compile(optimizer, "sparse_categorical_crossentropy",
                  metrics=["accuracy"])

    callbacks = [  # (4) order matters: averaging before the readers
        kd.callbacks.BroadcastGlobalVariablesCallback(0),
        kd.callbacks.MetricAverageCallback(),
        kd.callbacks.LearningRateWarmupCallback(
            initial_lr=lr, warmup_epochs=min(2, args.epochs),
            verbose=1 if kd.rank() == 0 else 0),
        kd.callbacks.EqualizeStepsCallback(),  # shards may differ by one
    ]
    initial_epoch = 0
    if args.checkpoint_dir:  # (5)
        latest = kd.callbacks.latest_checkpoint(args.checkpoint_dir)
        if latest is not None:
            initial_epoch = kd.callbacks.load_checkpoint(latest, model)
            if kd.rank() == 0:
                print(f"resuming from {latest}: "
                      + (f"epoch {initial_epoch + 1} of {args.epochs}"
                         if initial_epoch < args.epochs else
                         f"all {args.epochs} epochs are done"), flush=True)
        callbacks.append(kd.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "epoch{epoch}.weights.h5")))

    model.fit(x_train, y_train, batch_size=args.batch_size,
              epochs=args.epochs, initial_epoch=initial_epoch,
              validation_data=(x_test, y_test), callbacks=callbacks,
              verbose=2 if kd.rank() == 0 else 0)

    if args.checkpoint_dir:
        # kd.callbacks.ModelCheckpoint made fit wait on every rank until
        # rank 0 had written its last file, so any rank may read it now
        # (on hosts that do not share the directory, or for a file rank 0
        # wrote otherwise: kd.load_model(path, root_rank=0) for a .keras).
        kd.callbacks.load_checkpoint(
            kd.callbacks.latest_checkpoint(args.checkpoint_dir), model)

    # Every rank holds the same weights, so every rank prints the same number.
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"rank {kd.rank()}: test accuracy: {accuracy:.4f} "
          f"({len(y_test)} images, chance 0.1)", flush=True)


if __name__ == "__main__":
    main()
