"""Horovod's TensorFlow 2 custom-loop MNIST example, moved to kerasdist.

Horovod's `examples/tensorflow2/tensorflow2_mnist.py`, line by line, with
only the changes docs/moving_from_horovod.md lists: the import,
`opt.variables` (a property in Keras 3, where Horovod's Keras 2 had a
method), and the scikit-learn digits (8x8, no download) instead of
MNIST, with `--steps` to shorten the run. TensorFlow only (it uses
`tf.GradientTape` and `tf.function`):

    python -m kerasdist.run -np 2 python examples/horovod_tensorflow2_mnist.py
"""

import argparse

import tensorflow as tf
from sklearn.datasets import load_digits

import kerasdist.tensorflow as hvd  # Horovod: import horovod.tensorflow as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=10000,
                    help="batches in total, split over the ranks")
parser.add_argument("--checkpoint-dir", default="./checkpoints")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

# Was: tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())
mnist_images, mnist_labels = load_digits(return_X_y=True)
mnist_images = mnist_images.reshape(-1, 8, 8)

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 16.0, tf.float32),
     tf.cast(mnist_labels, tf.int64))
)
dataset = dataset.repeat().shuffle(10000).batch(128)

mnist_model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
    tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])
loss = tf.losses.SparseCategoricalCrossentropy()

# Horovod: adjust learning rate based on number of GPUs.
opt = tf.optimizers.Adam(0.001 * hvd.size())

checkpoint_dir = args.checkpoint_dir
checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        probs = mnist_model(images, training=True)
        loss_value = loss(labels, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape)

    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other
    # processes. This is necessary to ensure consistent initialization of
    # all workers when training is started with random weights or restored
    # from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to
    # ensure optimizer initialization.
    if first_batch:
        hvd.broadcast_variables(mnist_model.variables, root_rank=0)
        # Was: opt.variables() (a method of Keras 2's optimizers)
        hvd.broadcast_variables(opt.variables, root_rank=0)

    return loss_value


# Horovod: adjust number of steps based on number of GPUs.
for batch, (images, labels) in enumerate(
        dataset.take(args.steps // hvd.size())):
    loss_value = training_step(images, labels, batch == 0)

    if batch % 10 == 0 and hvd.local_rank() == 0:
        print('Step #%d\tLoss: %.6f' % (batch, loss_value))

# Horovod: save checkpoints only on worker 0 to prevent other workers from
# corrupting it.
if hvd.rank() == 0:
    checkpoint.save(checkpoint_dir)
