"""Data-parallel training with kerasdist.Trainer: subclass, fit, resume.

Dataset: scikit-learn's 8x8 handwritten digits (`load_digits`, 1,797
images of 0-9), shipped inside scikit-learn: no download.

    python -m kerasdist.run -np 2 python examples/trainer_mnist.py \
        --epochs 5 --checkpoint-dir /tmp/digits-trainer

Run it again with the same --checkpoint-dir (or with
`kerasdist run --max-restarts 2 ...`) and it resumes from the newest
checkpoint instead of starting over.
"""

import argparse

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kerasdist as kd


def _digits():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    return train_test_split(x, y.astype("int64"), test_size=0.2,
                            random_state=0, stratify=y)


class DigitsTrainer(kd.Trainer):
    """Everything kerasdist-specific lives in the base class."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.x_train, self.x_test, self.y_train, self.y_test = _digits()

    def build_model(self):
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(10, activation="softmax"),
        ])

    def train_data(self):  # the whole set; the Trainer shards it
        return self.x_train, self.y_train

    def val_data(self):
        return self.x_test, self.y_test


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="per rank; one step uses batch-size * size().")
    parser.add_argument("--lr", type=float, default=0.002,
                        help="single-process learning rate.")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    trainer = DigitsTrainer(
        epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.lr, warmup_epochs=min(2, args.epochs),
        checkpoint_dir=args.checkpoint_dir, seed=1234, verbose=2)
    trainer.fit()
    # Averaged over the ranks' shards of the test set; the same everywhere.
    metrics = trainer.evaluate()
    print(f"rank {kd.rank()}: test accuracy: {metrics['accuracy']:.4f} "
          f"({len(trainer.y_test)} images, chance 0.1)", flush=True)


if __name__ == "__main__":
    main()
