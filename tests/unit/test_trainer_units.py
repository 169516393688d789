"""Trainer in one process (kerasdist at size 1): bad input fails before
training, the checkpoint store, and the epoch pipeline."""

import json
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist.trainer import checkpoints  # noqa: E402
from kerasdist.trainer import data as _trainer_data  # noqa: E402
from kerasdist.trainer import inplace as _trainer_inplace  # noqa: E402
from kerasdist.trainer import snapshot as _trainer_snapshot  # noqa: E402
from kerasdist.trainer import state as _trainer_state  # noqa: E402

X = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int64")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass  # an earlier test module already started TF's thread pools
    yield
    if kd.is_initialized():
        kd.shutdown()


class Tiny(kd.Trainer):
    def build_model(self):
        return keras.Sequential([keras.Input((4,)),
                                 keras.layers.Dense(2, activation="softmax")])

    def train_data(self):
        return X, Y


@pytest.mark.parametrize("kwargs, needle", [
    ({"epochs": 0}, "epochs must be an int >= 1, got 0"),
    ({"epochs": -2}, "epochs must be an int >= 1, got -2"),
    ({"epochs": 1.5}, "epochs must be an int >= 1, got 1.5"),
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
    ({"batch_size": -8}, "batch_size must be an int >= 1, got -8"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be an int >= 1"),
    ({"learning_rate": 0.0}, "learning_rate must be a number > 0"),
    ({"warmup_epochs": -1}, "warmup_epochs must be an int >= 0"),
    ({"fit_kwargs": {"epochs": 3}}, "fit_kwargs may not set ['epochs']"),
    ({"checkpoint_every_steps": 0, "checkpoint_dir": "c"},
     "checkpoint_every_steps must be an int >= 1, got 0"),
    ({"checkpoint_every_steps": 2.5, "checkpoint_dir": "c"},
     "checkpoint_every_steps must be an int >= 1, got 2.5"),
    ({"checkpoint_every_seconds": 0, "checkpoint_dir": "c"},
     "checkpoint_every_seconds must be a number > 0, got 0"),
    ({"checkpoint_every_seconds": "60", "checkpoint_dir": "c"},
     "checkpoint_every_seconds must be a number > 0, got '60'"),
    ({"checkpoint_every_steps": 10}, "need a checkpoint_dir"),
    ({"checkpoint_every_seconds": 30.0}, "need a checkpoint_dir"),
    ({"commit_every_steps": 0},
     "commit_every_steps must be an int >= 1 or None, got 0"),
    ({"commit_every_steps": True},
     "commit_every_steps must be an int >= 1 or None, got True"),
])
def test_bad_settings_raise_in_constructor(kwargs, needle):
    with pytest.raises(ValueError) as e:
        Tiny(**kwargs)
    assert needle in str(e.value)


def test_in_memory_commit_every_steps_restores_the_state():
    # What the Trainer commits for recovery in place: the weights and the
    # optimizer's variables (its step count, learning rate and moments)
    # as they were, and where the data stood.
    trainer = Tiny(epochs=1, batch_size=8, verbose=0)
    trainer.fit()
    model = trainer.model
    commits = _trainer_inplace.Commits(model)
    commits.take(1, 16, [])
    before = [np.array(keras.ops.convert_to_numpy(v))
              for v in model.weights + model.optimizer.variables]
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    trainer.optimizer.learning_rate = 0.5
    assert int(trainer.optimizer.iterations) == 10
    point = commits.restore()
    assert (point.epoch, point.samples, point.world_size) == (1, 16, 1)
    after = [keras.ops.convert_to_numpy(v)
             for v in model.weights + model.optimizer.variables]
    assert len(before) == len(after) > 4
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(trainer.optimizer.iterations) == 5
    assert not commits.sharded


def test_a_jitted_steps_ranks_lost_error_reads_as_one():
    # JAX's error around a failed kerasdist op carries the core's text:
    # it counts as a lost rank, told with the core's message alone.
    error = RuntimeError("INTERNAL: kerasdist: rank 0: a rank of the job "
                         "was lost (MPI_ERR_PROC_FAILED)\nmore")
    assert _trainer_inplace.ranks_lost(error)
    lost = _trainer_inplace.as_ranks_lost(error)
    assert isinstance(lost, kd.elastic.RanksLostError)
    assert str(lost) == "rank 0: a rank of the job was lost " \
        "(MPI_ERR_PROC_FAILED)"
    assert not _trainer_inplace.ranks_lost(RuntimeError("other"))


def test_tensorboard_logs_or_a_clear_error(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            Tiny(tensorboard_dir=tmp_path)
        return
    Tiny(epochs=1, verbose=0, tensorboard_dir=tmp_path).fit()
    assert [p for p in tmp_path.rglob("*") if "tfevents" in p.name]


def test_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(ValueError, match="must be a directory.*is a file"):
        Tiny(checkpoint_dir=path)


@pytest.mark.parametrize("data", [[1, 2, 3], "x.csv", (X,), {"x": X}])
def test_train_data_of_wrong_type(tmp_path, data):
    class Bad(Tiny):
        def train_data(self):
            return data

    trainer = Bad(checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(TypeError, match="train_data\\(\\) must return a "
                       "tf.data.Dataset.*got " + type(data).__name__):
        trainer.fit()
    assert trainer.model is None  # nothing was built or trained
    assert not (tmp_path / "ckpt").exists()


def test_mismatched_array_lengths():
    class Bad(Tiny):
        def train_data(self):
            return X, Y[:-1]

    with pytest.raises(ValueError, match="different lengths \\[39, 40\\]"):
        Bad().fit()


def test_build_model_not_a_model(tmp_path):
    class Bad(Tiny):
        def build_model(self):
            return keras.layers.Dense(2)

    trainer = Bad(checkpoint_dir=tmp_path)
    with pytest.raises(TypeError, match="build_model\\(\\) must return a "
                       "keras.Model, got Dense"):
        trainer.fit()
    assert os.listdir(tmp_path) == []


def test_build_optimizer_not_an_optimizer():
    class Bad(Tiny):
        def build_optimizer(self, learning_rate):
            return "adam"

    with pytest.raises(TypeError, match="keras.optimizers.Optimizer, got"):
        Bad().fit()


def test_fine_tune_freeze_with_a_sharded_optimizer(tmp_path):
    # The sharded optimizer built on every variable updates the unfrozen
    # ones only, as the replicated one does.
    class TwoLayers(Tiny):
        def build_model(self):
            return keras.Sequential([
                keras.Input((4,)), keras.layers.Dense(3, name="h"),
                keras.layers.Dense(2, activation="softmax", name="o")])

    final = {}
    for shard in (None, "optimizer_state"):
        t = TwoLayers(epochs=1, batch_size=8, verbose=0, shard=shard,
                      checkpoint_dir=tmp_path / str(shard))
        t.fit()
        hidden = t.model.get_layer("h").get_weights()
        out = t.model.get_layer("o").get_weights()
        t.fine_tune((X, Y), epochs=2, freeze=["h"])
        for a, b in zip(t.model.get_layer("h").get_weights(), hidden):
            np.testing.assert_array_equal(a, b)
        assert any(np.any(a != b) for a, b in
                   zip(t.model.get_layer("o").get_weights(), out))
        final[shard] = t.model.get_weights()
    for a, b in zip(final[None], final["optimizer_state"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_bad_fine_tune_arguments():
    trainer = Tiny()
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):
        trainer.fine_tune((X, Y), epochs=0)
    with pytest.raises(ValueError, match="learning_rate must be a number"):
        trainer.fine_tune((X, Y), epochs=1, learning_rate=-1.0)
    with pytest.raises(ValueError, match="freeze names unknown layers "
                       "\\['nope'\\]; the model has \\['dense"):
        trainer.fine_tune((X, Y), epochs=1, freeze=["nope"])
    assert int(trainer.optimizer.iterations) == 0  # nothing was trained


def test_missing_overrides_say_what_to_do():
    with pytest.raises(NotImplementedError, match="must override train_data"):
        kd.Trainer().fit()


def test_fit_at_size_one_learns_and_resumes(tmp_path):
    history = Tiny(epochs=3, batch_size=8, learning_rate=0.05,
                   checkpoint_dir=tmp_path / "ckpt", verbose=0).fit()
    losses = history.history["loss"]
    assert losses[-1] < losses[0], losses
    again = Tiny(epochs=3, batch_size=8, learning_rate=0.05,
                 checkpoint_dir=tmp_path / "ckpt", verbose=0)
    history = again.fit()
    assert again.initial_epoch == 3 and history.history == {}
    assert int(again.optimizer.iterations) == 3 * 5  # 40 examples / 8


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    # Weights saved without their optimizer, as a valid checkpoint: an
    # exact resume refuses them (one line saying what to do);
    # fresh_optimizer=True resumes with a fresh optimizer.
    bare = Tiny().build_model()
    checkpoints.save(tmp_path, 2, bare.save_weights, {})
    with pytest.raises(kd.Trainer.CheckpointError,
                       match="holds 0 of the optimizer's .* variables .*"
                             "pass fresh_optimizer=True"):
        Tiny(epochs=3, batch_size=8, checkpoint_dir=tmp_path,
             verbose=0).fit()
    fresh = Tiny(epochs=3, batch_size=8, checkpoint_dir=tmp_path, verbose=0,
                 fresh_optimizer=True)
    fresh.fit()
    assert fresh.initial_epoch == 2
    assert int(fresh.optimizer.iterations) == 5  # one epoch, from step 0


def test_from_checkpoint_without_checkpoint(tmp_path):
    with pytest.raises(checkpoints.CheckpointError, match="no checkpoint"):
        Tiny.from_checkpoint(tmp_path)


class _Crash(Exception):
    pass


def test_fine_tune_resumes_after_a_crash(tmp_path):
    x2, y2 = X[::-1] * 1.5, 1 - Y[::-1]  # "new data": another task
    Tiny(epochs=2, batch_size=8, checkpoint_dir=tmp_path / "base",
         verbose=0).fit()
    reference = Tiny.from_checkpoint(tmp_path / "base",
                                     checkpoint_dir=tmp_path / "ref")
    reference.fine_tune((x2, y2), epochs=3, learning_rate=0.02)

    class CrashAfterEpoch4(Tiny):
        def callbacks(self):
            def crash(epoch, logs):
                if epoch == 3:  # the second fine-tuning epoch, checkpointed
                    raise _Crash()
            return [keras.callbacks.LambdaCallback(on_epoch_end=crash)]

    crashed = CrashAfterEpoch4.from_checkpoint(
        tmp_path / "base", checkpoint_dir=tmp_path / "ft")
    with pytest.raises(_Crash):
        crashed.fine_tune((x2, y2), epochs=3, learning_rate=0.02)
    again = Tiny.from_checkpoint(tmp_path / "base",
                                 checkpoint_dir=tmp_path / "ft")
    again.fine_tune((x2, y2), epochs=3, learning_rate=0.02)
    assert again.initial_epoch == 4 and reference.initial_epoch == 2
    for a, b in zip(again.model.weights + again.optimizer.variables,
                    reference.model.weights + reference.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A fine-tuning over other epochs does not pick those checkpoints up.
    other = Tiny.from_checkpoint(tmp_path / "base",
                                 checkpoint_dir=tmp_path / "ft")
    other.fine_tune((x2, y2), epochs=1)
    assert other.initial_epoch == 2


def test_model_names_do_not_depend_on_earlier_models():
    def build():
        return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

    with _trainer_state.rank_independent_names():
        first = build()
    build()  # a model only this "rank" builds
    with _trainer_state.rank_independent_names():
        second = build()
    assert [v.path for v in second.weights] == [v.path for v in first.weights]
    assert build().name not in (first.name, second.name)  # still unique


class Dropping(Tiny):
    """Tiny with dropout (random numbers to resume) and a crash at a given
    optimizer step."""

    crash_at = None

    def build_model(self):
        return keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(2, activation="softmax")])

    def callbacks(self):
        # The steps counted here, not read from the optimizer: on JAX its
        # variables hold the state mid-epoch only once a callback syncs it.
        steps = [0]

        def crash(batch, logs):
            steps[0] += 1
            if steps[0] == self.crash_at:
                raise _Crash()
        return [keras.callbacks.LambdaCallback(on_train_batch_end=crash)]


def _state(trainer):
    return np.concatenate([np.ravel(np.asarray(v)) for v in
                           trainer.model.weights + trainer.optimizer.variables])


@pytest.mark.parametrize("every", [
    {"checkpoint_every_steps": 2}, {"checkpoint_every_seconds": 1e-9},
    {"checkpoint_every_steps": 2, "shard": "optimizer_state"}],
    ids=["steps", "seconds", "steps_sharded"])
def test_step_checkpoint_resume_at_size_one_is_exact(tmp_path, every):
    # Sharded: the optimizer's slots go to shard files (one at size one),
    # which the manifest names; tests/parallel/test_trainer_shard.py has
    # them at np 2, 3 and 1.
    kwargs = dict(epochs=3, batch_size=8, learning_rate=0.05, verbose=0,
                  warmup_epochs=1, **every)
    straight = Dropping(checkpoint_dir=tmp_path / "a", **kwargs)
    straight.fit()
    crashed = Dropping(checkpoint_dir=tmp_path / "b", **kwargs)
    crashed.crash_at = 8  # epoch 2 (5 steps an epoch), its third step
    with pytest.raises(_Crash):
        crashed.fit()
    # fit() waited for the write in flight; the newest is a step checkpoint.
    newest = checkpoints.latest(tmp_path / "b")
    assert newest["epoch"] == 1 and 0 < newest["samples"] < 40, newest
    assert newest["samples"] == 8 * (newest["step"] - 5)
    if "shard" in every:
        assert [f["name"] for f in newest["optimizer_shards"]["files"]] == [
            "epoch-000001-sample-%09d.shard-00000-of-00001.h5"
            % newest["samples"]]
    # from_checkpoint continues that run too, into another directory.
    copy = Dropping.from_checkpoint(tmp_path / "b",
                                    checkpoint_dir=tmp_path / "c")
    copy.fit()
    assert copy.checkpoint_every_steps == every.get("checkpoint_every_steps")
    np.testing.assert_array_equal(_state(copy), _state(straight))
    resumed = Dropping(checkpoint_dir=tmp_path / "b", **kwargs)
    resumed.fit()
    assert resumed.initial_epoch == 1
    assert resumed.initial_samples == newest["samples"]
    np.testing.assert_array_equal(_state(resumed), _state(straight))
    # At the end only epoch checkpoints are left.
    assert sorted(os.listdir(tmp_path / "b")) == sorted(
        os.listdir(tmp_path / "a"))


def test_step_checkpoint_resume_is_exact_on_jax(tmp_path):
    # The test above, on the JAX backend (the backend is chosen once a
    # process): Keras keeps JAX's training state off the variables in an
    # epoch, and a step snapshot must read the state of that step.
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND="jax")
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "--basetemp", str(tmp_path), __file__, "-k",
         "test_step_checkpoint_resume_at_size_one_is_exact and steps]"],
        capture_output=True, text=True, timeout=240, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
    assert p.returncode == 0 and "1 passed" in p.stdout, \
        p.stdout[-4000:] + p.stderr[-2000:]


def test_snapshot_is_the_keras_weight_file(tmp_path):
    import h5py

    trainer = Dropping(epochs=1, batch_size=8, verbose=0)
    trainer.fit()
    snapshotter = _trainer_snapshot.Snapshotter(trainer.model)
    # Layers and optimizer give their variables: one read, no walk, a step.
    assert snapshotter._layout is not None
    snapshot = snapshotter.take()
    before = _state(trainer)
    trainer.fit()  # the snapshot is a copy: training on leaves it alone
    _trainer_snapshot.write_weights(snapshot, tmp_path / "s.weights.h5")
    trainer.model.save_weights(tmp_path / "k.weights.h5")

    def tree(path):
        items = []
        with h5py.File(path) as f:
            f.visititems(lambda name, obj: items.append(
                (name, dict(obj.attrs)) if isinstance(obj, h5py.Group)
                else (name, obj.shape, obj.dtype)))
        return items

    assert tree(tmp_path / "s.weights.h5") == tree(tmp_path / "k.weights.h5")
    fresh = Dropping(epochs=1, verbose=0)
    fresh._prepare(tf.data.Dataset.from_tensor_slices((X, Y)))
    fresh.model.load_weights(tmp_path / "s.weights.h5")
    np.testing.assert_array_equal(_state(fresh), before)
    assert not np.array_equal(_state(trainer), before)


# ---- checkpoint store ------------------------------------------------------


def _writer(payload):
    def write(path):
        with open(path, "wb") as f:
            f.write(payload)
    return write


def test_store_keeps_newest_and_verifies(tmp_path):
    for epoch in range(1, 5):
        checkpoints.save(tmp_path, epoch, _writer(b"w%d" % epoch),
                         {"step": epoch * 10}, keep=2)
    assert sorted(os.listdir(tmp_path)) == [
        "epoch-000003.json", "epoch-000003.weights.h5",
        "epoch-000004.json", "epoch-000004.weights.h5"]
    manifest = checkpoints.latest(tmp_path)
    assert manifest["epoch"] == 4 and manifest["step"] == 40
    assert manifest["weights_bytes"] == 2
    assert checkpoints.resolve(tmp_path / "epoch-000003.weights.h5")[
        "epoch"] == 3


def test_failed_write_keeps_previous_checkpoint(tmp_path):
    checkpoints.save(tmp_path, 1, _writer(b"good"), {})

    def crash(path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoints.save(tmp_path, 2, crash, {})
    assert sorted(os.listdir(tmp_path)) == ["epoch-000001.json",
                                            "epoch-000001.weights.h5"]
    assert checkpoints.latest(tmp_path)["epoch"] == 1


def test_weights_without_manifest_are_not_a_checkpoint(tmp_path):
    checkpoints.save(tmp_path, 1, _writer(b"one"), {})
    # A crash between the weight rename and the manifest rename.
    (tmp_path / "epoch-000002.weights.h5").write_bytes(b"two")
    assert checkpoints.latest(tmp_path)["epoch"] == 1


def test_damaged_newest_falls_back_with_warning(tmp_path):
    for epoch in (1, 2, 3):
        checkpoints.save(tmp_path, epoch, _writer(b"abcdef"), {})
    (tmp_path / "epoch-000003.weights.h5").write_bytes(b"abcdeX")  # same size
    (tmp_path / "epoch-000002.json").write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = checkpoints.latest(tmp_path)
    assert manifest["epoch"] == 1
    text = [str(w.message) for w in caught]
    assert any("epoch-000003.weights.h5" in t and "checksum" in t
               for t in text), text
    assert any("epoch-000002.json" in t for t in text), text


def test_all_damaged_is_an_error(tmp_path):
    checkpoints.save(tmp_path, 1, _writer(b"abcdef"), {})
    os.truncate(tmp_path / "epoch-000001.weights.h5", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(checkpoints.CheckpointError,
                           match="Every checkpoint in .* is damaged"):
            checkpoints.latest(tmp_path)


def test_manifest_records_checksum(tmp_path):
    import hashlib
    path = checkpoints.save(tmp_path, 7, _writer(b"payload"),
                            {"world_size": 3})
    with open(path) as f:
        manifest = json.load(f)
    assert manifest["weights_sha256"] == hashlib.sha256(b"payload").hexdigest()
    assert manifest["world_size"] == 3 and manifest["epoch"] == 7


def _names(path):
    return sorted(os.listdir(path))


def test_step_checkpoints_order_and_rotation(tmp_path):
    checkpoints.save(tmp_path, 1, _writer(b"e1"), {})
    checkpoints.save(tmp_path, 1, _writer(b"s64"), {}, samples=64)
    assert checkpoints.latest(tmp_path)["samples"] == 64
    checkpoints.save(tmp_path, 1, _writer(b"s128"), {}, samples=128)
    # The older step checkpoint goes once the newer one is complete.
    assert _names(tmp_path) == [
        "epoch-000001-sample-000000128.json",
        "epoch-000001-sample-000000128.weights.h5",
        "epoch-000001.json", "epoch-000001.weights.h5"]
    manifest = checkpoints.latest(tmp_path)
    assert (manifest["epoch"], manifest["samples"]) == (1, 128)
    assert checkpoints.list_checkpoints(tmp_path) == [(1, 128), (1, 0)]
    # A newer epoch checkpoint makes the step checkpoint obsolete.
    checkpoints.save(tmp_path, 2, _writer(b"e2"), {})
    assert _names(tmp_path) == ["epoch-000001.json", "epoch-000001.weights.h5",
                                "epoch-000002.json", "epoch-000002.weights.h5"]


def test_damaged_step_checkpoint_falls_back(tmp_path):
    checkpoints.save(tmp_path, 1, _writer(b"e1"), {})
    checkpoints.save(tmp_path, 1, _writer(b"s64"), {}, samples=64)
    os.truncate(tmp_path / "epoch-000001-sample-000000064.weights.h5", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = checkpoints.latest(tmp_path)
    assert (manifest["epoch"], manifest["samples"]) == (1, 0)
    assert any("sample-000000064" in str(w.message) for w in caught)


@pytest.mark.parametrize("point, kind, survivor", [
    ("written", ".weights.h5", 64), ("renamed", ".weights.h5", 64),
    ("written", ".json", 64), ("committed", ".json", 128)])
def test_a_write_cut_short_leaves_a_checkpoint(tmp_path, monkeypatch, point,
                                               kind, survivor):
    checkpoints.save(tmp_path, 1, _writer(b"s64"), {}, samples=64)

    def hook(where, path):
        if where == point and path.endswith(kind) and "128" in path:
            raise _Crash()

    monkeypatch.setattr(checkpoints, "_fault_hook", hook)
    with pytest.raises(_Crash):
        checkpoints.save(tmp_path, 1, _writer(b"s128"), {}, samples=128)
    assert checkpoints.latest(tmp_path)["samples"] == survivor


def test_temporaries_of_killed_writes_are_removed(tmp_path):
    checkpoints.save(tmp_path, 1, _writer(b"e1"), {})
    (tmp_path / ".tmp-abc.epoch-000002.weights.h5").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("mine")
    assert checkpoints.remove_temporaries(tmp_path) == [
        ".tmp-abc.epoch-000002.weights.h5"]
    assert _names(tmp_path) == ["epoch-000001.json", "epoch-000001.weights.h5",
                                "notes.txt"]


# ---- epoch pipeline --------------------------------------------------------


def _batches(first, last, rank, size):
    tf.random.set_seed(11)  # as Trainer does (the global half of the seed)
    ds = tf.data.Dataset.range(23)
    pipeline, steps = _trainer_data.train_pipeline(
        ds, 23, rank=rank, size=size, sharded=False, batch_size=4, seed=3,
        shuffle=True, shuffle_buffer=None, first_epoch=first,
        last_epoch=last)
    return [b.numpy().tolist() for b in pipeline], steps


def test_epoch_order_does_not_depend_on_the_start_epoch():
    full, steps = _batches(0, 4, rank=0, size=2)
    tail, _ = _batches(2, 4, rank=0, size=2)
    assert steps == 3  # the smaller shard has 11 examples: 3 batches of 4
    assert len(full) == 4 * steps
    assert tail == full[2 * steps:]
    assert full[:steps] != full[steps:2 * steps]  # reshuffled per epoch


def test_shards_are_disjoint_and_equal_in_steps():
    for size in (2, 3):
        seen = []
        for rank in range(size):
            batches, steps = _batches(1, 2, rank, size)
            assert len(batches) == steps
            seen += [x for b in batches for x in b]
        assert len(seen) == len(set(seen))  # no example twice in an epoch
        # 23 over 2: 12 + 11 in 3 batches of <= 4; over 3: 8 + 8 + 7 in 2.
        assert sorted(seen) == list(range(23))


def _epoch(rank, size, batch_size, position=0, n=23):
    """Epoch 1's batches for one rank, from `position` of its order."""
    tf.random.set_seed(11)
    ds = tf.data.Dataset.range(n)
    first_steps = _trainer_data.epoch_steps(
        n, size=size, sharded=False, batch_size=batch_size,
        position=position)
    pipeline, _ = _trainer_data.train_pipeline(
        ds, n, rank=rank, size=size, sharded=False, batch_size=batch_size,
        seed=3, shuffle=True, shuffle_buffer=None, first_epoch=1,
        last_epoch=3, first_position=position, first_steps=first_steps)
    batches = [b.numpy().tolist() for b in pipeline]
    return batches[:first_steps], batches[first_steps:]


def test_resumed_epoch_continues_the_order_at_any_size():
    (order,), _ = _epoch(0, 1, batch_size=23)  # the epoch's permutation
    full = {r: _epoch(r, 2, 4)[0] for r in range(2)}
    # Two steps at size 2 train exactly the first 2 * 4 * 2 examples.
    assert sorted(x for r in range(2) for b in full[r][:2] for x in b) == \
        sorted(order[:16])
    for r in range(2):
        resumed, later = _epoch(r, 2, 4, position=16)
        assert resumed == full[r][2:]  # the same size: the same batches
        assert later == _epoch(r, 2, 4)[1]  # later epochs as before
    for size, batch_size in ((1, 2), (3, 3)):
        rest = [x for r in range(size)
                for b in _epoch(r, size, batch_size, 16)[0] for x in b]
        assert sorted(rest) == sorted(order[16:])  # each once, at any size


def test_epoch_plan_positions():
    plan = _trainer_data.EpochPlan(first_epoch=2, first_position=48,
                                   first_steps=3, steps=7, per_step=16)
    assert plan.position(2, 0) == 64 and plan.position(3, 0) == 16
    assert plan.is_last(2, 2) and not plan.is_last(3, 2)
    assert plan.is_last(3, 6)
    # Fewer examples left than ranks: no step for the rest of the epoch.
    assert _trainer_data.epoch_steps(23, size=3, sharded=False,
                                     batch_size=2, position=21) == 0
