"""kerasdist.Trainer's recovery in place (docs/failures-and-elastic.md,
"Recovery in place"), on real processes of this machine: kerasdist built
against Open MPI under `kerasdist run --recover-in-place -np 3`. A Trainer
job (tests/workers/trainer_recovery_worker.py) commits in memory every 3
steps; one rank SIGKILLs itself at the start of step 4 (rank 2, or the
coordinator, rank 0, whose survivors renumber). The other two keep
their processes, re-form at size 2, go back to the commit after step 3
(18 examples of epoch 1) and train on: the rest of epoch 1 re-sharded
over 2 ranks, epoch 2 at 2 ranks, the learning rate rescaled. Their
weights equal numpy's SGD with momentum from that commit continued at 2
ranks, not what a run that kept step 4's weights would give; the new rank
0 writes the epoch checkpoints. On PyTorch (eager), JAX (the step
jitted: traced again at the new size) and TensorFlow (the step a
tf.function with kerasdist's TF ops: traced again too). With a
sharded optimizer (shard="optimizer_state", PyTorch) the lost rank's
shard of the momentum comes from its buddy's copy and is re-partitioned
over the survivors in memory: the same numpy truth; with sharded weights
(shard="weights", PyTorch) the weight shards too, laid out at the new
size in place; where a rank and its buddy are both lost, the
survivor ends in one line. A Trainer job that the
discovery script grows (2 ranks to 3) grows in place, the new rank taking
the commit by broadcast (with sharded weights, PyTorch, its shards from
the old ranks, the commit laid out at 3); one that it shrinks (3 ranks
to 2; JAX with sharded weights) shrinks in place at its next commit:
the leaver exits 0, the others (the same processes) go on from that
commit, the weight shards laid out again over them; all to numpy's
weights. And over the TCP transport on the repository's own build (no
Open MPI): TensorFlow replicated, JAX's sharded optimizer and PyTorch's
sharded weights, recovered in place under node mode."""

import importlib.util
import json
import os
import re

import numpy as np
import pytest

from tests.support.helpers import WORKERS
from tests.support.helpers import free_port
from tests.support.helpers import launch
from tests.support.helpers import rank_env
from tests.support.helpers import worker_cmd
from tests.support.recovery import run_with_join

pytestmark = pytest.mark.cluster

KILL_RANK, KILL_STEP = 2, 4
# A job's bound: PyTorch's and TensorFlow's imports took 40 s on this
# 2-core machine under another job's load.
JOB_S = 300


def _worker_module():
    """tests/workers/trainer_recovery_worker.py's data and settings."""
    path = os.path.join(WORKERS, "trainer_recovery_worker.py")
    spec = importlib.util.spec_from_file_location("trainer_recovery_worker",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps(m, state, size, position, steps):
    """`steps` steps at `size` ranks from example `position` of an epoch
    (in order: shuffle=False): rank r takes the rest's examples r,
    r + size, ...; each step averages the ranks' gradients of the mean
    squared error on BATCH of them; Keras' SGD with momentum 0.9 at the
    learning rate scaled by `size`."""
    x, y = m.data()
    x, y = x.astype(np.float64), y.astype(np.float64)
    w, b, mw, mb = state
    lr = m.LR * size
    rest = np.arange(position, m.N)
    for s in range(steps):
        gw, gb = 0.0, 0.0
        for r in range(size):
            rows = rest[r::size][s * m.BATCH:(s + 1) * m.BATCH]
            err = x[rows] @ w + b - y[rows]
            scale = 2.0 / err.size
            gw, gb = gw + scale * x[rows].T @ err, gb + scale * err.sum(0)
        mw, mb = 0.9 * mw - lr * gw / size, 0.9 * mb - lr * gb / size
        w, b = w + mw, b + mb
    return w, b, mw, mb


def _read(directory, name):
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def _job(root, directory, backend, *args, killed=KILL_RANK):
    return launch(3, worker_cmd("trainer_recovery_worker.py", str(directory),
                                str(killed), str(KILL_STEP), *args),
                  timeout=JOB_S, root=root,
                  launcher_args=["--recover-in-place"],
                  env=rank_env(KERAS_BACKEND=backend))


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("backend,killed", [("torch", KILL_RANK),
                                            ("jax", 0),
                                            ("tensorflow", KILL_RANK)])
def test_trainer_recovers_in_place_from_the_commit_every_steps(
        request, tmp_path, backend, killed):
    pytest.importorskip(backend)
    # TensorFlow's collectives are kerasdist's TF ops: a build with them.
    root = request.getfixturevalue(
        "openmpi_tf_root" if backend == "tensorflow" else "openmpi_root")
    out = _job(root, tmp_path, backend, killed=killed)
    _check_recovered(out, tmp_path, killed)


def _check_recovered(out, tmp_path, killed):
    """The job lost rank `killed` at step KILL_STEP and its survivors
    went on from the commit after step 3 to numpy's weights."""
    survivors = [r for r in range(3) if r != killed]
    assert out.returncode == 0, out.stdout
    assert (f"rank {killed} (host " in out.stdout and "exited with signal "
            f"9 (SIGKILL); ranks {survivors[0]}, {survivors[1]} finished "
            "without it (recovery in place)." in out.stdout), out.stdout
    assert (f"<stderr>:kerasdist.Trainer: rank {survivors[0]}: a rank of "
            "the job was lost" in out.stdout and "re-formed in place at 2 "
            "rank(s) (was 3)" in out.stdout), out.stdout
    assert ("kerasdist.Trainer: resuming from the last commit in memory at "
            "epoch 1 of 2, after its first 18 examples; written at 3 ranks, "
            "now 2: the rest of the epoch re-sharded and the learning rate "
            "rescaled (optimizer step 3)") in out.stdout, out.stdout
    assert _read(tmp_path, "kill.json")["step"] == KILL_STEP
    m = _worker_module()
    commit = KILL_STEP // m.COMMIT_EVERY * m.COMMIT_EVERY
    zero = (np.zeros((m.FEATURES, m.OUTPUTS)), np.zeros(m.OUTPUTS)) * 2
    at3 = _steps(m, zero, 3, 0, commit)
    position = commit * m.BATCH * 3
    left = (m.N - position) // (2 * m.BATCH)  # 9 steps of 2 at 2 ranks
    per_epoch = -(-m.N // 2 // m.BATCH)  # 14: 27 examples a rank
    truth = _steps(m, _steps(m, at3, 2, position, left), 2, 0, per_epoch)
    # Not what a run that kept the step after the commit would give.
    kept = _steps(m, _steps(m, _steps(m, at3, 3, position, 1), 2,
                            position + 3 * m.BATCH, left - 1), 2, 0,
                  per_epoch)
    assert not np.allclose(truth[0], kept[0], rtol=1e-4, atol=1e-4)
    for new_rank, rank in enumerate(survivors):
        start, end = (_read(tmp_path, f"start.{rank}.json"),
                      _read(tmp_path, f"end.{rank}.json"))
        # The same process, now rank `new_rank` of 2.
        assert (start["size"], end["pid"], end["rank"], end["size"]) == (
            3, start["pid"], new_rank, 2), (start, end)
        assert end["step"] == commit + left + per_epoch, end
        assert end["lr"] == pytest.approx(m.LR * 2, rel=1e-6), end
        np.testing.assert_allclose(end["kernel"], truth[0], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(end["bias"], truth[1], rtol=1e-4,
                                   atol=1e-5)
    assert not os.path.exists(tmp_path / f"end.{killed}.json")
    # The disk checkpoints went on: the new rank 0 wrote epoch 2's.
    assert os.path.exists(tmp_path / "ckpt" / "epoch-000002.json")


@pytest.mark.timeout(JOB_S + 60)
def test_trainer_with_a_sharded_optimizer_recovers_in_place(openmpi_root,
                                                            tmp_path):
    # shard="optimizer_state": each commit copies a rank's shard of the
    # momentum to its buddy; rank 0 is lost, its shard taken from rank 1's
    # copy, re-partitioned over the 2 survivors in memory.
    out = _job(openmpi_root, tmp_path, "torch", "optimizer_state",
               killed=0)
    _check_recovered(out, tmp_path, 0)
    assert "recovery in place cannot go on" not in out.stdout, out.stdout


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("shard,what", [
    ("optimizer_state", "the sharded optimizer's state"),
    ("weights", "the model's sharded weights")],
    ids=["optimizer_state", "weights"])
def test_trainer_sharded_optimizer_losing_a_rank_and_its_buddy_ends(
        openmpi_root, tmp_path, shard, what):
    # Ranks 0 and 2 lost at once: rank 2's shard lived on rank 2 and on
    # its buddy, rank 0. The survivor ends with one line; the job with
    # the first failure's code (a SIGKILL).
    out = _job(openmpi_root, tmp_path, "torch", shard, killed="0,2")
    assert out.returncode == 137, out.stdout
    lines = [line for line in out.stdout.splitlines()
             if "recovery in place failed" in line]
    assert lines == [
        "[1]<stderr>:kerasdist.Trainer: recovery in place failed: rank 2's "
        f"shard of {what} is lost: it and its buddy, rank 0, were both "
        "lost (ranks [0, 2]); ending this rank (a relaunch resumes from "
        "the last commit on disk)"], out.stdout
    assert "re-formed in place" not in out.stdout, out.stdout
    assert not list(tmp_path.glob("end.*.json"))


@pytest.mark.timeout(JOB_S + 60)
def test_trainer_with_sharded_weights_recovers_in_place(openmpi_root,
                                                        tmp_path):
    # shard="weights" on PyTorch, the coordinator lost: each commit copies
    # a rank's shards of the kernel (6 elements: 2 a rank at 3 ranks, 3
    # at 2) and the bias, and of their momentum, to its buddy; the
    # survivors lay the weight shards out at size 2 in place from their
    # own and the buddies' copies: the replicated case's numpy truth.
    # JAX's and TensorFlow's weight shards recover in
    # tests/cluster/test_recovery_fit.py (the Trainer's jobs on them
    # passed too, 53 s and 45 s more of the suite).
    out = _job(openmpi_root, tmp_path, "torch", "weights", killed=0)
    _check_recovered(out, tmp_path, 0)
    assert "recovery in place failed" not in out.stdout, out.stdout


def _resizing_job(tmp_path, root, np_, backend, resize, *args, **env):
    """A Trainer job of `np_` ranks under --recover-in-place whose
    discovery script lists `np_` slots until the worker rewrites it after
    step 1 (`resize`: TRAINER_GROW_AT, to 3, or TRAINER_SHRINK_AT, to 2);
    `env`: more of the worker's variables."""
    listed = tmp_path / "hosts.txt"
    listed.write_text(f"localhost:{np_}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    return launch(np_, worker_cmd("trainer_recovery_worker.py",
                                  str(tmp_path), "-1", "-1", *args),
                  timeout=JOB_S, root=root,
                  launcher_args=["--recover-in-place",
                                 "--host-discovery-script", str(script),
                                 "--min-np", "2", "--max-np", "3",
                                 "--discovery-interval", "0.5"],
                  env=rank_env(KERAS_BACKEND=backend, TRAINER_GROW_LIST=listed,
                               **{resize: 1}, **env))


def _grow_job(tmp_path, root, *args, **env):
    """A Trainer job of 2 ranks that the discovery script grows to 3."""
    return _resizing_job(tmp_path, root, 2, "torch", "TRAINER_GROW_AT",
                         *args, **env)


def _check_grown(tmp_path, m):
    """The 3 ranks' weights are numpy's for the job at 2 ranks up to the
    point `m` (the resume line's match: epoch, examples, optimizer step)
    and at 3 from there; ranks 0 and 1 kept their processes."""
    epoch, position, step = (int(m.group(1)) - 1, int(m.group(2) or 0),
                             int(m.group(3)))
    w = _worker_module()
    per2, per3 = -(-w.N // 2 // w.BATCH), -(-w.N // 3 // w.BATCH)
    assert position == (step - epoch * per2) * 2 * w.BATCH, m.group(0)
    state = (np.zeros((w.FEATURES, w.OUTPUTS)), np.zeros(w.OUTPUTS)) * 2
    for _ in range(epoch):
        state = _steps(w, state, 2, 0, per2)
    state = _steps(w, state, 2, 0, step - epoch * per2)
    left = -(-((w.N - position) // 3) // w.BATCH)
    truth = _steps(w, state, 3, position, left)
    for _ in range(epoch + 1, w.EPOCHS):
        truth = _steps(w, truth, 3, 0, per3)
    for rank in range(3):
        end = _read(tmp_path, f"end.{rank}.json")
        assert (end["rank"], end["size"]) == (rank, 3), end
        # Ranks 0 and 1 the same processes throughout.
        start = _read(tmp_path, f"start.{rank}.json")
        assert (start["pid"], start["size"]) == (
            end["pid"], 2 if rank < 2 else 3), (start, end)
        assert end["step"] == step + left + (w.EPOCHS - epoch - 1) * per3, \
            end
        assert end["lr"] == pytest.approx(w.LR * 3, rel=1e-6), end
        np.testing.assert_allclose(end["kernel"], truth[0], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(end["bias"], truth[1], rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.timeout(JOB_S + 60)
def test_trainer_shrinks_in_place_under_recover_in_place(openmpi_root,
                                                         tmp_path):
    # The discovery script lists 2 slots of the 3 after step 1: the
    # Trainer announced that it shrinks in place, so the launcher writes
    # its shrink request (rank 2 leaves) and asks the ranks; at the next
    # commit in memory (step 3, 18 examples of epoch 1) rank 2 ends with
    # exit code 0 and ranks 0 and 1 split off, keep their processes and go
    # on from that commit at 2 ranks: the rest of epoch 1 re-sharded, the
    # learning rate rescaled. The same numpy truth as after a lost rank at
    # step 4, which the commit after step 3 also resumed from: no example
    # trained twice or skipped. On JAX with shard="weights": the leaver's
    # shards of the weights and of the momentum come back from its
    # buddy's copy of that commit (the lost-rank recovery's restore) and
    # are laid out over the 2 in place; the end's weights gathered whole.
    out = _resizing_job(tmp_path, openmpi_root, 3, "jax",
                        "TRAINER_SHRINK_AT", "weights")
    why = "host localhost has 2 slot(s) now, not 3"
    assert out.returncode == 0, out.stdout
    assert (f"kerasdist: shrinking from 3 to 2 ranks: {why}; in place, at "
            "the ranks' next commit") in out.stdout, out.stdout
    assert "rank 2 leaves the job" in out.stdout, out.stdout
    assert (f"kerasdist.Trainer: shrank in place to 2 rank(s) (was 3; "
            f"{why}): rank(s) 2 left") in out.stdout, out.stdout
    assert ("kerasdist.Trainer: resuming from the last commit in memory at "
            "epoch 1 of 2, after its first 18 examples; written at 3 ranks, "
            "now 2: the rest of the epoch re-sharded and the learning rate "
            "rescaled (optimizer step 3)") in out.stdout, out.stdout
    # No relaunch, no failure (rank 2's exit code is 0).
    assert not re.search(r"^kerasdist: attempt \d", out.stdout, re.M), \
        out.stdout
    assert "exited with" not in out.stdout, out.stdout
    m = _worker_module()
    zero = (np.zeros((m.FEATURES, m.OUTPUTS)), np.zeros(m.OUTPUTS)) * 2
    commit = m.COMMIT_EVERY
    position = commit * m.BATCH * 3
    left = (m.N - position) // (2 * m.BATCH)
    per_epoch = -(-m.N // 2 // m.BATCH)
    truth = _steps(m, _steps(m, _steps(m, zero, 3, 0, commit), 2, position,
                             left), 2, 0, per_epoch)
    # Not what the job at 3 ranks throughout would give.
    per3 = -(-m.N // 3 // m.BATCH)
    at3 = _steps(m, _steps(m, zero, 3, 0, per3), 3, 0, per3)
    assert not np.allclose(truth[0], at3[0], rtol=1e-4, atol=1e-4)
    for rank in range(2):
        start, end = (_read(tmp_path, f"start.{rank}.json"),
                      _read(tmp_path, f"end.{rank}.json"))
        assert (start["size"], end["pid"], end["rank"], end["size"]) == (
            3, start["pid"], rank, 2), (start, end)
        # Every step once: 3 at 3 ranks, then 9 + 14 at 2.
        assert end["step"] == commit + left + per_epoch, end
        steps = [s for s, _ in end["done_at"]]
        assert steps == list(range(1, end["step"] + 1)), end
        assert end["lr"] == pytest.approx(m.LR * 2, rel=1e-6), end
        np.testing.assert_allclose(end["kernel"], truth[0], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(end["bias"], truth[1], rtol=1e-4,
                                   atol=1e-5)
    assert _read(tmp_path, "start.2.json")["size"] == 3
    assert not os.path.exists(tmp_path / "end.2.json")
    assert os.path.exists(tmp_path / "ckpt" / "epoch-000002.json")


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("shard,call", [(None, "fit"),
                                        ("weights", "fine_tune")])
def test_trainer_grows_in_place_under_recover_in_place(openmpi_root,
                                                       tmp_path, shard,
                                                       call):
    # The Trainer grows in place: the launcher writes its grow request
    # (the ranks announced grows=in-place), the 2 ranks start rank 2 at
    # their next commit's step and train on; at the first commit's step
    # after it joined they commit, re-form at 3, send it the commit and
    # its point, and all 3 train on from there: the 2 old ranks in their
    # processes, no relaunch, numpy's weights. With shard="weights" the
    # commit's shards of the weights and of the momentum (laid out at 2)
    # are laid out at 3 in place, rank 2 receiving its shards from ranks 0
    # and 1; the end's weights gathered whole. That job trains with
    # fine_tune() (its first call, on a fresh Trainer), which the new
    # rank joins as it joins fit(): the same truth.
    out = _grow_job(tmp_path, openmpi_root, *([shard] if shard else []),
                    TRAINER_CALLS=call)
    assert out.returncode == 0, out.stdout
    assert ("kerasdist: growing from 2 to 3 ranks: host localhost has 3 "
            "slot(s) now, not 2; in place, at the ranks' next commit") in \
        out.stdout, out.stdout
    assert "kerasdist.Trainer: grew in place to 3 rank(s) (was 2" in \
        out.stdout, out.stdout
    assert not re.search(r"^kerasdist: attempt \d", out.stdout, re.M), \
        out.stdout
    m = re.search(r"<stdout>:kerasdist\.Trainer: resuming from the last "
                  r"commit in memory at epoch (\d) of 2(?:, after its first "
                  r"(\d+) examples)?; written at 2 ranks, now 3.*\(optimizer "
                  r"step (\d+)\)", out.stdout)
    assert m, out.stdout
    _check_grown(tmp_path, m)


@pytest.mark.timeout(JOB_S + 60)
def test_trainer_over_tcp_grows_with_a_process_that_joins(tmp_path):
    """Over TCP on the default build: `kerasdist run --nproc-per-node 2
    --recover-in-place`, then, after step 1, `kerasdist run --join`
    starts a third process; at the next commit's step the Trainer lets it
    in as a grow in place (the same truth as above)."""
    port, listed = free_port(), tmp_path / "join-now"
    env = rank_env(drop=("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                         "KERASDIST_ELASTIC_DIR"),
                   KERAS_BACKEND="torch", TRAINER_GROW_LIST=listed,
                   TRAINER_GROW_AT=1, TRAINER_GROW_JOIN=1,
                   KERASDIST_TRANSPORT="tcp", KERASDIST_JOB_SECRET="j" * 32)
    command = worker_cmd("trainer_recovery_worker.py", str(tmp_path), "-1",
                         "-1")
    procs, outs, _ = run_with_join(command, env, port, listed, JOB_S)
    text = "\n".join(o[-4000:] for o in outs)
    assert [p.returncode for p in procs] == [0, 0], text
    assert ("kerasdist.Trainer: grew in place to 3 rank(s) (was 2; 1 "
            "process(es) asked to join)" in outs[0]), text
    m = re.search(r"<stdout>:kerasdist\.Trainer: resuming from the last "
                  r"commit in memory at epoch (\d) of 2(?:, after its first "
                  r"(\d+) examples)?; written at 2 ranks, now 3.*\(optimizer "
                  r"step (\d+)\)", outs[0] + outs[1])
    assert m, text
    _check_grown(tmp_path, m)


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("backend,killed,shard", [
    ("tensorflow", KILL_RANK, None), ("jax", 0, "optimizer_state"),
    ("torch", 0, "weights")])
def test_trainer_recovers_in_place_over_tcp(tmp_path, backend, killed,
                                            shard):
    """The same jobs on the repository's own build, no Open MPI: node mode
    over the TCP transport (KERASDIST_TRANSPORT=tcp), the survivors
    re-forming through the rendezvous; replicated on TensorFlow, and the
    sharded optimizer's state (JAX) and sharded weights (PyTorch) with the
    coordinator lost, its shards from its buddy."""
    pytest.importorskip(backend)
    out = launch(None, worker_cmd("trainer_recovery_worker.py",
                                  str(tmp_path), str(killed), str(KILL_STEP),
                                  *([shard] if shard else [])),
                 timeout=JOB_S,
                 launcher_args=["--nproc-per-node", "3",
                                "--recover-in-place"],
                 env=rank_env(KERAS_BACKEND=backend,
                              KERASDIST_TRANSPORT="tcp"))
    _check_recovered(out, tmp_path, killed)
    assert "recovery in place failed" not in out.stdout, out.stdout
