"""Horovod's Keras MNIST example, moved to kerasdist and Keras 3.

Horovod's `examples/tensorflow2/tensorflow2_keras_mnist.py`, line by line,
with the changes docs/moving_from_horovod.md lists: the import, Keras 3
instead of `tf.keras`, no `experimental_run_tf_function`, a checkpoint name
Keras 3 accepts, and the scikit-learn digits (no download) instead of
MNIST. It runs unchanged on every Keras backend:

    KERAS_BACKEND=tensorflow python -m kerasdist.run -np 2 \\
        python examples/horovod_keras_mnist.py
    KERAS_BACKEND=jax python -m kerasdist.run -np 2 \\
        python examples/horovod_keras_mnist.py
    KERAS_BACKEND=torch python -m kerasdist.run -np 2 \\
        python examples/horovod_keras_mnist.py

Rank 0 writes `checkpoint-<epoch>.keras` into the working directory (or
--checkpoint-dir) and, at the end, loads the last one with plain Keras.
"""

import argparse
import os

import keras
import numpy as np
from sklearn.datasets import load_digits

import kerasdist as hvd  # Horovod: import horovod.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--checkpoint-dir", default=".")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process):
# on TensorFlow as in Horovod's example (tf.config); JAX and PyTorch see
# the GPU that CUDA_VISIBLE_DEVICES leaves them.

images, labels = load_digits(return_X_y=True)
images = (images / 16.0).astype("float32")
# Horovod: each rank trains on its own part of the data.
images, labels = hvd.data.shard((images, labels))

model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.25),
    keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.002 * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients. (Keras 3: the
# argument is gone, and DistributedOptimizer needs nothing in its place.)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
              optimizer=opt,
              metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other
    # processes. This is necessary to ensure consistent initialization of
    # all workers when training is started with random weights or restored
    # from a checkpoint.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads
    # to worse final accuracy. Scale the learning rate
    # `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during the first three
    # epochs.
    hvd.callbacks.LearningRateWarmupCallback(
        initial_lr=scaled_lr, warmup_epochs=min(3, args.epochs), verbose=1),

    # (kerasdist: shards may differ by one example; end every epoch at the
    # same step on every rank.)
    hvd.callbacks.EqualizeStepsCallback(),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from
# corrupting them. (Keras 3: a whole model ends in .keras, not .h5.)
checkpoint = os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(checkpoint))

# Horovod: write logs on worker 0.
verbose = 2 if hvd.rank() == 0 else 0

model.fit(images, labels, batch_size=32, callbacks=callbacks,
          epochs=args.epochs, verbose=verbose)

# Every rank holds the same weights: the same accuracy everywhere.
x_all, y_all = load_digits(return_X_y=True)
x_all = (x_all / 16.0).astype("float32")
_, accuracy = model.evaluate(x_all, y_all, verbose=0)
print(f"rank {hvd.rank()}: accuracy {accuracy:.4f} "
      f"on {keras.backend.backend()}", flush=True)
if hvd.rank() == 0:
    # The checkpoint is a plain Keras file: it loads without kerasdist (the
    # optimizer comes back as the plain Adam it wraps).
    loaded = keras.models.load_model(checkpoint.format(epoch=args.epochs))
    same = all(np.array_equal(a, b) for a, b in
               zip(loaded.get_weights(), model.get_weights()))
    print(f"checkpoint reloaded: {type(loaded.optimizer).__name__}, "
          f"same weights: {same}", flush=True)
