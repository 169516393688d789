"""A kerasdist.Trainer job that loses a rank and recovers in place
(tests/cluster/test_trainer_recovery.py).

A linear model (Dense(2), zero weights, mean squared error, SGD with
momentum 0.9, learning rate 0.01 scaled by the number of ranks) trains for
EPOCHS epochs on a fixed data set, in order (shuffle=False), BATCH
examples per rank and step, committed in memory every COMMIT_EVERY steps;
step checkpoints on disk every 4 steps and epoch checkpoints go to
DIR/ckpt. The rank KILL_RANK (or each of a comma-separated list)
SIGKILLs itself at the start of the step
with index KILL_STEP (the optimizer's iteration count then), so the others
are in that step's gradient allreduce when it goes.

Each rank writes DIR/start.<rank>.json (its pid, rank and size at the
start) and, when `fit` returns, DIR/end.<start rank>.json: its pid, rank,
size, optimizer step, learning rate, the final weights and the wall time
(time.time()) each step ended ([optimizer step, time] pairs). The killed
rank writes DIR/kill.json (the step and the wall time) first.

argv: DIR KILL_RANK KILL_STEP [SHARD] (SHARD: the Trainer's `shard`, e.g.
      optimizer_state; none by default)
env: KERAS_BACKEND (torch, jax or tensorflow); TRAINER_GROW_LIST=FILE and
     TRAINER_GROW_AT=STEP: rank 0 of a job of 2 ranks writes
     "localhost:3" to FILE (the launcher's discovery script prints it) once
     the optimizer's step STEP is done, and waits (up to 60 s) for the
     launcher's resize request, so that the job stops for it at its next
     step checkpoint, whatever the steps cost (TRAINER_GROW_JOIN=1, over
     TCP: the test then starts a process that joins, and rank 0 waits
     until it waits at the rendezvous); TRAINER_SHRINK_AT=STEP
     instead: rank 0 of a job of 3 ranks writes "localhost:2" there, and
     waits likewise (the job shrinks in place at its next commit). Rank 0
     waits (up to 120 s) at the end of a step while a grow in place starts
     its new ranks. TRAINER_CALLS: the Trainer's training calls, "fit"
     (the default) or "fine_tune" (`fine_tune(data(), EPOCHS)` on the
     fresh Trainer, which trains as fit does), or "fit,fine_tune" (then
     one epoch more of fine-tuning).

The data and settings import without Keras (the test's numpy truth reads
them); Keras and kerasdist are imported by `main`.
"""

import json
import os
import signal
import sys
import time

import numpy as np

N, FEATURES, OUTPUTS, BATCH, EPOCHS, LR, COMMIT_EVERY = 54, 3, 2, 2, 2, \
    0.01, 3


def data():
    """The fixed data set: (x, y), float32."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    w = np.arange(1.0, FEATURES * OUTPUTS + 1).reshape(FEATURES, OUTPUTS)
    y = (x @ w + 0.1 * rng.normal(size=(N, OUTPUTS))).astype(np.float32)
    return x, y


def _trainer(directory, kill_rank, kill_step, start_rank, done_at,
             **kwargs):
    """The job's Trainer; its callback kills this rank if it is in
    `kill_rank` (a set) at the start of step `kill_step`, and notes when
    each step ends in `done_at`."""
    import keras

    import kerasdist

    class Kill(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if start_rank in kill_rank and \
                    int(self.model.optimizer.iterations) == kill_step:
                with open(os.path.join(directory, "kill.json"), "w") as f:
                    json.dump({"step": kill_step, "at": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations)
            done_at.append([step, time.time()])
            at = (start_rank, kerasdist.size(), str(step))
            sizes = {(0, 2, os.environ.get("TRAINER_GROW_AT")): 3,
                     (0, 3, os.environ.get("TRAINER_SHRINK_AT")): 2}
            from kerasdist._core import grow
            if at in sizes:
                with open(os.environ["TRAINER_GROW_LIST"], "w") as f:
                    f.write(f"localhost:{sizes[at]}\n")
                from kerasdist._core import resize
                asked = grow.waiting if os.environ.get(
                    "TRAINER_GROW_JOIN") == "1" else resize.requested
                deadline = time.monotonic() + 60
                while not asked() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if start_rank == 0 and grow.spawning():
                # A grow in place: the job trains on while the new rank
                # starts; here it waits for it (up to 120 s), so that the
                # new rank joins before the training ends.
                deadline = time.monotonic() + 120
                while grow.spawning() and time.monotonic() < deadline:
                    time.sleep(0.05)

    class Linear(kerasdist.Trainer):
        def build_model(self):
            return keras.Sequential([
                keras.Input((FEATURES,)),
                keras.layers.Dense(OUTPUTS, kernel_initializer="zeros")])

        def train_data(self):
            return data()

        def build_optimizer(self, learning_rate):
            return keras.optimizers.SGD(learning_rate, momentum=0.9)

        def build_loss(self):
            return "mean_squared_error"

        def build_metrics(self):
            return []

        def callbacks(self):
            return [Kill()]

    return Linear(**kwargs)


def main():
    directory, kill_step = sys.argv[1], int(sys.argv[3])
    kill_rank = {int(r) for r in sys.argv[2].split(",")}
    shard = sys.argv[4] if len(sys.argv) > 4 else None
    import keras

    import kerasdist

    kerasdist.init()
    start_rank = kerasdist.rank()
    with open(os.path.join(directory, f"start.{start_rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": start_rank,
                   "size": kerasdist.size()}, f)
    done_at = []
    trainer = _trainer(directory, kill_rank, kill_step, start_rank, done_at,
                       epochs=EPOCHS, batch_size=BATCH, learning_rate=LR,
                       shuffle=False,
                       commit_every_steps=COMMIT_EVERY,
                       checkpoint_dir=os.path.join(directory, "ckpt"),
                       checkpoint_every_steps=4, verbose=2, shard=shard)
    for call in os.environ.get("TRAINER_CALLS", "fit").split(","):
        if call == "fit":
            trainer.fit()
        else:
            trainer.fine_tune(data(), EPOCHS if trainer.model is None
                              else 1)
    model = trainer.model
    with open(os.path.join(directory, f"end.{start_rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": kerasdist.rank(),
                   "size": kerasdist.size(),
                   "step": int(trainer.optimizer.iterations),
                   "lr": float(keras.ops.convert_to_numpy(
                       trainer.optimizer.learning_rate)),
                   "kernel": keras.ops.convert_to_numpy(
                       model.layers[-1].kernel).tolist(),
                   "bias": keras.ops.convert_to_numpy(
                       model.layers[-1].bias).tolist(),
                   "done_at": done_at}, f)
    print(f"rank {start_rank} done at size {kerasdist.size()}", flush=True)


if __name__ == "__main__":
    main()
