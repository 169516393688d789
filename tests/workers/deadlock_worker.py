"""Ranks that can never meet again in a collective, and one that is merely
slow: each mode is one scenario. Every rank prints `FAULT <time.time()>` at
the moment the job went wrong (the last moment a collective could still have
matched), so the test can time the end of the job from it.

    python deadlock_worker.py uneven|skip|slow|join_slow
"""

import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402

mode = sys.argv[1]


def fault():
    print(f"FAULT {time.time():.3f}", flush=True)


if mode == "uneven":
    # 65 examples at batch 32 on 2 ranks: rank 0's shard (33) has 2 batches,
    # rank 1's (32) one; no EqualizeStepsCallback. Rank 1 ends its epoch and
    # waits in MetricAverageCallback's allgather while rank 0 waits in its
    # second step's gradient allreduce.
    import keras
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    kd.init()
    rng = np.random.RandomState(0)
    x = rng.rand(65, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    xs, ys = kd.data.shard((x, y))

    class MarkEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            fault()

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
    model.fit(xs, ys, batch_size=32, epochs=2, verbose=0,
              callbacks=[MarkEpochEnd(), kd.callbacks.MetricAverageCallback()])
    print("FAIL fit returned", flush=True)

elif mode == "skip":
    # As in three of Horovod's own tests: at step 3 rank 1 fails before its
    # collective, catches the exception and goes on to the next step's.
    from tests.support.collectives import allreduce
    kd.init()
    for step in range(10):
        try:
            if kd.rank() == 1 and step == 3:
                raise ValueError("bad batch")
            allreduce(np.ones(2), f"step.{step}", op=kd.Sum)
        except ValueError:
            traceback.print_exc()
            fault()
    print("FAIL every step ran", flush=True)

elif mode == "slow":
    # Rank 1 sleeps twice the deadlock bound between collectives with nothing
    # pending, while rank 0 waits in the next one: not a deadlock.
    from tests.support.collectives import allreduce
    kd.init()
    pause = 2 * float(os.environ["KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS"])
    for step in range(3):
        if kd.rank() == 1 and step > 0:
            time.sleep(pause)
        out = allreduce(np.ones(2), f"step.{step}", op=kd.Sum)
        assert out.tolist() == [kd.size()] * 2, out
    print("OK slow", flush=True)

elif mode == "join_slow":
    # Rank 1 joins at once; rank 0 computes for twice the deadlock bound
    # with nothing pending, then runs allreduces rank 1 serves with zeros:
    # a rank waiting in join() is not a deadlock.
    from tests.support.collectives import allreduce
    kd.init()
    pause = 2 * float(os.environ["KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS"])
    if kd.rank() == 0:
        for step in range(2):
            time.sleep(pause / 2)
            out = allreduce(np.ones(2), f"step.{step}", op=kd.Sum)
            assert out.tolist() == [1.0, 1.0], out
    last = int(kd.join())
    assert last == 0, last
    print("OK join_slow", flush=True)

else:
    sys.exit(f"unknown mode {mode}")
