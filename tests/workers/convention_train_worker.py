"""A few steps of Keras training with DistributedOptimizer, however the
process was started (`kerasdist run`, or a platform's variables): rank 0
saves the final weights to OUT.npz, so that two ways of starting the same
job can be compared.

    python tests/workers/convention_train_worker.py OUT.npz
"""

import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import kerasdist as kd  # noqa: E402

kd.init()
rank, size = kd.rank(), kd.size()
keras.utils.set_random_seed(1234)  # the same initial weights everywhere
model = keras.Sequential([keras.Input((8,)),
                          keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
data = np.random.default_rng(7).normal(size=(size * 4 * 6, 9))
mine = data[rank::size]
opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
model.compile(optimizer=opt, loss="mse")
model.fit(mine[:, :8], mine[:, 8:], batch_size=4, epochs=1, shuffle=False,
          verbose=0)
weights = model.get_weights()
if rank == 0:
    np.savez(sys.argv[1], *weights)
print("trained", rank, size, flush=True)
