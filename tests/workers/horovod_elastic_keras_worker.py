"""Horovod's examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py
moved over to kerasdist (tests/integration/test_elastic.py), changed only
where marked "kerasdist:" -- the import, the two Keras 3 lines of
docs/moving_from_horovod.md, a small synthetic data set instead of
MNIST's download, fixed seeds, and the test's own arguments and records.

Every step trains on the same batch (one batch of data per rank, repeated,
not shuffled), so the data's position after a resume does not matter: a
run resumed from its last commit must end with the uninterrupted run's
weights.

argv: OUT [--epochs E] [--steps S] [--grow HOSTS_FILE]
  OUT        rank 0 writes OUT/weights-a<attempt>.npz at the end; each
             rank appends "attempt global_step pid" lines to
             OUT/progress-<rank> after every batch
  --grow F   rank 0 of attempt 0 writes "localhost:2" into F (the
             discovery script's list) after 3 steps
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf

import kerasdist as hvd  # kerasdist: was `import horovod.tensorflow.keras`

parser = argparse.ArgumentParser(
    description='Tensorflow 2.0 Keras MNIST Example')

parser.add_argument('--use-mixed-precision', action='store_true', default=False,
                    help='use mixed precision for training')
# kerasdist: the test's arguments.
parser.add_argument('out')
parser.add_argument('--epochs', type=int, default=3)
parser.add_argument('--steps', type=int, default=12)
parser.add_argument('--grow', default=None)

args = parser.parse_args()

if args.use_mixed_precision:
    from tensorflow.keras import mixed_precision
    mixed_precision.set_global_policy('mixed_float16')

# kerasdist: fixed seeds, so that two runs can be compared.
tf.keras.utils.set_random_seed(1234)
tf.config.experimental.enable_op_determinism()

# Horovod: initialize Horovod.
hvd.init()
ATTEMPT = int(os.environ.get('KERASDIST_RESTART_ATTEMPT', '0'))

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

# kerasdist: one batch of 16 synthetic 12x12 images per rank, instead of
# tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank()).
rng = np.random.default_rng(hvd.rank())
mnist_images = rng.integers(0, 256, (16, 12, 12)).astype(np.uint8)
mnist_labels = rng.integers(0, 10, 16)

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
             tf.cast(mnist_labels, tf.int64))
)
# kerasdist: no .shuffle(10000), and batches of 16 (Horovod: 128).
dataset = dataset.repeat().batch(16)

model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),  # kerasdist: 32
    tf.keras.layers.Conv2D(16, [3, 3], activation='relu'),  # kerasdist: 64
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation='relu'),  # kerasdist: 128
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# kerasdist: no experimental_run_tf_function=False (Keras 3 refuses it).
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=['accuracy'])

# Horovod: initialize optimizer state so we can synchronize across workers
# Keras has empty optimizer variables() for TF2:
# https://sourcegraph.com/github.com/tensorflow/tensorflow@v2.4.1/-/blob/tensorflow/python/keras/optimizer_v2/optimizer_v2.py#L351:10
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)

def on_state_reset():
    # kerasdist: was tf.keras.backend.set_value(state.model.optimizer.lr, ...)
    state.model.optimizer.learning_rate.assign(0.001 * hvd.size())
    # Re-initialize, to join with possible new ranks
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)
    print(f'reset at size {hvd.size()}', flush=True)  # kerasdist: a record

state.register_reset_callbacks([on_state_reset])


# kerasdist: the test's records.
class Progress(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        with open(os.path.join(args.out, f'progress-{hvd.rank()}'), 'a') as f:
            f.write(f'{ATTEMPT} {int(opt.iterations)} {os.getpid()}\n')
        if args.grow and ATTEMPT == 0 and hvd.rank() == 0 and \
                int(opt.iterations) == 4:
            with open(args.grow, 'w') as f:
                f.write('localhost:2\n')
            # kerasdist: hold the training until the launcher's resize
            # request (SIGUSR1) is here, so that it comes before the last
            # commit however slow the launcher's discovery is under load.
            from kerasdist._core import resize as _resize
            deadline = time.monotonic() + 120
            while not _resize.requested() and time.monotonic() < deadline:
                time.sleep(0.05)


callbacks = [
    Progress(),  # kerasdist: first, so it sees each batch before a commit
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from
# corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.out, 'checkpoint-{epoch}.h5')))  # kerasdist: OUT/

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
@hvd.elastic.run
def train(state):
    print(f'start attempt {ATTEMPT} size {hvd.size()} epoch {state.epoch} '
          f'batch {state.batch} iterations {int(opt.iterations)} '
          f'lr {float(opt.learning_rate):.4f}', flush=True)  # kerasdist
    state.model.fit(dataset, steps_per_epoch=args.steps // hvd.size(),
                    epochs=args.epochs-state.epoch, callbacks=callbacks,
                    verbose=0)  # kerasdist: 500 steps, 24 epochs, verbose=1

train(state)

# kerasdist: the test's record of the result.
if hvd.rank() == 0:
    np.savez(os.path.join(args.out, f'weights-a{ATTEMPT}.npz'),
             *[np.array(v.numpy()) for v in
               model.variables + opt.variables])
print(f'finished size {hvd.size()} epoch {state.epoch} iterations '
      f'{int(opt.iterations)} lr {float(opt.learning_rate):.4f}', flush=True)
