"""Trainer step checkpoints and faults under `kerasdist run`; one mode a job.

    python -m kerasdist.run -np 2 [--max-restarts K] python \
        tests/workers/trainer_fault_worker.py MODE CKPT_DIR LOG_DIR [options]

Every example carries its id in feature 0. The model's first layer drops
it, and in training records it: each rank appends one line per step to
LOG_DIR/ids.<tag>.a<attempt>.r<rank>.txt, "<optimizer step> <learning
rate> <ids...>", written and flushed before the next step, so the lines of
a job that is killed afterwards are on disk. The tests compare these
records with an uninterrupted job's.

Modes:
    reference  train seed 0 straight (step checkpoints on), save its state
               to LOG_DIR/<tag>.npy; then train seeds 1, 2, 3 without
               checkpoints and print their final losses (the run-to-run
               spread).
    run        the same training; with --kill-step S the rank --kill-rank
               SIGKILLs itself after step S on the first attempt, once a
               step checkpoint of that epoch is on disk (so the job
               resumes in the middle of an epoch). --step-sleep S sleeps S
               seconds after every step (a job slow enough to change its
               hosts while it runs); --mark-first-step has rank 0 write
               LOG_DIR/first.<tag>.a<attempt>, "<time.time()> <size>", at
               its attempt's first step.
    faults     the same training under --max-restarts, killed at a
               different point on each attempt (FAULTS below): in the
               background write of a step checkpoint, in an epoch
               checkpoint's write, in the broadcast of a resumed state.
               Rank 0 prints "committed NAME" for every checkpoint put in
               place, so the test knows which one each restart must use.

Prints "LOSS <x>" (the trained model's loss on the whole training set) and
"DONE"; a failed check raises (exit != 0). In an elastic job (`kerasdist run
--host-discovery-script`) every rank also prints, at exit, whether SIGUSR1
(the launcher's resize request) reached it: "worker: SIGUSR1 seen: <bool>"
(its own handler, which kd.init()'s handler calls after noting the request).
"""

import argparse
import atexit
import glob
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist.tensorflow import collectives  # noqa: E402
from kerasdist.trainer import checkpoints  # noqa: E402
from kerasdist.trainer import snapshot  # noqa: E402
from tests.support import host_faults  # noqa: E402

N = 240  # divisible by batch * size at np 1 and 2: no example dropped
BATCH = 8
EPOCHS = 3
EVERY = 4  # steps between step checkpoints
# The launcher's attempt, or torchrun's restart count under torchrun.
ATTEMPT = int(os.environ.get("KERASDIST_RESTART_ATTEMPT") or
              os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0")

# Attempt -> (where the write is killed, which file, the n-th such write of
# the attempt). "written": the temporary file is complete but neither
# synced nor renamed, and the fault cuts it to half its size (a write
# killed midway); "renamed": the file is in place; "committed": the
# manifest is in place, the older step checkpoint not yet pruned.
FAULTS = {
    0: ("written", "step-weights", 2),
    1: ("broadcast", None, 3),  # rank 1, in the resumed state's broadcast
    2: ("renamed", "step-weights", 2),
    3: ("written", "step-manifest", 2),
    4: ("committed", "step-manifest", 2),
    5: ("written", "epoch-weights", 1),
}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 8)).astype("float32")
    w = np.random.default_rng(7).normal(size=(8, 3)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int64")
    ids = np.arange(N, dtype="float32")[:, None]
    return np.concatenate([ids, x], axis=1), y


class _Log:
    file = None  # the open id log, or None: record nothing
    pending = []


def _record(ids):
    _Log.pending.append(ids.numpy().astype(np.int64).tolist())
    return 0


class IdTap(keras.layers.Layer):
    """Drops feature 0 (the example id); in training, records it."""

    def call(self, x, training=False):
        if training:
            tf.py_function(_record, [x[:, 0]], [tf.int32])
        return x[:, 1:]


class IdLog(keras.callbacks.Callback):
    """Writes one line per step: optimizer step, learning rate, ids."""

    def on_train_batch_end(self, batch, logs=None):
        ids = _Log.pending.pop(0) if _Log.pending else []
        assert not _Log.pending, "one batch of ids per step"
        if _Log.file is None:
            return
        step = int(self.model.optimizer.iterations)
        lr = float(keras.ops.convert_to_numpy(
            self.model.optimizer.learning_rate))
        _Log.file.write(f"{step} {lr!r} " + " ".join(map(str, ids)) + "\n")
        _Log.file.flush()


class Pace(keras.callbacks.Callback):
    """Sleeps after every step; rank 0 marks the attempt's first step."""

    def __init__(self, log_dir, tag, sleep=0.0, mark=False):
        super().__init__()
        self.path = os.path.join(log_dir, f"first.{tag}.a{ATTEMPT}")
        self.sleep, self.mark = sleep, mark

    def on_train_batch_end(self, batch, logs=None):
        if self.mark and kd.rank() == 0 and not os.path.exists(self.path):
            with open(self.path + ".tmp", "w") as f:
                f.write(f"{time.time()!r} {kd.size()}\n")
            os.rename(self.path + ".tmp", self.path)
        if self.sleep:
            time.sleep(self.sleep)


def die(why):
    print(f"worker: rank {kd.rank()} kills itself: {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def strike(how, why):
    """Ends this rank (kill, exception), freezes it (freeze) or cuts its
    test host off (drop: nftables drops every packet on the host's link;
    link_down: the link goes down; tests/cluster only)."""
    if how == "kill":
        die(why)
    print(f"worker: rank {kd.rank()} does {how}: {why}", flush=True)
    if how == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "drop":
        host_faults.drop_this_hosts_packets()
    elif how == "link_down":
        host_faults.take_this_hosts_link_down()
    elif how == "exception":
        raise RuntimeError(f"an injected error on rank {kd.rank()}")
    else:
        raise ValueError(f"unknown fault {how!r}")


class Killer(keras.callbacks.Callback):
    """On attempt 0, rank `rank` dies (or `how`: see strike) after step
    `step`, once a step checkpoint of the current epoch is on disk."""

    def __init__(self, ckpt_dir, rank, step, how="kill"):
        super().__init__()
        self.ckpt_dir, self.rank, self.step = ckpt_dir, rank, step
        self.how = how
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if ATTEMPT != 0 or kd.rank() != self.rank or \
                int(self.model.optimizer.iterations) != self.step:
            return
        pattern = os.path.join(self.ckpt_dir,
                               f"epoch-{self.epoch:06d}-sample-*.json")
        deadline = time.monotonic() + 120
        while not glob.glob(pattern) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert glob.glob(pattern), f"no step checkpoint {pattern}"
        strike(self.how, f"after step {self.step}")


class Toy(kd.Trainer):
    def __init__(self, extra_callbacks=(), **kwargs):
        super().__init__(**kwargs)
        self.extra_callbacks = list(extra_callbacks)

    def build_model(self):
        return keras.Sequential([
            keras.Input((9,)),
            IdTap(name="ids"),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dropout(0.2, name="drop"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ])

    def train_data(self):
        return data()

    def callbacks(self):
        return [IdLog(), *self.extra_callbacks]


def settings(ckpt_dir, seed=0):
    return dict(epochs=EPOCHS, batch_size=BATCH, learning_rate=0.01,
                warmup_epochs=2, checkpoint_dir=ckpt_dir,
                checkpoint_every_steps=EVERY if ckpt_dir else None,
                seed=seed, verbose=2)


def flat_state(model):
    arrays = [np.asarray(v, np.float64).ravel() for v in model.weights]
    arrays += [np.asarray(v, np.float64).ravel()
               for v in model.optimizer.variables]
    return np.concatenate(arrays)


def open_log(log_dir, tag):
    path = os.path.join(log_dir, f"ids.{tag}.a{ATTEMPT}.r{kd.rank()}.txt")
    _Log.file = open(path, "w")


def train(args, seed=0, callbacks=()):
    trainer = Toy(extra_callbacks=callbacks,
                  **settings(args.ckpt_dir, seed=seed))
    trainer.fit()
    loss = trainer.evaluate(data())["loss"]
    return trainer, loss


def finish(args, trainer, loss):
    if kd.rank() == 0:
        np.save(os.path.join(args.log_dir, f"{args.tag}.npy"),
                flat_state(trainer.model))
    print(f"LOSS {loss!r}", flush=True)


def mode_reference(args):
    open_log(args.log_dir, args.tag)
    trainer, loss = train(args)
    finish(args, trainer, loss)
    _Log.file = None
    args.ckpt_dir = None
    for seed in (1, 2, 3):
        _, other = train(args, seed=seed)
        print(f"SPREAD {seed} {other!r}", flush=True)


def mode_run(args):
    open_log(args.log_dir, args.tag)
    killer = []
    if args.kill_step is not None:
        killer = [Killer(args.ckpt_dir, args.kill_rank, args.kill_step,
                         args.kill_how)]
    if args.step_sleep or args.mark_first_step:
        killer.append(Pace(args.log_dir, args.tag, args.step_sleep,
                           args.mark_first_step))
    trainer, loss = train(args, callbacks=killer)
    finish(args, trainer, loss)


def install_faults():
    """Arms this attempt's fault (FAULTS) and the commit report."""
    point, kind, nth = FAULTS.get(ATTEMPT, (None, None, 0))
    seen = [0]

    def hook(where, path):
        name = os.path.basename(path)
        if where == "committed":
            print(f"worker: committed {name}", flush=True)
        step = "-sample-" in name
        what = ("step-" if step else "epoch-") + (
            "weights" if name.endswith(".weights.h5") else "manifest")
        if where != point or what != kind:
            return
        seen[0] += 1
        if seen[0] == nth:
            if where == "written":
                os.truncate(path, os.path.getsize(path) // 2)
            die(f"at {where} of {name}")

    checkpoints._fault_hook = hook
    # The faults are counted by checkpoint (the n-th step manifest of an
    # attempt): every due step checkpoint must be taken. The Trainer skips
    # one while the previous write is in flight (a step never waits for
    # the disk), which under load left an attempt with one step checkpoint
    # where its fault needs two; here a due step waits for the writer.
    def wait_then_free(steps):
        steps.wait()
        return False

    snapshot.StepCheckpoints.busy = wait_then_free
    if point == "broadcast" and kd.rank() == 1:
        real = collectives.broadcast

        def broadcast(tensor, root_rank, name=None):
            if name and name.startswith("kerasdist.trainer.sync."):
                seen[0] += 1
                if seen[0] == nth:
                    die(f"in the broadcast {name}")
            return real(tensor, root_rank, name=name)

        collectives.broadcast = broadcast


def mode_faults(args):
    if kd.rank() == 0:
        manifest = checkpoints.latest(args.ckpt_dir)
        print("worker: newest on disk: "
              + (os.path.basename(manifest["weights_path"]) if manifest
                 else "none"), flush=True)
    install_faults()
    trainer, loss = train(args)
    if kd.rank() == 0:
        left = sorted(n for n in os.listdir(args.ckpt_dir)
                      if n.startswith(".tmp-"))
        assert not left, left
    finish(args, trainer, loss)


def note_resize_requests():
    """In an elastic job: a SIGUSR1 handler of the program's own, and a line
    at exit saying whether it ran."""
    if os.environ.get("KERASDIST_ELASTIC") != "1":
        return
    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    atexit.register(lambda: print(f"worker: SIGUSR1 seen: {bool(seen)}",
                                  flush=True))


def main():
    note_resize_requests()
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["reference", "run", "faults"])
    p.add_argument("ckpt_dir")
    p.add_argument("log_dir")
    p.add_argument("--tag", default="run")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-step", type=int)
    p.add_argument("--kill-how", default="kill",
                   choices=["kill", "freeze", "drop", "link_down",
                            "exception"])
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--mark-first-step", action="store_true")
    args = p.parse_args()
    kd.init()
    {"reference": mode_reference, "run": mode_run,
     "faults": mode_faults}[args.mode](args)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
