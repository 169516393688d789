"""SGD on a linear model in PyTorch (or JAX: RECOVERY_BACKEND=jax) under
`kerasdist.elastic.run`, for recovery in place
(tests/cluster/test_recovery.py, benchmarks/recovery.py).

Every rank trains the same weights on its own rows of a fixed data set
(rows_for: step, rank, size); the gradients are averaged with
kerasdist.torch.allreduce (kerasdist.jax.allreduce, eager). The state
(weights and step) is committed in memory every COMMIT_EVERY steps. The
rank KILL_RANK SIGKILLs itself after computing the gradient of step
KILL_STEP, before its allreduce, so the others are inside that collective
when it goes.

Each rank writes DIR/<P>start.<rank>.json (its pid, rank and size at the
start, and the wall times (time.time()) its script began and kd.init()
returned) and, when training ends, DIR/<P>end.<start rank>.json: its pid,
rank and size then, the steps it resumed from after each recovery, the
final weights, its host's name, the wall time each step completed, each
RanksLostError came and each reset ran. <P> is "" in the launcher's first
attempt and "a<N>." in attempt N (KERASDIST_RESTART_ATTEMPT, after a
relaunch). The killed rank writes DIR/kill.json (the wall time of its
SIGKILL) first. Under KERASDIST_ELASTIC_DIR the commits also go to disk
(a relaunch resumes from them); the kill happens in the first attempt
only.

argv: DIR [KILL_RANK KILL_STEP [SIGNAL]] (no kill without them; SIGNAL:
      KILL, the default, STOP: the rank freezes instead, or CONT: nothing
      happens to it, while a test cuts its host's link at kill.json)
Growing in place (RECOVERY_GROW_LIST=FILE, RECOVERY_GROW_AT=STEP): rank 0,
once STEP steps are done, writes RECOVERY_GROW_TO (default "localhost:3")
to FILE (the launcher's discovery script prints it) and waits (up to 60 s)
for the launcher's resize request before it goes on (RECOVERY_GROW_JOIN=1:
it does not wait; the test then starts a process with KERASDIST_JOIN=1,
which joins the running TCP job); the job grows at a
commit after the new rank has started, and trains on until STEPS steps
are done and at least 6 at 3 ranks (up to step 2006; in the launcher's
first attempt: a relaunch trains to the end committed). A rank that joined
writes its start file (rank and size of the grown job) and, at the end,
its end file as the others (its `resumed` is empty).
Shrinking in place: the same with RECOVERY_GROW_TO listing fewer slots and
RECOVERY_RESIZE_SIZE (default 3) the size the job trains 6 steps at; a
rank that leaves (`run` raises SystemExit) writes DIR/left.<start rank>.json
(its pid, the exit code, its weights and steps) and exits. asked.json has
"listed" (the wall time the list changed) and "at" (the request heard);
every end file "trained" (the steps trained, in order).

env: RECOVERY_STEPS (default 12), RECOVERY_COMMIT_EVERY (3),
     RECOVERY_STEP_SLEEP (seconds of compute per step, 0.05),
     RECOVERY_DIE_IN_RESET (a start rank that SIGKILLs itself in its reset
     callback, in the first attempt: a second failure while the others
     recover, or a failure while the job shrinks in place),
     RECOVERY_PROCESS_SET=1 (a process set of start ranks 1 and 2, given
     to kd.init(process_sets=...): each step its members sum their start
     rank + 1 over it before the job's allreduce, so a member is inside
     that collective when KILL_RANK goes. The reset callback notes the old
     set's error and adds the set again, its surviving members renumbered;
     end.json gets "set_sums" (step: the sum) and "set_error")
"""

import json
import os
import signal
import socket
import sys
import time

BEGAN = time.time()
import numpy as np  # noqa: E402

import kerasdist.elastic as elastic  # noqa: E402

if os.environ.get("RECOVERY_BACKEND", "torch") == "jax":
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import kerasdist.jax as kd
    to_tensor = jnp.asarray
else:
    import torch

    import kerasdist.torch as kd

    def to_tensor(array):
        return torch.tensor(array, dtype=torch.float64)

ROWS, FEATURES, BATCH, LR = 240, 5, 4, 0.05


def data():
    """The fixed data set: (X, y), float64."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.1 * rng.normal(size=ROWS)
    return x, y


def rows_for(step, rank, size):
    """The rows rank `rank` of `size` trains on at `step`."""
    first = (step * size + rank) * BATCH
    return np.arange(first, first + BATCH) % ROWS


def gradient(w, x, y, rows):
    """The mean squared error's gradient on `rows` at weights `w`."""
    xb, yb = x[rows], y[rows]
    return 2.0 / len(rows) * xb.T @ (xb @ w - yb)


def _ask_to_grow(directory):
    """Lists a third slot for the launcher's discovery script, then waits
    for its resize request (the next commit grows the job)."""
    from kerasdist._core import resize
    listed = time.time()
    with open(os.environ["RECOVERY_GROW_LIST"], "w") as f:
        f.write(os.environ.get("RECOVERY_GROW_TO", "localhost:3\n"))
    if os.environ.get("RECOVERY_GROW_JOIN") == "1":
        # The test, or the launcher's discovery, starts a process that
        # joins (over TCP): no request to wait for.
        with open(os.path.join(directory, "asked.json"), "w") as f:
            json.dump({"listed": listed, "at": None, "heard": False}, f)
        return
    deadline = time.monotonic() + 60
    while not resize.requested() and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(directory, "asked.json"), "w") as f:
        json.dump({"listed": listed, "at": time.time(),
                   "heard": resize.requested()}, f)


def main():
    DIR = sys.argv[1]
    KILL_RANK = int(sys.argv[2]) if len(sys.argv) > 3 else -1
    KILL_STEP = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    STEPS = int(os.environ.get("RECOVERY_STEPS", "12"))
    COMMIT_EVERY = int(os.environ.get("RECOVERY_COMMIT_EVERY", "3"))
    STEP_SLEEP = float(os.environ.get("RECOVERY_STEP_SLEEP", "0.05"))
    SIGNUM = getattr(signal, "SIG" + (sys.argv[4] if len(sys.argv) > 4
                                      else "KILL"))
    DIE_IN_RESET = int(os.environ.get("RECOVERY_DIE_IN_RESET", "-1"))
    GROW_AT = int(os.environ.get("RECOVERY_GROW_AT", "-1"))
    RESIZE_SIZE = int(os.environ.get("RECOVERY_RESIZE_SIZE", "3"))
    with_set = os.environ.get("RECOVERY_PROCESS_SET") == "1"
    pset = {"set": kd.ProcessSet([1, 2]), "old": [1, 2], "error": None}
    kd.init(process_sets=[pset["set"]] if with_set else None)
    start_rank = kd.rank()
    attempt = int(os.environ.get("KERASDIST_RESTART_ATTEMPT", "0") or 0)
    prefix = f"a{attempt}." if attempt else ""
    with open(os.path.join(DIR, f"{prefix}start.{start_rank}.json"),
              "w") as f:
        json.dump({"pid": os.getpid(), "rank": start_rank,
                   "size": kd.size(), "began": BEGAN,
                   "init_at": time.time()}, f)
    x, y = data()
    resumed, done_at, lost_at, reset_at, set_sums = [], {}, [], [], {}
    trained = []
    state = elastic.ObjectState(w=np.zeros(FEATURES), step=0, end=STEPS)

    def on_reset():
        if start_rank == DIE_IN_RESET and not attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        resumed.append(state.step)
        reset_at.append(time.time())
        if with_set:
            readd_set()

    def readd_set():
        """The old set's objects fail; the survivors add it again."""
        try:
            kd.allreduce(to_tensor(np.ones(1)), op=kd.Sum, name="stale",
                         process_set=pset["set"])
        except ValueError as e:
            pset["error"] = str(e)
        starts = np.asarray(kd.allgather(to_tensor(np.array([start_rank])),
                                         name="starts")).astype(int)
        ranks = [new for new, old in enumerate(starts) if old in pset["old"]]
        pset["set"] = kd.add_process_set(ranks)
        pset["old"] = [int(starts[r]) for r in ranks]

    def set_sum(step):
        if not with_set or not pset["set"].included():
            return
        try:
            total = kd.allreduce(to_tensor(np.array([start_rank + 1.0])),
                                 op=kd.Sum, name=f"set.{step}",
                                 process_set=pset["set"])
        except elastic.RanksLostError:
            lost_at.append(time.time())
            raise
        set_sums[step] = float(np.asarray(total)[0])

    state.register_reset_callbacks([on_reset])

    def allreduce(g, step):
        try:
            return kd.allreduce(g, op=kd.Average, name=f"grad.{step}")
        except elastic.RanksLostError:
            lost_at.append(time.time())
            raise

    @elastic.run
    def train(state):
        w = np.array(state.w)
        while state.step < state.end:
            rank, size = kd.rank(), kd.size()
            g = to_tensor(gradient(w, x, y,
                                      rows_for(state.step, rank, size)))
            time.sleep(STEP_SLEEP)  # the step's compute
            if (start_rank, state.step, attempt) == (KILL_RANK, KILL_STEP,
                                                     0):
                with open(os.path.join(DIR, "kill.json"), "w") as f:
                    json.dump({"at": time.time()}, f)
                os.kill(os.getpid(), SIGNUM)
            set_sum(state.step)
            g = np.asarray(allreduce(g, state.step))
            w = w - LR * g
            trained.append(state.step)
            state.w, state.step = w.copy(), state.step + 1
            done_at[state.step] = time.time()
            if (start_rank, state.step) == (0, GROW_AT):
                _ask_to_grow(DIR)
            if GROW_AT >= 0 and kd.size() != RESIZE_SIZE and \
                    state.step < 2000 and \
                    not attempt:
                state.end = max(state.end, state.step + 6)
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    try:
        train(state)
    except SystemExit as e:  # this rank left the job (shrinking in place)
        with open(os.path.join(DIR, f"{prefix}left.{start_rank}.json"),
                  "w") as f:
            json.dump({"pid": os.getpid(), "code": e.code,
                       "w": state.w.tolist(), "step": state.step,
                       "done_at": done_at, "trained": trained}, f)
        raise
    with open(os.path.join(DIR, f"{prefix}end.{start_rank}.json"),
              "w") as f:
        json.dump({"pid": os.getpid(), "rank": kd.rank(), "size": kd.size(),
                   "host": socket.gethostname(),
                   "resumed": resumed, "w": state.w.tolist(),
                   "done_at": done_at, "lost_at": lost_at,
                   "reset_at": reset_at, "set_sums": set_sums,
                   "trained": trained,
                   "set_error": pset["error"]}, f)
    print(f"rank {start_rank} done at size {kd.size()}", flush=True)


if __name__ == "__main__":
    main()
