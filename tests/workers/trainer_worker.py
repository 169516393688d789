"""kerasdist.Trainer under `kerasdist run -np N`; one mode per job.

    python -m kerasdist.run -np 2 python tests/workers/trainer_worker.py \
        MODE CKPT_DIR OUT_NPY [options]

Modes:
    train     train 4 epochs straight; run every check of a trained job
              and save the final state to OUT_NPY (rank 0).
    resume    the same job (--epochs E of it, default 4), to be killed
              and relaunched: --kill-after-epoch K SIGKILLs the last rank
              right after epoch K's checkpoint; --kill-in-epoch K SIGKILLs
              it in the middle of epoch K on the first attempt only
              (KERASDIST_RESTART_ATTEMPT == "0").
    corrupt   resume from CKPT_DIR (its newest checkpoint was damaged by
              the test), then check that a directory whose checkpoints
              are all damaged (--all-bad DIR) gives CheckpointError.
    finetune  Trainer.from_checkpoint(CKPT_DIR) at this job's size and
              fine_tune on new data (--new-dir for its checkpoints).

Prints `OK <check>` per passed check; a failed check raises (exit != 0).
Truths are independent of the Trainer: allgathered raw values, plain
Keras evaluation of the whole data set, hashlib checksums, the bytes of
the checkpoint files loaded into a fresh Keras model.
"""

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist.trainer import checkpoints  # noqa: E402

EPOCHS = 4
BATCH = 16
N_TRAIN = 201  # odd: the shards differ by one example at np 2 and 3
N_VAL = 61


def make_data(n, seed, shift=0.0):
    """A 3-class problem: the label is the argmax of a fixed projection."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32") + np.float32(shift)
    w = np.random.default_rng(7).normal(size=(8, 3)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int64")
    return x, y


def plain_model():
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", name="hidden"),
        keras.layers.Dropout(0.2, name="drop"),
        keras.layers.Dense(3, activation="softmax", name="out"),
    ])


class Killer(keras.callbacks.Callback):
    def __init__(self, after_epoch=None, in_epoch=None):
        super().__init__()
        self.after_epoch = after_epoch
        self.in_epoch = in_epoch
        self.epoch = 0

    def _die(self):
        print(f"worker: rank {kd.rank()} kills itself", flush=True)
        os.kill(os.getpid(), 9)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.in_epoch is not None and self.epoch + 1 == self.in_epoch
                and batch == 2 and kd.rank() == kd.size() - 1
                and os.environ.get("KERASDIST_RESTART_ATTEMPT") == "0"):
            self._die()

    def on_epoch_end(self, epoch, logs=None):
        # Runs after the Trainer's checkpoint callback (and its barrier).
        if epoch + 1 == self.after_epoch and kd.rank() == kd.size() - 1:
            self._die()


class Toy(kd.Trainer):
    def __init__(self, kill_after=None, kill_in=None, **kwargs):
        super().__init__(**kwargs)
        self.kill_after = kill_after
        self.kill_in = kill_in

    def build_model(self):
        return plain_model()

    def train_data(self):
        return make_data(N_TRAIN, 0)

    def val_data(self):
        x, y = make_data(N_VAL, 1)
        return tf.data.Dataset.from_tensor_slices((x, y))

    def callbacks(self):
        if self.kill_after or self.kill_in:
            return [Killer(self.kill_after, self.kill_in)]
        return []


def settings(ckpt_dir, **extra):
    return dict(epochs=EPOCHS, batch_size=BATCH, learning_rate=0.01,
                warmup_epochs=3, checkpoint_dir=ckpt_dir, keep_checkpoints=3,
                seed=5, verbose=2, **extra)


def gather(value, name):
    a = np.asarray(value, np.float64)
    return kd.allgather(a.reshape((1,) + a.shape), name=name).numpy()


def flat_state(model):
    arrays = [np.asarray(v, np.float64).ravel() for v in model.weights]
    arrays += [np.asarray(v, np.float64).ravel()
               for v in model.optimizer.variables]
    return np.concatenate(arrays)


def assert_same_on_ranks(value, tag):
    table = gather(value, f"test.same.{tag}")
    for r in range(kd.size()):
        np.testing.assert_array_equal(table[r], table[0], err_msg=tag)


def ok(check):
    print(f"OK {check}", flush=True)


def steps_per_epoch(n, size):
    return -(-(n // size) // BATCH)


def check_checkpoint_dir(ckpt_dir, epochs, size, step_per_epoch):
    names = sorted(n for n in os.listdir(ckpt_dir))
    expect = sorted([checkpoints.manifest_name(e) for e in epochs]
                    + [checkpoints.weights_name(e) for e in epochs])
    assert names == expect, (names, expect)
    for e in epochs:
        with open(os.path.join(ckpt_dir, checkpoints.manifest_name(e))) as f:
            manifest = json.load(f)
        weights = os.path.join(ckpt_dir, checkpoints.weights_name(e))
        with open(weights, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        assert manifest["weights_sha256"] == digest, manifest
        assert manifest["epoch"] == e and manifest["world_size"] == size
        assert manifest["step"] == e * step_per_epoch, manifest
        assert set(manifest["versions"]) == {"kerasdist", "tensorflow",
                                             "keras"}
        assert manifest["versions"]["tensorflow"] == tf.__version__


def checkpoint_in_fresh_model(path):
    """A plain Keras model (no kerasdist) loaded from a checkpoint file."""
    model = plain_model()
    model.compile(keras.optimizers.Adam(0.01),
                  "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


def mode_train(args):
    trainer = Toy(**settings(args.ckpt_dir))
    history = trainer.fit()
    size = kd.size()
    steps = steps_per_epoch(N_TRAIN, size)
    assert trainer.initial_epoch == 0
    losses = history.history["loss"]
    assert len(losses) == EPOCHS and losses[-1] < losses[0], losses
    assert history.history["val_accuracy"][-1] > 0.5, history.history
    ok("metrics_improve")
    keys = sorted(history.history)
    assert_same_on_ranks([history.history[k] for k in keys], "history")
    ok("history_identical_on_ranks")
    assert_same_on_ranks(flat_state(trainer.model), "state")
    ok("weights_identical_on_ranks")
    assert int(trainer.optimizer.iterations) == EPOCHS * steps
    lr = float(trainer.optimizer.learning_rate)
    assert lr == float(np.float32(0.01 * size)), lr
    ok("steps_and_learning_rate")
    result = trainer.evaluate()
    x, y = make_data(N_VAL, 1)
    reference = trainer.model.evaluate(x, y, batch_size=N_VAL, verbose=0,
                                       return_dict=True)
    for k in ("loss", "accuracy"):
        # float32 sums in another order: equal to ~1e-6 relative.
        np.testing.assert_allclose(result[k], reference[k], rtol=1e-5)
    assert_same_on_ranks([result[k] for k in sorted(result)], "eval")
    ok("evaluate_is_whole_set_average")
    if kd.rank() == 0:
        check_checkpoint_dir(args.ckpt_dir, [2, 3, 4], size, steps)
        fresh = checkpoint_in_fresh_model(
            os.path.join(args.ckpt_dir, checkpoints.weights_name(4)))
        np.testing.assert_array_equal(flat_state(fresh),
                                      flat_state(trainer.model))
        np.save(args.out, flat_state(trainer.model))
    kd.barrier(name="test.ckpt_checked")
    ok("checkpoints_atomic_rotated_and_complete")
    check_data_is_sharded()


class PerRank(Toy):
    """Each rank returns its own part, of a different length per rank."""

    def train_data(self):
        x, y = make_data(30 + 7 * kd.rank(), 10 + kd.rank())
        return tf.data.Dataset.from_tensor_slices((x, y))

    def val_data(self):
        return make_data(5 + kd.rank(), 20 + kd.rank())


def check_data_is_sharded():
    # Rank 0 alone has built one model more by now (the checkpoint check):
    # the Trainer's gradient names must not depend on that.
    trainer = PerRank(epochs=2, batch_size=BATCH, learning_rate=0.01,
                      data_is_sharded=True, verbose=0, seed=1)
    history = trainer.fit()
    # The smallest part (rank 0: 30 examples) decides: 2 steps an epoch.
    assert int(trainer.optimizer.iterations) == 2 * 2
    assert_same_on_ranks(flat_state(trainer.model), "sharded")
    assert_same_on_ranks(history.history["val_loss"], "sharded.val")
    ok("data_is_sharded_uneven_parts")


def mode_resume(args):
    trainer = Toy(kill_after=args.kill_after_epoch,
                  kill_in=args.kill_in_epoch,
                  **dict(settings(args.ckpt_dir), epochs=args.epochs))
    trainer.fit()
    print(f"worker: initial_epoch {trainer.initial_epoch}", flush=True)
    assert_same_on_ranks(flat_state(trainer.model), "state")
    if kd.rank() == 0:
        np.save(args.out, flat_state(trainer.model))
    ok("resumed_job_finished")


def mode_corrupt(args):
    trainer = Toy(**settings(args.ckpt_dir))
    trainer.fit()
    assert trainer.initial_epoch == 3, trainer.initial_epoch
    if kd.rank() == 0:
        np.save(args.out, flat_state(trainer.model))
    ok("fell_back_to_previous_checkpoint")
    try:
        Toy(**settings(args.all_bad)).fit()
    except checkpoints.CheckpointError as e:
        # Rank 0 read the checkpoints and says what it found; the others
        # heard only that it failed.
        want = ("Every checkpoint in" if kd.rank() == 0
                else "rank 0 could not load")
        assert want in str(e), e
    else:
        raise AssertionError("all-damaged checkpoints did not raise")
    ok("all_damaged_raises")


def mode_finetune(args):
    size = kd.size()
    source = checkpoints.latest(args.ckpt_dir)
    # verbose=2: rank 0 says which checkpoint it loaded (and prints a
    # line per epoch).
    trainer = Toy.from_checkpoint(args.ckpt_dir, checkpoint_dir=args.new_dir,
                                  verbose=2)
    x_new, y_new = make_data(150, 3, shift=0.5)
    before = trainer.evaluate((x_new, y_new))
    expected = checkpoint_in_fresh_model(source["weights_path"])
    np.testing.assert_array_equal(
        np.concatenate([np.ravel(w) for w in trainer.model.get_weights()]),
        np.concatenate([np.ravel(w) for w in expected.get_weights()]))
    assert int(trainer.optimizer.iterations) == source["step"]
    ok("loaded_checkpoint_state")
    hidden = trainer.model.get_layer("hidden").get_weights()
    out = trainer.model.get_layer("out").get_weights()
    history = trainer.fine_tune((x_new, y_new), epochs=3,
                                learning_rate=0.02, freeze=["hidden"])
    assert trainer.initial_epoch == EPOCHS
    assert len(history.history["loss"]) == 3
    for a, b in zip(trainer.model.get_layer("hidden").get_weights(), hidden):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(a != b) for a, b in
               zip(trainer.model.get_layer("out").get_weights(), out))
    ok("freeze_by_name")
    after = trainer.evaluate((x_new, y_new))
    assert after["loss"] < before["loss"], (before, after)
    lr = float(trainer.optimizer.learning_rate)
    assert lr == float(np.float32(0.02 * size)), lr
    assert_same_on_ranks(flat_state(trainer.model), "finetuned")
    ok("fine_tune_improves_on_new_data")
    steps = steps_per_epoch(150, size)
    if kd.rank() == 0:
        names = sorted(os.listdir(args.new_dir))
        assert names == sorted(
            [checkpoints.manifest_name(e) for e in (5, 6, 7)]
            + [checkpoints.weights_name(e) for e in (5, 6, 7)]), names
        manifest = checkpoints.latest(args.new_dir)
        assert manifest["epoch"] == 7 and manifest["world_size"] == size
        assert manifest["step"] == source["step"] + 3 * steps
        assert manifest["phase"] == "fine_tune"
    kd.barrier(name="test.finetune_checked")
    ok("fine_tune_checkpoints")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "resume", "corrupt", "finetune"])
    p.add_argument("ckpt_dir")
    p.add_argument("out")
    p.add_argument("--kill-after-epoch", type=int)
    p.add_argument("--kill-in-epoch", type=int)
    p.add_argument("--epochs", type=int, default=EPOCHS,
                   help="resume mode: epochs to train (default %(default)s)")
    p.add_argument("--all-bad")
    p.add_argument("--new-dir")
    args = p.parse_args()
    kd.init()
    {"train": mode_train, "resume": mode_resume, "corrupt": mode_corrupt,
     "finetune": mode_finetune}[args.mode](args)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
