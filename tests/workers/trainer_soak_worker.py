"""A Trainer job that is broken again and again (tests/cluster/
test_faults.py's soak test), under `kerasdist run --max-restarts K
--min-np 1` on two test hosts with one rank each.

    python -m kerasdist.run ... python trainer_soak_worker.py \\
        CKPT_DIR STATE_DIR SEED FAULTS

(the test runs it through tests/support/forkserver.py, so that the ranks
of its 21 attempts do not each import TensorFlow).

The model and data are trainer_fault_worker's (every example carries its id
and each rank logs the ids it trains). Each attempt picks a fault from
random.Random(SEED + attempt): SIGKILL, SIGSTOP or an uncaught exception on
a random rank, or every packet on kdt1's link dropped (by the rank there;
the test takes the rule away again). It strikes after a random 1-4 steps of
this attempt, once a step checkpoint newer than the one the attempt resumed
from is on disk (so every attempt makes progress). Attempts from --faults on
run clean. At the end rank 0 loads the newest checkpoint into a fresh model
and compares it with the trained one, and every rank prints "DONE".
"""

import glob
import os
import random
import signal
import socket
import sys
import time

import keras
import numpy as np
from trainer_fault_worker import Toy
from trainer_fault_worker import _Log

import kerasdist as kd
from kerasdist.trainer import checkpoints
from tests.support import host_faults

CKPT, STATE, SEED, FAULTS = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                             int(sys.argv[4]))
ATTEMPT = int(os.environ.get("KERASDIST_RESTART_ATTEMPT", "0"))
KINDS = ["kill", "freeze", "exception", "drop"]


def _step_checkpoints():
    return set(glob.glob(os.path.join(CKPT, "*-sample-*.json"))
               + glob.glob(os.path.join(CKPT, "epoch-*[0-9].json")))


class Fault(keras.callbacks.Callback):
    """Brings this attempt's fault about (see the module docstring)."""

    def __init__(self):
        super().__init__()
        rng = random.Random(SEED * 1000 + ATTEMPT)
        self.kind = rng.choice(KINDS)
        self.rank = rng.randrange(kd.size())
        if self.kind == "drop":
            # Only the rank on kdt1 (rank 1 of 2) can drop that link; with
            # kdt1 left out, kill instead.
            self.kind, self.rank = (("drop", 1) if kd.size() == 2 else
                                    ("kill", 0))
        self.after = rng.randint(1, 4)
        self.steps = 0
        self.before = _step_checkpoints()

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if (ATTEMPT >= FAULTS or kd.rank() != self.rank
                or self.steps < self.after):
            return
        if _step_checkpoints() <= self.before:
            return  # nothing new on disk yet: wait for progress
        # The manifest is on disk a moment before rank 0 has told the
        # launcher of the progress (after the directory's fsync): a fault
        # in that moment would be a restart with the backoff, which the
        # test asserts never happens after progress.
        time.sleep(1.0)
        # Whole or not at all: the test reads each new fault file at once.
        path = os.path.join(STATE, f"fault.{ATTEMPT}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()} {self.kind} {kd.rank()} "
                    f"{socket.gethostname()}\n")
        os.replace(path + ".tmp", path)
        print(f"worker: attempt {ATTEMPT}: {self.kind} on rank {kd.rank()} "
              f"after {self.steps} steps", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "exception":
            # Each attempt's error names its attempt: two faults are two
            # events, and `kerasdist run` stops restarting when an attempt
            # fails with the same last line as the one before (a start-up
            # error that a restart would repeat).
            raise RuntimeError(f"an injected error on rank {kd.rank()} in "
                               f"attempt {ATTEMPT}")
        else:
            host_faults.drop_this_hosts_packets()


def main():
    kd.init()
    print(f"worker: attempt {ATTEMPT} size {kd.size()}", flush=True)
    # 16 epochs are 240 steps at two ranks. An attempt keeps about 6
    # steps (its fault strikes 1-4 steps in, once a step checkpoint newer
    # than its start is seen; 15 faults used up 6 epochs), so 20 faults
    # end well before the training does.
    trainer = Toy(extra_callbacks=[Fault()], epochs=16, batch_size=8,
                  learning_rate=0.01, checkpoint_dir=CKPT,
                  checkpoint_every_steps=2, seed=0, verbose=0)
    _Log.file = open(os.path.join(STATE, f"ids.a{ATTEMPT}.r{kd.rank()}"), "w")
    trainer.fit()
    if kd.rank() == 0:
        newest = checkpoints.latest(CKPT)
        fresh = trainer.build_model()
        fresh.load_weights(newest["weights_path"])
        for a, b in zip(fresh.get_weights(), trainer.model.get_weights()):
            np.testing.assert_array_equal(a, b)
        print("worker: the newest checkpoint loads: "
              + os.path.basename(newest["weights_path"]), flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
