"""`model.fit` recovering in place (tests/cluster/test_recovery_fit.py):
a linear Keras model (Dense(1), float64, SGD, mean squared error) under
`kerasdist.elastic.run` with `ElasticBatches` and `CommitCallback`, on the
backend KERAS_BACKEND names.

The data: `data()` (N examples, FEATURES features), EPOCHS epochs of
batches of BATCH, shuffled (SEED); the learning rate is LR * size(), set
again by a reset callback after a recovery. The rank KILL_RANK SIGKILLs
itself as it begins the job's step KILL_STEP (counted from 0 over the
epochs), so the others are in that step's allreduce when it goes.

Each rank writes DIR/start.<rank>.json (pid, rank, size) and, at the end,
DIR/end.<start rank>.json: pid, rank and size then, the final weights
(kernel, then bias), the learning rate, the position (epoch, batch, size)
after every step it trained and the wall time (time.time()) it ended,
and the position each reset resumed from.
The killed rank writes DIR/kill.json (the step, the wall time) first.

With SHARD (a `shard=` mode of DistributedOptimizer: "gradients",
"optimizer_state", "weights"), the optimizer is SGD with momentum
MOMENTUM, sharded: its momentum (with "weights", and the model's weights,
`kd.shard_weights`) survives the lost rank only through the buddy copies
(kerasdist/keras/sharding/buddies.py); end.<rank>.json then also holds
the momentum of this rank's shard at the end.

Growing in place (FIT_GROW_LIST=FILE, FIT_GROW_AT=STEP; KILL_RANK -1):
rank 0, once the job's step STEP is done, writes "localhost:3" to FILE
(the launcher's discovery script prints it) and waits (up to 60 s) for
the launcher's resize request; from the commit where the ranks begin to
start the new rank, each rank holds its next step until its part of that
start has ended (up to 120 s), so that the job grows at a commit in the
middle of training, whatever the new rank's start costs. FIT_GROW_JOIN=1
(over TCP): the test, or the launcher's discovery, starts a process that
joins once FILE is written, and rank 0 holds its next step until that
process waits to join. A rank that
joined writes its files as the others (its `resumed` is empty).
Shrinking in place: the same with FIT_GROW_TO (what rank 0 writes to
FILE, "localhost:2" to shrink a job of 3); a rank that leaves (`run`
raises SystemExit) writes DIR/left.<start rank>.json (pid, exit code,
weights, positions) and exits.

argv: DIR KILL_RANK KILL_STEP [SHARD]
"""

import json
import os
import signal
import sys
import time

import numpy as np

N, FEATURES, BATCH, EPOCHS, LR, SEED, COMMIT_EVERY = 60, 3, 4, 2, 0.01, 5, 2
MOMENTUM = 0.9


def data():
    """The fixed data set: (x, y), float64, y of shape (N, 1)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(N, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.5 + 0.1 * rng.normal(size=N)
    return x, y[:, None]


def _ask_to_grow(directory):
    """Lists a third slot for the launcher's discovery script, then waits
    for its resize request (the next commit begins to grow the job)."""
    from kerasdist._core import grow
    from kerasdist._core import resize
    with open(os.environ["FIT_GROW_LIST"], "w") as f:
        f.write(os.environ.get("FIT_GROW_TO", "localhost:3") + "\n")
    if os.environ.get("FIT_GROW_JOIN") == "1":
        # Over TCP the test starts a process that joins: held until it
        # waits at the rendezvous (the next commit lets it in).
        deadline = time.monotonic() + 120
        while not grow.waiting() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    deadline = time.monotonic() + 60
    while not resize.requested() and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(directory, "asked.json"), "w") as f:
        json.dump({"at": time.time(), "heard": resize.requested()}, f)


def _wait_for_the_new_ranks():
    """Holds this rank while its part of starting the new ranks runs."""
    from kerasdist._core import grow
    deadline = time.monotonic() + 120
    while grow.spawning() and time.monotonic() < deadline:
        time.sleep(0.05)


def _refusals(keras, kd):
    """The first line of each error that bad input to ElasticBatches and
    CommitCallback gives (a state without epoch and batch, data that is
    not an ElasticBatches, fit shuffling the batches)."""
    import random
    batches = kd.elastic.ElasticBatches(data(), batch_size=BATCH)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    attempts = [
        lambda: kd.elastic.CommitCallback(kd.elastic.ObjectState(x=0),
                                          batches),
        lambda: kd.elastic.CommitCallback(
            kd.elastic.ObjectState(epoch=0, batch=0), data()),
        # Keras shuffles the batches' order with `random` (seeded: never
        # the order itself).
        lambda: (random.seed(0),
                 model.fit(batches, epochs=1, verbose=0, shuffle=True))]
    refused = []
    for attempt in attempts:
        try:
            attempt()
            refused.append(None)
        except Exception as e:  # TF wraps the data's error in its own
            said = [line for line in str(e).splitlines()
                    if "ElasticBatches" in line or "CommitCallback" in line]
            refused.append(said[0] if said else f"{type(e).__name__}: {e}")
    return refused


def main():
    # Here, not at the top: the test reads data() and the constants
    # without importing a framework.
    if os.environ.get("KERAS_BACKEND") == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)
    import keras

    import kerasdist as kd

    out, kill_rank, kill_step = sys.argv[1], int(sys.argv[2]), \
        int(sys.argv[3])
    shard = sys.argv[4] if len(sys.argv) > 4 else None
    keras.config.set_floatx("float64")
    kd.init()
    start_rank, size_at_start = kd.rank(), kd.size()
    grow_at = int(os.environ.get("FIT_GROW_AT", "-1"))
    refused = _refusals(keras, kd) if shard is None and grow_at < 0 else []
    with open(os.path.join(out, f"start.{start_rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": start_rank,
                   "size": kd.size(), "refused": refused}, f)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(1, kernel_initializer="zeros")])
    if shard == "weights":
        kd.shard_weights(model)
    if shard is None:
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(LR * kd.size()))
    else:
        opt = kd.DistributedOptimizer(
            keras.optimizers.SGD(LR * kd.size(), momentum=MOMENTUM),
            shard=shard)
    model.compile(loss="mse", optimizer=opt)
    opt.build(model.trainable_variables)
    batches = kd.elastic.ElasticBatches(data(), batch_size=BATCH,
                                        shuffle=True, seed=SEED)
    state = kd.elastic.KerasState(model, epoch=0, batch=0)
    positions, resumed, steps, done_at = [], [], [0], []

    def on_reset():
        opt.learning_rate.assign(LR * kd.size())
        resumed.append([state.epoch, state.batch])

    state.register_reset_callbacks([on_reset])

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if (start_rank, steps[0]) == (kill_rank, kill_step):
                with open(os.path.join(out, "kill.json"), "w") as f:
                    json.dump({"step": steps[0], "at": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            steps[0] += 1
            # After CommitCallback's (listed after it): the position this
            # step reached.
            positions.append([state.epoch, state.batch, kd.size()])
            done_at.append(time.time())
            if grow_at >= 0:
                # In the first attempt only (a relaunch lists no more).
                if (start_rank, steps[0], kd.size()) == (
                        0, grow_at, size_at_start) and os.environ.get(
                        "KERASDIST_RESTART_ATTEMPT", "0") == "0":
                    _ask_to_grow(out)
                _wait_for_the_new_ranks()

    @kd.elastic.run
    def train(state):
        state.model.fit(batches, epochs=EPOCHS - state.epoch, shuffle=False,
                        verbose=0, callbacks=[
                            kd.elastic.CommitCallback(
                                state, batches,
                                batches_per_commit=COMMIT_EVERY), Record()])

    try:
        train(state)
    except SystemExit as e:  # this rank left the job (shrinking in place)
        kernel, bias = (np.asarray(v).ravel() for v in model.get_weights())
        with open(os.path.join(out, f"left.{start_rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "code": e.code,
                       "w": kernel.tolist() + bias.tolist(),
                       "positions": positions,
                       "state": [state.epoch, state.batch]}, f)
        raise
    # Whole (gathered, every rank) where the weights are sharded.
    kernel, bias = (np.asarray(v).ravel() for v in model.get_weights())
    with open(os.path.join(out, f"end.{start_rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": kd.rank(), "size": kd.size(),
                   "w": kernel.tolist() + bias.tolist(),
                   "lr": float(keras.ops.convert_to_numpy(
                       opt.learning_rate)),
                   "positions": positions, "resumed": resumed,
                   "done_at": done_at,
                   "state": [state.epoch, state.batch],
                   "slots": [np.asarray(keras.ops.convert_to_numpy(v))
                             .ravel().tolist() for v in
                             opt.kerasdist_sharded_variables]
                   if shard else []}, f)
    print(f"rank {start_rank} done at size {kd.size()}", flush=True)


if __name__ == "__main__":
    main()
