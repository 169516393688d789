"""Trainer(shard="optimizer_state") whose checkpoint_dir is not one
directory for every rank (issue 49, item 5): each rank runs in a working
directory of its own under ROOT (ROOT/rank<r>, as a local disk of each
host) and names the checkpoint directory by the same relative path, so
each rank sees a directory of its own under one name.

    python -m kerasdist.run -np 2 python \
        tests/workers/unshared_dir_worker.py ROOT

Prints "fit started" before fit(), "trained" if fit() returns (it must
not: the Trainer refuses the directory before the first checkpoint).
"""

import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402


class Toy(kd.Trainer):
    def build_model(self):
        return keras.Sequential([keras.Input((4,)),
                                 keras.layers.Dense(2, name="out")])

    def train_data(self):
        rng = np.random.default_rng(1)
        return rng.normal(size=(32, 4)), rng.normal(size=(32, 2))

    def build_loss(self):
        return "mse"

    def build_metrics(self):
        return []


def main():
    kd.init()
    own = os.path.join(sys.argv[1], f"rank{kd.rank()}")
    os.makedirs(own, exist_ok=True)
    os.chdir(own)
    trainer = Toy(epochs=1, batch_size=8, seed=3, verbose=0,
                  checkpoint_dir="ckpt", shard="optimizer_state")
    print("fit started", flush=True)
    trainer.fit()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
