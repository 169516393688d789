"""Trainer(shard=...) checkpoints under `kerasdist run -np N`; one job per
size, each reading the files the job before wrote (ROOT is shared):

    python -m kerasdist.run -np 2 python \
        tests/workers/trainer_shard_worker.py np2 ROOT
    (then -np 3 ... np3 ROOT, then -np 1 ... np1 ROOT)

np2  trains 2 epochs sharded (Adam, float64) with step checkpoints
     (ROOT/a), and the same job stopped in epoch 2 after a step
     checkpoint then resumed (ROOT/b): it ends where ROOT/a's ended. Saves
     ROOT/a.npz: the whole state (weights, optimizer variables gathered).
     Commits an hvd.elastic KerasState of a sharded optimizer twice
     (ROOT/elastic; el2.npz), and one of a model with sharded weights
     (shard="weights", ROOT/elastic_w; elw2.npz). Under the
     mixed_float16 policy trains an epoch sharded (ROOT/mixed) and
     replicated: the same weights and loss scale; ROOT/mixed loads with
     its state exactly.
np3  loads ROOT/a (written by 2 ranks) sharded and replicated: both hold
     a.npz's state exactly; trains on 2 epochs each (ROOT/s3 sharded,
     ROOT/r3 replicated): the same weights and optimizer state (1e-9,
     float64); ROOT/r3 loads sharded with r3's state exactly. Saves
     s3.npz and r3.npz. The elastic commit of np 2 resumes sharded
     (shard="gradients") with el2's state; commits twice more. A commit
     of a replicated optimizer (ROOT/elastic_r) resumes sharded: each
     rank holds its slices of the committed slots, and a further step
     equals the replicated state's. The commit of sharded weights
     resumes at 3 ranks with elw2's state, each rank reading its slices.
np1  loads ROOT/s3 (3 ranks) sharded and replicated, ROOT/r3 (replicated)
     with shard="gradients": each holds what was saved; a damaged or
     missing shard file makes the checkpoint be skipped with a warning
     naming it, and a resume falls back to the one before. The elastic
     commit of np 3 resumes replicated; with its newest shard file
     damaged, from the commit before (.prev).

Prints `OK <check>` per passed check, `DONE` at the end; a failed check
raises (exit != 0). Truths: the state gathered by allgather
(`kerasdist_whole_values`) and numpy files the job before saved, the
files on disk, hashlib checksums.
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist.keras import optimizer as _optimizer  # noqa: E402
from kerasdist.keras.sharding import files as _shard_files  # noqa: E402
from kerasdist.trainer import checkpoints  # noqa: E402
from kerasdist.trainer import data as tdata  # noqa: E402

keras.config.set_floatx("float64")

N = 96  # 6 steps an epoch at np 2 (batch 8), 4 at np 3, 12 at np 1
BATCH = 8


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6))
    w = np.random.default_rng(7).normal(size=(6, 3))
    y = np.argmax(x @ w, axis=1).astype("int64")
    return x, y


class Stop(Exception):
    pass


class StopAt(keras.callbacks.Callback):
    """Raises Stop after batch `batch` of epoch `epoch` (0-based)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise Stop()


class Toy(kd.Trainer):
    stop_at = None

    def build_model(self):
        return keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", name="hidden"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ])

    def train_data(self):
        return make_data(N, 1)

    def build_optimizer(self, learning_rate):
        return keras.optimizers.Adam(learning_rate)

    def callbacks(self):
        return [StopAt(*self.stop_at)] if self.stop_at else []


def prepare(trainer, x, y):
    """Builds the trainer's model and loads its checkpoint, as fit() does
    before training."""
    trainer._prepare(tdata.as_dataset((x, y), "data"))


def settings(**kw):
    return dict(dict(epochs=2, batch_size=BATCH, learning_rate=0.01,
                     scale_lr=False, seed=3, verbose=0,
                     shard="optimizer_state"), **kw)


def whole_state(trainer):
    """{name: array}: the weights and the optimizer's variables, whole
    (gathered from the shards for a sharded optimizer; a collective)."""
    return whole_of(trainer.model, trainer.optimizer)


def whole_of(model, opt):
    if _optimizer.sharded_in(opt) is not None:
        values = list(opt.kerasdist_whole_values())
    else:
        values = [keras.ops.convert_to_numpy(v) for v in opt.variables]
    out = {f"w{i}": np.asarray(w)
           for i, w in enumerate(model.get_weights())}
    out.update({f"o{i}": np.asarray(v) for i, v in enumerate(values)})
    return out


def assert_state(got, want, atol=0.0, what=""):
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k], np.float64).ravel(),
                                   np.asarray(want[k], np.float64).ravel(),
                                   rtol=0, atol=atol, err_msg=f"{what} {k}")


def save_state(state, path):
    if kd.rank() == 0:
        np.savez(path, **state)
    kd.barrier(name=f"test.saved.{os.path.basename(path)}")


def load_state(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def ok(name):
    print(f"OK {name}", flush=True)


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def check_shard_files(directory, size):
    """The newest checkpoint names one shard file a rank, present, with
    their sizes and checksums; the directory holds no other shard file
    than those of its checkpoints."""
    manifest = checkpoints.latest(directory)
    record = manifest["optimizer_shards"]
    assert record["size"] == size, record
    names = [f["name"] for f in record["files"]]
    stem = os.path.basename(manifest["weights_path"])[:-len(".weights.h5")]
    assert names == [f"{stem}.shard-{r:05d}-of-{size:05d}.h5"
                     for r in range(size)], names
    for f in record["files"]:
        path = os.path.join(directory, f["name"])
        assert os.path.getsize(path) == f["bytes"]
        assert sha(path) == f["sha256"]
    # Adam: two slots for each of the 4 variables, the rest shared.
    assert len(record["variables"]) == 8, record["variables"]
    assert record["optimizer_variables"] == 10
    named = set()
    for m in glob.glob(os.path.join(directory, "*.json")):
        with open(m) as f:
            named.update(e["name"] for e in
                         json.load(f)["optimizer_shards"]["files"])
    on_disk = {os.path.basename(p) for p in
               glob.glob(os.path.join(directory, "*.shard-*.h5"))}
    assert on_disk == named, (sorted(on_disk), sorted(named))
    return manifest


# ---- hvd.elastic commits of a sharded optimizer --------------------------


def elastic_model(root, shard, directory="elastic"):
    """A compiled model with DistributedOptimizer(shard=shard), built,
    and its KerasState committing to ROOT/directory."""
    os.environ[kd.elastic.ELASTIC_DIR_ENV] = os.path.join(root, directory)
    keras.utils.set_random_seed(5)
    model = Toy(**settings()).build_model()
    if shard == "weights":
        kd.shard_weights(model)
    opt = kd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard=shard)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    opt.build(model.trainable_variables)
    return model, opt, kd.elastic.KerasState(model, epoch=0)


def elastic_steps(model, steps, seed):
    x, y = make_data(BATCH * steps * kd.size(), seed)
    x, y = x[kd.rank()::kd.size()], y[kd.rank()::kd.size()]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


@kd.elastic.run
def resumed(state):
    return whole_of(state.model, state.optimizer)


def shard_commit_files(root, size):
    names = sorted(n for n in os.listdir(os.path.join(root, "elastic"))
                   if ".shard-" in n)
    stems = sorted({n.split(".shard-")[0] for n in names})
    assert names == sorted(f"{s}.shard-{r:05d}-of-{size:05d}.h5"
                           for s in stems for r in range(size)), names
    return stems


def mode_np2(root):
    a = Toy(**settings(checkpoint_dir=os.path.join(root, "a"),
                       checkpoint_every_steps=2))
    a.fit()
    state = whole_state(a)
    if kd.rank() == 0:
        manifest = check_shard_files(os.path.join(root, "a"), 2)
        assert manifest["epoch"] == 2 and manifest["samples"] == 0
        assert sorted(n for n in os.listdir(os.path.join(root, "a"))
                      if n.endswith(".json")) == [
            "epoch-000001.json", "epoch-000002.json"]
    kd.barrier(name="test.a_checked")
    ok("shard_files_per_rank_named_in_manifest")
    save_state(state, os.path.join(root, "a.npz"))

    directory = os.path.join(root, "b")
    # Whenever every rank's writer is free: the ranks agree at each step.
    b = Toy(**settings(checkpoint_dir=directory,
                       checkpoint_every_seconds=1e-9))
    b.stop_at = (1, 4)  # a step checkpoint of epoch 2 is the newest
    try:
        b.fit()
        raise AssertionError("StopAt did not stop the job")
    except Stop:
        pass
    if kd.rank() == 0:
        manifest = check_shard_files(directory, 2)
        # After one of batches 0 to 4 of epoch 2 (the one it stopped at).
        assert manifest["epoch"] == 1 and 0 < manifest["samples"] <= 80, \
            manifest
    kd.barrier(name="test.b_checked")
    resumed = Toy(**settings(checkpoint_dir=directory))
    resumed.fit()
    assert resumed.initial_epoch == 1 and resumed.initial_samples > 0
    assert_state(whole_state(resumed), state, 1e-12, "step resume")
    ok("step_checkpoint_resume_equals_straight_run")

    model, opt, el = elastic_model(root, "optimizer_state")
    elastic_steps(model, 3, 11)
    el.commit()
    elastic_steps(model, 2, 12)
    el.commit()
    state = whole_of(model, opt)
    if kd.rank() == 0:
        # Each commit: one file a rank; the newest two are kept (.prev).
        assert len(shard_commit_files(root, 2)) == 2
    kd.barrier(name="test.elastic2")
    save_state(state, os.path.join(root, "el2.npz"))
    ok("elastic_commit_writes_a_shard_file_per_rank")

    model, opt, el = elastic_model(root, "weights", "elastic_w")
    elastic_steps(model, 3, 11)
    el.commit()
    save_state(whole_of(model, opt), os.path.join(root, "elw2.npz"))

    mixed_float16_like_replicated(root)
    ok("mixed_float16_sharded_like_replicated")


# Both average the same float32 gradients (bit for bit on CPU; another
# summation order moves float32 by ~1e-7 a step, which float16
# activations may round up to ~1e-3 relative in a gradient, rarely).
TOL_F16 = 1e-5


def mixed_float16_like_replicated(root):
    """Trainer(shard=...) under the mixed_float16 policy: Keras wraps the
    sharded DistributedOptimizer in its LossScaleOptimizer (whose
    finiteness check is agreed over the ranks). Against the replicated
    Trainer, which reduces the same float32 gradients: the weights within
    TOL_F16 and the same loss scale. Its checkpoint (one shard file a
    rank) loads with the state it saved exactly, loss scale included."""
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        directory = os.path.join(root, "mixed")
        s = Toy(**settings(epochs=1, checkpoint_dir=directory,
                           shard="gradients"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s.fit()
        # The checkpoints hold the inner optimizer's shared variables once,
        # in the wrapper's entry: no warning of slots left out.
        assert not [str(w.message) for w in caught
                    if "optimizer" in str(w.message)], caught
        r = Toy(**settings(epochs=1, shard=None))
        r.fit()
        lso = s.model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer), lso
        assert _optimizer.sharded_in(lso) is s.optimizer
        assert all(w.dtype == np.float32 for w in s.model.get_weights())
        got, want = s.model.get_weights(), r.model.get_weights()
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
        keras.utils.set_random_seed(settings()["seed"])  # as fit() starts
        start = Toy(**settings()).build_model().get_weights()
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(got, start))
        print(f"mixed_float16: sharded vs replicated {diff:.2e}, moved "
              f"{moved:.2e}", flush=True)
        assert diff <= TOL_F16 < moved / 100, (diff, moved)
        scale = float(lso.dynamic_scale.numpy())
        assert scale == float(r.model.optimizer.dynamic_scale.numpy())
        state = whole_state(s)
        if kd.rank() == 0:
            record = checkpoints.latest(directory)["optimizer_shards"]
            assert record["size"] == 2 and len(record["files"]) == 2, record
        kd.barrier(name="test.mixed_checked")
        back = Toy.from_checkpoint(directory, **settings(
            epochs=2, shard="gradients",
            checkpoint_dir=os.path.join(root, "mixed_unused")))
        x, y = make_data(N, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepare(back, x, y)
        assert not [str(w.message) for w in caught
                    if "optimizer" in str(w.message)], caught
        assert_state(whole_state(back), state, 0.0, "mixed_float16 resume")
        assert float(back.model.optimizer.dynamic_scale.numpy()) == scale
    finally:
        keras.mixed_precision.set_dtype_policy(previous)


def mode_np3(root):
    a = load_state(os.path.join(root, "a.npz"))
    s3 = Toy.from_checkpoint(os.path.join(root, "a"), **settings(
        epochs=4, checkpoint_dir=os.path.join(root, "s3")))
    r3 = Toy.from_checkpoint(os.path.join(root, "a"), **settings(
        epochs=4, checkpoint_dir=os.path.join(root, "r3"), shard=None))
    x, y = make_data(N, 1)
    prepare(s3, x, y)
    assert_state(whole_state(s3), a, 0.0, "2 -> 3 sharded")
    ok("resume_2_to_3_sharded_exact")
    prepare(r3, x, y)
    assert_state(whole_state(r3), a, 0.0, "2 sharded -> 3 replicated")
    ok("resume_sharded_to_replicated_exact")
    s3.fit()
    r3.fit()
    s, r = whole_state(s3), whole_state(r3)
    assert_state(s, r, 1e-9, "sharded vs replicated at np 3")
    assert any(np.any(s[k] != a[k]) for k in a)  # it trained
    if kd.rank() == 0:
        check_shard_files(os.path.join(root, "s3"), 3)
    kd.barrier(name="test.s3_checked")
    ok("continues_like_replicated")
    back = Toy.from_checkpoint(os.path.join(root, "r3"), **settings(
        epochs=4, checkpoint_dir=os.path.join(root, "unused")))
    prepare(back, x, y)  # each of 3 ranks reads its slices of r3's file
    assert_state(whole_state(back), r, 0.0, "3 replicated -> 3 sharded")
    ok("resume_replicated_to_sharded_exact")
    save_state(s, os.path.join(root, "s3.npz"))
    save_state(r, os.path.join(root, "r3.npz"))

    model, opt, el = elastic_model(root, "gradients")
    assert_state(resumed(el), load_state(os.path.join(root, "el2.npz")),
                 0.0, "elastic 2 -> 3 sharded")
    elastic_steps(model, 2, 13)
    el.commit()
    save_state(whole_of(model, opt), os.path.join(root, "el3a.npz"))
    elastic_steps(model, 2, 14)
    el.commit()
    save_state(whole_of(model, opt), os.path.join(root, "el3b.npz"))
    if kd.rank() == 0:
        assert len(shard_commit_files(root, 3)) == 2
    kd.barrier(name="test.elastic3")
    ok("elastic_resume_2_to_3_sharded_exact")

    elastic_replicated_to_sharded(root)
    ok("elastic_replicated_commit_resumes_sharded_exact")

    model, opt, el = elastic_model(root, "weights", "elastic_w")
    directory = os.path.join(root, "elastic_w")
    if kd.rank() == 0:  # np 2's commit, for the state numbered here
        (commit,) = glob.glob(os.path.join(directory, "state-*.npz"))
        here = os.path.join(directory, f"state-{el._number}.npz")
        if commit != here:
            shutil.copy(commit, here)
    kd.barrier(name="test.elastic_w")
    assert_state(resumed(el), load_state(os.path.join(root, "elw2.npz")),
                 0.0, "elastic sharded weights 2 -> 3")
    ok("elastic_commit_of_sharded_weights_resumes_at_3")


def elastic_replicated_to_sharded(root):
    """A replicated optimizer's commit (slots whole) taken by a state of
    a sharded one at 3 ranks: each rank's slots are its slices of the
    committed values, and a step after equals the replicated one's."""
    model_r, opt_r, el_r = elastic_model(root, None, "elastic_r")
    elastic_steps(model_r, 2, 15)
    el_r.commit()
    whole = [keras.ops.convert_to_numpy(v) for v in opt_r.variables]
    model_s, opt_s, el_s = elastic_model(root, "optimizer_state",
                                         "elastic_r")
    directory = os.path.join(root, "elastic_r")
    if kd.rank() == 0:  # the same commit, for the state numbered after it
        shutil.copy(os.path.join(directory, f"state-{el_r._number}.npz"),
                    os.path.join(directory, f"state-{el_s._number}.npz"))
    kd.barrier(name="test.elastic_r")
    assert_state(resumed(el_s), whole_of(model_r, opt_r), 0.0,
                 "elastic replicated -> 3 sharded")
    layout = _optimizer.shard_state(opt_s).layout
    slots = _shard_files.slot_variables(opt_s)
    assert len(slots) == 8, slots
    for i, v, j in slots:
        n, c = layout.numels[j], layout.chunks[j]
        lo, hi = kd.rank() * c, min((kd.rank() + 1) * c, n)
        want = np.zeros(c)
        want[:max(hi - lo, 0)] = whole[i].ravel()[lo:hi]
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), want)
    elastic_steps(model_s, 1, 16)
    elastic_steps(model_r, 1, 16)
    assert_state(whole_of(model_s, opt_s), whole_of(model_r, opt_r), 1e-9,
                 "elastic replicated -> sharded, a step on")


def mode_np1(root):
    s3 = load_state(os.path.join(root, "s3.npz"))
    r3 = load_state(os.path.join(root, "r3.npz"))
    x, y = make_data(N, 1)
    cases = [("s3", "optimizer_state", s3), ("s3", None, s3),
             ("r3", "gradients", r3)]
    for name, shard, want in cases:
        t = Toy.from_checkpoint(os.path.join(root, name),
                                **settings(shard=shard, epochs=4))
        prepare(t, x, y)
        assert_state(whole_state(t), want, 0.0, f"{name} -> 1 {shard}")
    ok("resume_3_to_1_and_replicated_sharded_exact")

    bad = os.path.join(root, "c1")
    shutil.copytree(os.path.join(root, "s3"), bad)
    newest = os.path.join(bad, "epoch-000004.shard-00001-of-00003.h5")
    with open(newest, "r+b") as f:
        f.seek(os.path.getsize(newest) - 8)
        f.write(b"\x00damaged")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = checkpoints.latest(bad)
    assert manifest["epoch"] == 3, manifest["epoch"]
    text = " ".join(str(w.message) for w in caught)
    assert newest in text and "checksum" in text, text
    t = Toy(**settings(checkpoint_dir=bad, epochs=4))
    t.fit()
    assert t.initial_epoch == 3 and t.resumed_from.endswith(
        "epoch-000003.weights.h5"), (t.initial_epoch, t.resumed_from)
    ok("damaged_shard_file_falls_back")

    gone = os.path.join(root, "c2")
    shutil.copytree(os.path.join(root, "s3"), gone)
    for e in (3, 4):
        os.remove(os.path.join(gone,
                               f"epoch-{e:06d}.shard-00002-of-00003.h5"))
    try:
        checkpoints.latest(gone, warn=False)
        raise AssertionError("no CheckpointError")
    except checkpoints.CheckpointError as e:
        assert "epoch-000004.shard-00002-of-00003.h5 is missing" in str(e)
        assert "epoch-000003.shard-00002-of-00003.h5 is missing" in str(e)
    ok("missing_shard_file_names_it")

    intact = os.path.join(root, "elastic")
    damaged = os.path.join(root, "elastic_damaged")
    shutil.copytree(intact, damaged)
    model, opt, el = elastic_model(root, None)
    assert_state(resumed(el), load_state(os.path.join(root, "el3b.npz")),
                 0.0, "elastic 3 sharded -> 1 replicated")
    newest = shard_commit_files(root, 3)
    with np.load(os.path.join(damaged, "state-0.npz")) as f:
        header = bytes(f["header"]).decode()
    stem = [s for s in newest if s in header][0]
    victim = os.path.join(damaged, f"{stem}.shard-00002-of-00003.h5")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 8)
        f.write(b"\x00damaged")
    os.environ[kd.elastic.ELASTIC_DIR_ENV] = damaged
    assert_state(resumed(el), load_state(os.path.join(root, "el3a.npz")),
                 0.0, "elastic fallback to .prev")
    ok("elastic_resume_3_to_1_replicated_and_damaged_shard_falls_back")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["np2", "np3", "np1"])
    p.add_argument("root")
    args = p.parse_args()
    kd.init()
    {"np2": mode_np2, "np3": mode_np3, "np1": mode_np1}[args.mode](args.root)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
