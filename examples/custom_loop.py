"""A custom training loop with kerasdist.DistributedGradientTape.

    python -m kerasdist.run -np 2 python examples/custom_loop.py

Each rank trains on its own shard of a synthetic regression problem; the
tape averages gradients over ranks, so every rank applies the same update.
"""

import argparse

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import kerasdist as kd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="per rank")
    parser.add_argument("--examples", type=int, default=2048,
                        help="in total, split over the ranks")
    args = parser.parse_args()

    kd.init()
    # The same data on every rank (same seed); each takes every size()-th row.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.examples, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) + np.sin(x[:, :1])).astype("float32")
    shard = tf.data.Dataset.from_tensor_slices((x, y)).shard(kd.size(),
                                                             kd.rank())
    # Equal batch counts on every rank: each step's collectives must match.
    shard = shard.take(args.examples // kd.size())
    shard = shard.shuffle(1024, seed=kd.rank()).batch(args.batch_size,
                                                      drop_remainder=True)

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    # Scale the learning rate with the number of ranks (the global batch grows).
    optimizer = keras.optimizers.Adam(1e-3 * kd.size())
    optimizer.build(model.trainable_variables)
    # Start from rank 0's weights.
    kd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = kd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for epoch in range(args.epochs):
        losses = [train_step(xb, yb) for xb, yb in shard]
        # Average the epoch's mean loss over ranks for the printout.
        loss = kd.allreduce(tf.reduce_mean(losses), name=f"loss.{epoch}")
        if kd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {float(loss):.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
