"""A Keras fit whose rank 0 shows the progress bar (verbose=1) while rank 1
writes lines in two pieces, as print() does under `python -u`.

    kerasdist run -np 2 python progress_bar_worker.py

Each step sleeps, so the bar redraws over about 2 s per epoch.
"""

import sys
import time

import keras
import numpy as np

import kerasdist as kd

STEPS, EPOCHS = 16, 2

kd.init()


class SlowAndTalking(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.1)
        if kd.rank() == 1 and batch % 3 == 0:
            sys.stdout.write(f"rank one line {batch} ")
            sys.stdout.flush()
            time.sleep(0.02)
            sys.stdout.write("done\n")
            sys.stdout.flush()


x = np.random.default_rng(0).random((STEPS * 8, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
              loss="mse")
model.fit(x, y, batch_size=8, epochs=EPOCHS, callbacks=[SlowAndTalking()],
          verbose=1 if kd.rank() == 0 else 0)
print(f"finished on rank {kd.rank()}")
