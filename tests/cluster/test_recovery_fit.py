"""Recovery in place for `model.fit` (docs/failures-and-elastic.md,
"Recovery in place"), on TensorFlow, JAX and PyTorch: kerasdist built
against Open MPI (with the TensorFlow op library: openmpi_tf_root) under
`kerasdist run --recover-in-place -np 3`. A linear Keras model trains
under `elastic.run` with `ElasticBatches` and `CommitCallback`
(tests/workers/elastic_fit_worker.py); rank 2 SIGKILLs itself as it
begins a step in the middle of the second epoch, one step after the last
commit. The other two keep their processes, resume at size 2 from the
commit (the step after it is trained again, at the new size), and end
with the weights numpy computes for that schedule: every example of each
epoch once, in the epoch's order, the learning rate rescaled. And growing
in place (PyTorch, JAX): 2 ranks grow to 3 at a commit under
--host-discovery-script, the new rank joining at the job's position, to
numpy's weights for 2 ranks up to the commit and 3 after, with a sharded
optimizer (JAX; PyTorch with sharded weights) too, the new rank
receiving its shard of the commit; and
shrinking in place (PyTorch; JAX sharded): 3 ranks to 2, rank 2 leaving
at a commit."""

import os

import numpy as np
import pytest

from tests.support.helpers import free_port
from tests.support.helpers import launch
from tests.support.helpers import rank_env
from tests.support.helpers import worker_cmd
from tests.support.recovery import grown_ends
from tests.support.recovery import grown_files
from tests.support.recovery import read_json
from tests.support.recovery import run_with_join
from tests.support.recovery import worker_module

pytestmark = pytest.mark.cluster

# The job's step 8 (0-based, 5 steps an epoch at 3 ranks): the second
# epoch's fourth, begun after the commit at batch 6 (steps 5, 6) and one
# step (batch 9) that is lost.
KILL_RANK, KILL_STEP, COMMIT = 2, 8, (1, 6)
# A job's bound: TensorFlow's import and the retrace of fit's step take
# tens of seconds on this 2-core machine under load.
JOB_S = 300
# Keras' JAX and PyTorch backends, in float64, are 3e-8 and 2e-7 from
# numpy in one process too on a batch of 6 (some of their loss in
# float32); TensorFlow 2e-16. The lost step moves the weights 7e-2.
RTOL = {"tensorflow": 1e-9, "jax": 1e-7, "torch": 1e-6}


def _steps(m, epoch, start, size):
    """(rows of each rank, the batch after) step by step, from batch
    `start` of `epoch` to its end at `size` ranks: the epoch's order
    (shuffled by the seed and the epoch), batches of BATCH, the next
    `size` batches a step; the last step takes what is left (fewer than
    2 * size batches), its examples split over the ranks."""
    order = np.random.default_rng([m.SEED, epoch]).permutation(m.N)
    batches = [order[j:j + m.BATCH] for j in range(0, m.N, m.BATCH)]
    while start < len(batches):
        left = len(batches) - start
        if left >= 2 * size or left == size:
            yield batches[start:start + size], start + size
            start += size
        else:
            yield (np.array_split(np.concatenate(batches[start:]), size),
                   len(batches))
            start = len(batches)


def _train(m, w, schedule, momentum=0.0, zero=()):
    """numpy SGD of the worker's model (kernel then bias in `w`) on the
    schedule [(epoch, start, end, size)]: the gradients of the mean
    squared error averaged over the ranks, the rate LR * size; with
    `momentum`, Keras' (v = momentum * v - rate * g; w += v), the
    elements `zero` of v zeroed where the schedule's third part starts
    (as if a lost rank's shard of it were lost). Returns (w, trained),
    and v too with momentum."""
    x, y = m.data()
    trained = []
    v = np.zeros_like(w)
    for part, (epoch, start, end, size) in enumerate(schedule):
        if part == 2:
            v[list(zero)] = 0.0
        for rows, after in _steps(m, epoch, start, size):
            if after > end:
                break
            grads = []
            for r in rows:
                xb = np.hstack([x[r], np.ones((len(r), 1))])
                grads.append(2.0 / len(r) * xb.T @ (xb @ w - y[r, 0]))
            v = momentum * v - m.LR * size * np.mean(grads, axis=0)
            w = w + v
            trained += [(epoch, i) for r in rows for i in r]
    return (w, trained, v) if momentum else (w, trained)



def _survivors(directory):
    """(start, end) of ranks 0 and 1 (the survivors of rank 2), each the
    same process at its end, renumbered as rank 0 or 1 of 2."""
    ends = []
    for rank in (0, 1):
        start = read_json(directory, f"start.{rank}.json")
        end = read_json(directory, f"end.{rank}.json")
        assert (start["size"], end["pid"], end["rank"], end["size"]) == (
            3, start["pid"], rank, 2), (start, end)
        ends.append((start, end))
    return ends

@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
# Each rank also checks the bad input both refuse, in one line each.
def test_commit_callback_elastic_batches_fit_recovers_in_place(
        openmpi_tf_root, tmp_path, backend):
    out = launch(3, worker_cmd("elastic_fit_worker.py", str(tmp_path),
                               str(KILL_RANK), str(KILL_STEP)),
                 timeout=JOB_S, root=openmpi_tf_root,
                 launcher_args=["--recover-in-place"],
                 env=rank_env(KERAS_BACKEND=backend))
    assert out.returncode == 0, out.stdout
    assert "exited with signal 9 (SIGKILL); ranks 0, 1 finished without " \
        "it (recovery in place)." in out.stdout, out.stdout
    assert "re-formed in place at 2 rank(s) (was 3)" in out.stdout, out.stdout
    # The resumed epoch ends before Keras' count of steps, quietly.
    assert "ran out of data" not in out.stdout, out.stdout
    m = worker_module("elastic_fit_worker")
    nb = -(-m.N // m.BATCH)  # 15 batches an epoch
    at3 = [(0, 0, nb, 3), (1, 0, COMMIT[1], 3)]
    at2 = [(1, COMMIT[1], nb, 2)]
    truth, trained = _train(m, np.zeros(m.FEATURES + 1), at3 + at2)
    # The truth trains every example of each epoch once.
    assert sorted(trained) == [(e, i) for e in range(m.EPOCHS)
                               for i in range(m.N)]
    # Not what keeping the lost step (batches 6 to 9 at 3 ranks) gives.
    kept, _ = _train(m, np.zeros(m.FEATURES + 1),
                     [(0, 0, nb, 3), (1, 0, 9, 3), (1, 9, nb, 2)])
    assert not np.allclose(kept, truth, rtol=1e-6, atol=0)
    # The job's position after each step: 3 batches a step at 3 ranks,
    # the lost step's 9, then from the commit's 6 at 2 ranks to the
    # epoch's end (its last step takes the last 3 batches).
    positions = [[0, b, 3] for b in (3, 6, 9, 12, 15)] + \
        [[1, b, 3] for b in (3, 6, 9)] + \
        [[1, b, 2] for b in (8, 10, 12, 15)]
    for start, end in _survivors(tmp_path):
        no_position, not_batches, shuffled = start["refused"]
        assert no_position.startswith(
            "CommitCallback keeps the position in state.epoch and "
            "state.batch: create the state with them, KerasState(model, "
            "epoch=0, batch=0)."), start
        assert not_batches.startswith(
            "CommitCallback: `data` must be the ElasticBatches that fit "
            "trains (got tuple)"), start
        assert "ElasticBatches: fit asked for batch " in shuffled and \
            "pass `shuffle=False` to fit" in shuffled, start
        assert end["resumed"] == [list(COMMIT)], end
        assert end["positions"] == positions, end
        assert end["state"] == [m.EPOCHS, 0], end
        assert end["lr"] == pytest.approx(m.LR * 2), end
        np.testing.assert_allclose(end["w"], truth, rtol=RTOL[backend],
                                   atol=1e-12)
    assert not os.path.exists(tmp_path / f"end.{KILL_RANK}.json")


@pytest.mark.timeout(JOB_S + 60)
# PyTorch: the survivors' reduce-scatters started from backprop's hooks
# fail with the lost rank, and the hooks are dropped with the old layout.
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_buddies_sharded_optimizer_fit_recovers_in_place(openmpi_root,
                                                         tmp_path, backend):
    """As above with DistributedOptimizer(SGD(momentum), shard="gradients"):
    rank 2's shard of the momentum (the kernel's third element at
    3 ranks) lives on rank 0 as its buddy's copy; the survivors
    re-partition the committed momentum over 2 ranks in memory and end
    with numpy's weights and momentum, not those of a zeroed shard."""
    _check_sharded(openmpi_root, tmp_path, "gradients", backend)


# Keras on TensorFlow casts SGD's momentum, a Python float, through
# float32 (keras.ops.cast(0.9, "float64") is tf.cast's 0.8999999761581421),
# which moves a float64 job 6e-8 from numpy's 0.9 at 3 ranks, replicated
# or sharded alike; numpy takes the momentum Keras uses (then 2e-16).
def _momentum(m, backend):
    """The worker's SGD momentum as Keras applies it on `backend`."""
    if backend == "tensorflow":
        return float(np.float32(m.MOMENTUM))
    return m.MOMENTUM


@pytest.mark.timeout(JOB_S + 60)
# PyTorch's weight shards recover in the Trainer's test
# (tests/cluster/test_trainer_recovery.py); this job on PyTorch passed
# too (60 s more of the suite).
@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_sharded_weights_fit_recovers_in_place(request, tmp_path, backend):
    """As above with kd.shard_weights(model) and shard="weights": the
    kernel's and the bias' shards (and their momentum's) are committed
    with a buddy copy; rank 2's (the kernel's third element at 3 ranks)
    comes from rank 0's copy, and the survivors lay the weights out at 2
    ranks in place: numpy's weights and momentum."""
    pytest.importorskip(backend)
    root = request.getfixturevalue(
        "openmpi_tf_root" if backend == "tensorflow" else "openmpi_root")
    _check_sharded(root, tmp_path, "weights", backend)


def _check_sharded(root, tmp_path, shard, backend):
    out = launch(3, worker_cmd("elastic_fit_worker.py", str(tmp_path),
                               str(KILL_RANK), str(KILL_STEP), shard),
                 timeout=JOB_S, root=root,
                 launcher_args=["--recover-in-place"],
                 env=rank_env(KERAS_BACKEND=backend))
    assert out.returncode == 0, out.stdout
    assert "recovery in place failed" not in out.stdout, out.stdout
    assert "re-formed in place at 2 rank(s) (was 3)" in out.stdout, out.stdout
    m = worker_module("elastic_fit_worker")
    nb = -(-m.N // m.BATCH)
    schedule = [(0, 0, nb, 3), (1, 0, COMMIT[1], 3), (1, COMMIT[1], nb, 2)]
    momentum = _momentum(m, backend)
    truth, _, velocity = _train(m, np.zeros(m.FEATURES + 1), schedule,
                                momentum=momentum)
    # Rank 2's shard at 3 ranks: element 2 of the kernel (1 each).
    lost, _, _ = _train(m, np.zeros(m.FEATURES + 1), schedule,
                        momentum=momentum, zero=[2])
    assert not np.allclose(lost, truth, rtol=1e-4, atol=0)
    ends = []
    for start, end in _survivors(tmp_path):
        assert end["resumed"] == [list(COMMIT)], end
        np.testing.assert_allclose(end["w"], truth, rtol=RTOL[backend],
                                   atol=1e-12)
        ends.append(end)
    # The momentum's shards at 2 ranks (kernel: 2 + 1 of 2 padded; bias:
    # rank 0's), whole again. Absolute: the velocity is a difference of
    # near terms (JAX's float32 parts of the loss leave 1e-9 of 3e-3 in
    # the bias'); a lost shard's is 1e-1 off.
    kernel = (ends[0]["slots"][0] + ends[1]["slots"][0])[:m.FEATURES]
    bias = ends[0]["slots"][1][:1]
    np.testing.assert_allclose(kernel + bias, velocity, rtol=0, atol=1e-8)


# Growing: rank 0 asks for a third slot after the job's step 1 (batch 2
# at 2 ranks); the commit at batch 4 begins the start of rank 2, the
# ranks hold until it joined, and the next commit (batch 8) re-forms.
GROW_AT = 1


def _schedule_grown(m, commit, was=2, now=3):
    """The schedule [(epoch, start, end, size)] of a job grown from 2 ranks
    to 3 (or resized from `was` to `now`) at the position `commit` (epoch,
    batch)."""
    nb = -(-m.N // m.BATCH)
    epoch, batch = commit
    return ([(e, 0, nb, was) for e in range(epoch)] +
            [(epoch, 0, batch, was)] + [(epoch, batch, nb, now)] +
            [(e, 0, nb, now) for e in range(epoch + 1, m.EPOCHS)])


def _positions(m, schedule):
    """The job's position [epoch, batch, size] after each step of
    `schedule`."""
    out = []
    for epoch, start, end, size in schedule:
        for _, after in _steps(m, epoch, start, size):
            if after > end:
                break
            out.append([epoch, after, size])
    return out


def _resizing_fit(openmpi_root, tmp_path, np_, backend, shard=None,
                  **env):
    """elastic_fit_worker.py at `np_` ranks on this host (with
    DistributedOptimizer(shard=`shard`) where given) under
    --recover-in-place with a discovery script listing `np_` slots (the
    worker lists others at step GROW_AT), between 2 and 3 ranks."""
    listed = tmp_path / "hosts.txt"
    listed.write_text(f"localhost:{np_}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    return launch(np_, worker_cmd("elastic_fit_worker.py", str(tmp_path),
                                  "-1", "-1", *([shard] if shard else [])),
                  timeout=JOB_S, root=openmpi_root,
                  launcher_args=["--recover-in-place",
                                 "--host-discovery-script", str(script),
                                 "--min-np", "2", "--max-np", "3",
                                 "--discovery-interval", "0.5"],
                  env=rank_env(KERAS_BACKEND=backend, FIT_GROW_AT=GROW_AT,
                               FIT_GROW_LIST=listed, **env))


@pytest.mark.timeout(JOB_S + 60)
# PyTorch and JAX (its step jitted: traced again at 3 on the ranks that
# were there). TensorFlow passed by hand (173 s here with its op
# library's build and import: too dear for the suite).
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_commit_callback_fit_grows_in_place(openmpi_root, tmp_path, backend):
    """`model.fit` with CommitCallback and ElasticBatches grows from 2
    ranks to 3 in place (PyTorch, JAX) under --recover-in-place with a
    discovery script: ranks 0 and 1 keep their processes, rank 2 joins at
    a commit with the state by broadcast and trains from the job's
    position there (the batch after the commit); the learning rate is
    rescaled to 3 ranks, fit's step made again for 3 ranks; every example
    of each epoch is trained once: numpy's weights for the steps up to the
    commit at 2 ranks and the rest at 3."""
    out = _resizing_fit(openmpi_root, tmp_path, 2, backend,
                        KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=120)
    why = "host localhost has 3 slot(s) now, not 2"
    ends = grown_ends(out, tmp_path, why)
    assert "ran out of data" not in out.stdout, out.stdout
    _check_fit_grown(ends, backend)


@pytest.mark.timeout(JOB_S + 60)
# TensorFlow (fit's step traced again at 3 on the ranks that were there),
# on the default build: no Open MPI, no ULFM, the process started by
# `kerasdist run --join`. PyTorch with sharded weights too (the new
# process receives its shards of the weights and the momentum from the
# old ranks), started by the launcher itself when its discovery script
# lists a third slot (kerasdist/run/tcp_launch.py). JAX passed too (one
# run, 5 s more of the suite); its grow is ULFM's test's above.
@pytest.mark.parametrize("backend, shard, how", [
    ("tensorflow", None, "join"), ("torch", "weights", "discovery")])
def test_fit_over_tcp_grows_with_a_process_that_joins(tmp_path, backend,
                                                      shard, how):
    """The same over the TCP transport: `kerasdist run --nproc-per-node 2
    --recover-in-place` (KERASDIST_TRANSPORT=tcp), then `kerasdist run
    --join` starts a third process once rank 0 trained GROW_AT steps; or
    `kerasdist run -np 2 --host-discovery-script` starts it when the
    script lists it; it comes in at the ranks' next commit, with the same
    checks."""
    if how == "discovery":
        out = _resizing_fit(None, tmp_path, 2, backend, shard,
                            KERASDIST_TRANSPORT="tcp", FIT_GROW_JOIN=1,
                            KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=120)
        assert out.returncode == 0, out.stdout[-6000:]
        assert ("kerasdist: growing from 2 to 3 ranks: host localhost has 3 "
                "slot(s) now, not 2; in place" in out.stdout), out.stdout
        outs, text = [out.stdout], out.stdout
    else:
        port, listed = free_port(), tmp_path / "join-now"
        env = rank_env(drop=("MASTER_ADDR", "MASTER_PORT", "RANK",
                             "WORLD_SIZE", "KERASDIST_ELASTIC_DIR"),
                       KERAS_BACKEND=backend, FIT_GROW_AT=GROW_AT,
                       FIT_GROW_LIST=listed, FIT_GROW_JOIN=1,
                       KERASDIST_TRANSPORT="tcp",
                       KERASDIST_JOB_SECRET="j" * 32,
                       KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=120)
        command = worker_cmd("elastic_fit_worker.py", str(tmp_path), "-1",
                             "-1", *([shard] if shard else []))
        procs, outs, _ = run_with_join(command, env, port, listed, JOB_S)
        text = "\n".join(o[-4000:] for o in outs)
        assert [p.returncode for p in procs] == [0, 0], text
    assert ("kerasdist.elastic: grew in place to 3 rank(s) (was 2; 1 "
            "process(es) asked to join)" in outs[0]), text
    assert "ran out of data" not in text, text
    (_check_sharded_grown if shard else _check_fit_grown)(
        grown_files(tmp_path), backend)


def _check_fit_grown(ends, backend):
    """After a fit of 2 ranks grew to 3 in place at the commit ranks 0
    and 1 resumed from (`ends`: the end files): rank 2 trained from the
    job's position there, every example of each epoch once, the learning
    rate rescaled, numpy's weights for 2 ranks up to the commit and 3
    after."""
    m = worker_module("elastic_fit_worker")
    commit = ends[0]["resumed"][0]
    nb = -(-m.N // m.BATCH)
    # At a commit after the one that began the grow, before the end.
    assert 2 * (GROW_AT + 1) < commit[0] * nb + commit[1] and \
        commit[0] < m.EPOCHS, commit
    schedule = _schedule_grown(m, commit)
    truth, trained = _train(m, np.zeros(m.FEATURES + 1), schedule)
    assert sorted(trained) == [(e, i) for e in range(m.EPOCHS)
                               for i in range(m.N)]
    at2, _ = _train(m, np.zeros(m.FEATURES + 1),
                    [(e, 0, nb, 2) for e in range(m.EPOCHS)])
    assert not np.allclose(at2, truth, rtol=1e-4, atol=0)
    positions = _positions(m, schedule)
    after = positions.index([commit[0], commit[1], 2]) + 1 \
        if commit[1] else [p[:2] for p in positions].index(
            [commit[0] - 1, nb]) + 1
    for rank, end in enumerate(ends):
        # A step that reached a commit within an epoch is trained (its
        # weights are the commit's), but the grow's interrupt, raised by
        # that commit, ends fit before the worker's callback after
        # CommitCallback notes it (an epoch's end commits after it).
        unnoted = after - 1 if commit[1] else after
        assert end["positions"] == (positions[:unnoted] + positions[after:]
                                    if rank < 2 else positions[after:]), end
        assert end["state"] == [m.EPOCHS, 0], end
        assert end["lr"] == pytest.approx(m.LR * 3), end
        np.testing.assert_allclose(end["w"], truth, rtol=RTOL[backend],
                                   atol=1e-12)


# The momentum's bound: PyTorch's float32 parts of the loss leave 1.5e-8
# of 0.2 (one run, shard="gradients"); a shard left at zero is 1e-1 off.
ATOL_VELOCITY_GROWN = {"jax": 1e-8, "torch": 1e-7}


@pytest.mark.timeout(JOB_S + 60)
# PyTorch with shard="gradients" (the new rank's first step reduces from
# its backprop hooks, the old ranks' in apply, their hooks dropped with
# the old layout: the same collectives either way) and with
# shard="weights" (the model's weights laid out again at 3 ranks in
# place, new Parameters; the new rank's first fit infers shapes alone:
# views.py gathers nothing there). JAX with shard="gradients" and
# "weights" passed too (one run each, 10-17 s more of the suite).
@pytest.mark.parametrize("backend,shard", [("torch", "gradients"),
                                           ("torch", "weights")])
def test_sharded_fit_grows_in_place(openmpi_root, tmp_path, backend,
                                    shard):
    """A job with a sharded optimizer (SGD with momentum) grows from
    2 ranks to 3 in place: ranks 0 and 1 keep their processes, rank 2
    joins at a commit holding nothing of it and receives its shard of the
    momentum (with shard="weights", of the weights too) from the old
    ranks' committed shards, re-partitioned over 3 (rank 2's element of
    the kernel was rank 1's at 2 ranks); no relaunch. Numpy's weights and
    momentum for the steps up to the commit at 2 ranks and the rest at
    3, not those of a momentum shard left at zero."""
    out = _resizing_fit(openmpi_root, tmp_path, 2, backend, shard,
                        KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=120)
    why = "host localhost has 3 slot(s) now, not 2"
    ends = grown_ends(out, tmp_path, why)
    assert "cannot grow in place" not in out.stdout, out.stdout
    assert "growing in place failed" not in out.stdout, out.stdout
    _check_sharded_grown(ends, backend)


def _check_sharded_grown(ends, backend):
    """After a fit with SGD's momentum sharded grew from 2 ranks to 3 at
    the commit ranks 0 and 1 resumed from: numpy's weights and momentum
    for the steps up to the commit at 2 ranks and the rest at 3, not
    those of a momentum shard left at zero."""
    m = worker_module("elastic_fit_worker")
    commit = ends[0]["resumed"][0]
    schedule = _schedule_grown(m, commit)
    truth, trained, velocity = _train(m, np.zeros(m.FEATURES + 1),
                                      schedule, m.MOMENTUM)
    assert sorted(trained) == [(e, i) for e in range(m.EPOCHS)
                               for i in range(m.N)]
    # Rank 2's shard of the momentum zeroed where it joined (the part at
    # 3 ranks made the schedule's third, _train's `zero`).
    grown_at = [part[3] for part in schedule].index(3)
    padded = schedule[:grown_at] + [schedule[grown_at - 1][:1] + (
        schedule[grown_at][1],) * 2 + (2,)] * (2 - grown_at) + \
        schedule[grown_at:]
    lost = _train(m, np.zeros(m.FEATURES + 1), padded, m.MOMENTUM,
                  zero=[2])[0]
    assert not np.allclose(lost, truth, rtol=1e-4, atol=0)
    for end in ends:
        assert end["state"] == [m.EPOCHS, 0], end
        assert end["lr"] == pytest.approx(m.LR * 3), end
        np.testing.assert_allclose(end["w"], truth, rtol=RTOL[backend],
                                   atol=1e-12)
    # The momentum's shards at 3 ranks (kernel: one element each; bias:
    # rank 0's), whole again.
    kernel = sum((end["slots"][0] for end in ends), [])[:m.FEATURES]
    np.testing.assert_allclose(kernel + ends[0]["slots"][1][:1], velocity,
                               rtol=0, atol=ATOL_VELOCITY_GROWN[backend])


@pytest.mark.timeout(JOB_S + 60)
# PyTorch replicated; JAX with shard="gradients" (SGD with momentum):
# rank 2's shard of the momentum comes from its buddy's copy on rank 0.
@pytest.mark.parametrize("backend,shard", [("torch", None),
                                           ("jax", "gradients")])
def test_commit_callback_fit_shrinks_in_place(openmpi_root, tmp_path,
                                              backend, shard):
    """`model.fit` with CommitCallback and ElasticBatches shrinks from 3
    ranks to 2 in place when the discovery script lists 2 slots: at the
    next commit rank 2 exits with 0, ranks 0 and 1 keep their processes
    and go on from the job's position there (no step lost), fit's step
    made again and the learning rate rescaled to 2 ranks, a sharded
    optimizer's state laid out over the 2; every example of each epoch
    is trained once: numpy's weights for the steps up to the commit at 3
    ranks and the rest at 2."""
    out = _resizing_fit(openmpi_root, tmp_path, 3, backend, shard,
                        FIT_GROW_TO="localhost:2")
    assert out.returncode == 0, out.stdout
    why = "host localhost has 2 slot(s) now, not 3"
    assert f"shrank in place to 2 rank(s) (was 3; {why}): rank(s) 2 " \
        "left" in out.stdout, out.stdout
    assert "attempt 2" not in out.stdout and "exited with" not in \
        out.stdout, out.stdout
    assert "ran out of data" not in out.stdout, out.stdout
    assert read_json(tmp_path, "asked.json")["heard"], out.stdout
    m = worker_module("elastic_fit_worker")
    ends = [read_json(tmp_path, f"end.{rank}.json") for rank in range(2)]
    left = read_json(tmp_path, "left.2.json")
    commit = ends[0]["resumed"][0]
    assert left["state"] == commit and left["code"] == 0, left
    assert left["pid"] == read_json(tmp_path, "start.2.json")["pid"], left
    nb = -(-m.N // m.BATCH)
    # At the first commit after the request, before the end.
    assert 3 * (GROW_AT + 1) <= commit[0] * nb + commit[1] and \
        commit[0] < m.EPOCHS, commit
    schedule = _schedule_grown(m, commit, 3, 2)
    momentum = m.MOMENTUM if shard else 0.0
    truth, trained = _train(m, np.zeros(m.FEATURES + 1), schedule,
                            momentum)[:2]
    assert sorted(trained) == [(e, i) for e in range(m.EPOCHS)
                               for i in range(m.N)]
    at3 = _train(m, np.zeros(m.FEATURES + 1),
                 [(e, 0, nb, 3) for e in range(m.EPOCHS)], momentum)[0]
    assert not np.allclose(at3, truth, rtol=1e-4, atol=0)
    positions = _positions(m, schedule)
    after = positions.index([commit[0], commit[1], 3]) + 1 \
        if commit[1] else [p[:2] for p in positions].index(
            [commit[0] - 1, nb]) + 1
    unnoted = after - 1 if commit[1] else after
    # The one that left: the steps up to the commit, its weights then.
    assert left["positions"] == positions[:unnoted], left
    at_commit = _train(m, np.zeros(m.FEATURES + 1), schedule[:-(
        m.EPOCHS - commit[0])], momentum)[0]
    np.testing.assert_allclose(left["w"], at_commit, rtol=RTOL[backend],
                               atol=1e-12)
    for rank, end in enumerate(ends):
        start = read_json(tmp_path, f"start.{rank}.json")
        assert (end["pid"], end["rank"], end["size"], start["size"]) == (
            start["pid"], rank, 2, 3), (start, end)
        assert end["resumed"] == [commit], end
        assert end["positions"] == positions[:unnoted] + positions[after:], \
            end
        assert end["state"] == [m.EPOCHS, 0], end
        assert end["lr"] == pytest.approx(m.LR * 2), end
        np.testing.assert_allclose(end["w"], truth, rtol=RTOL[backend],
                                   atol=1e-12)
