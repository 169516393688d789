"""hvd.elastic's states, `run` and Keras callbacks, on every rank of one job
(tests/parallel/test_elastic.py), or in one plain process without the
launcher. Prints "ok NAME" per passed check on every rank.

argv: DIR   a directory every rank sees; KERASDIST_ELASTIC_DIR is set to
            DIR/commits unless argv[2] is "nodir" (then it is unset)
"""

import os
import sys

import numpy as np

DIR = sys.argv[1]
NODIR = len(sys.argv) > 2 and sys.argv[2] == "nodir"
if NODIR:
    os.environ.pop("KERASDIST_ELASTIC_DIR", None)
else:
    os.environ["KERASDIST_ELASTIC_DIR"] = os.path.join(DIR, "commits")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasdist as hvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def committed(state):
    return hvd.elastic._read_record(state.path)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=1e-7)


@check
def names():
    import kerasdist.tensorflow as kdtf
    assert kdtf.elastic is hvd.elastic
    for name in ("run", "State", "ObjectState", "TensorFlowState",
                 "TensorFlowKerasState", "KerasState", "CommitStateCallback",
                 "UpdateBatchStateCallback", "UpdateEpochStateCallback",
                 "HorovodInternalError", "HostsUpdatedInterrupt"):
        assert hasattr(hvd.elastic, name), name
    assert issubclass(hvd.elastic.CommitStateCallback,
                      keras.callbacks.Callback)
    assert hvd.elastic.HostsUpdatedInterrupt(True).skip_sync is True


@check
def object_state_commit_restore_sync():
    state = hvd.elastic.ObjectState(epoch=10 + RANK, batch=20 + RANK,
                                    extra={"rank": RANK})
    state.sync()  # rank 0's values everywhere
    assert (state.epoch, state.batch, state.extra) == (10, 20, {"rank": 0})
    state.epoch, state.batch = 11, 21
    state.restore()  # undone
    assert (state.epoch, state.batch) == (10, 20)
    state.epoch, state.batch = 12, 22
    state.commit()
    state.epoch = 99
    state.restore()  # back to the commit
    assert (state.epoch, state.batch) == (12, 22)
    if NODIR:
        assert state.path is None
        return
    if RANK == 0:
        rec = committed(state)
        assert rec["size"] == SIZE
        assert rec["saved"]["objects"] == {"epoch": 12, "batch": 22,
                                           "extra": {"rank": 0}}, rec
        assert not [f for f in os.listdir(os.path.dirname(state.path))
                    if f.startswith(".tmp")]
    hvd.barrier()


@check
def tensorflow_state_like_horovods_test():
    v = 1.0 if RANK == 0 else 2.0
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full(2, v))]
    state = hvd.elastic.TensorFlowState(variables, batch=20 + RANK,
                                        epoch=10 + RANK)
    state.sync()
    for var in variables:
        close(var, np.ones(var.shape))
    assert (state.batch, state.epoch) == (20, 10)
    other = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.0, 0.0])]
    for var, value in zip(variables, other):
        var.assign(value)
    state.batch, state.epoch = 21, 11
    state.restore()
    for var in variables:
        close(var, np.ones(var.shape))
    assert (state.batch, state.epoch) == (20, 10)
    for var, value in zip(variables, other):
        var.assign(value + RANK)  # rank 0's go to the file
    state.batch = 21
    state.commit()
    state.restore()
    for var, value in zip(variables, other):
        close(var, value + RANK)
    if not NODIR and RANK == 0:
        rec = committed(state)["saved"]
        for got, want in zip(rec["values"], other):
            close(got, want)
        assert rec["objects"] == {"batch": 21, "epoch": 10}
    hvd.barrier()


def small_model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dropout(0.5),
                              keras.layers.Dense(2)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(loss="mse", optimizer=opt, jit_compile=False)
    opt.build(model.trainable_variables)
    return model, opt


def all_values(model, opt):
    return [keras.ops.convert_to_numpy(v) for v in
            list(model.variables) + list(opt.variables)]


@check
def keras_state_sync_restore_commit():
    model, opt = small_model(100 + RANK)  # different weights per rank
    state = hvd.elastic.KerasState(model, opt, batch=0, epoch=0)
    state.sync()
    mine = all_values(model, opt)
    everyone = hvd.allgather_object(mine)
    for other in everyone:
        for a, b in zip(mine, other):
            close(a, b)  # the weights, slots and seed states are rank 0's
    synced = mine
    x = np.ones((8, 3), np.float32)
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, epochs=1,
              verbose=0)
    assert int(opt.iterations) == 2
    state.restore()
    for a, b in zip(all_values(model, opt), synced):
        close(a, b)
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, epochs=1,
              verbose=0)
    trained = all_values(model, opt)
    state.commit()
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, epochs=1,
              verbose=0)
    state.restore()
    for a, b in zip(all_values(model, opt), trained):
        close(a, b)
    if not NODIR and RANK == 0:
        for a, b in zip(committed(state)["saved"]["values"], trained):
            close(a, b)
    hvd.barrier()


@check
def run_resumes_from_the_commit_and_syncs():
    if NODIR:
        return
    # A first "attempt" commits; a second state object with the same
    # number stands for the restarted process.
    model, opt = small_model(7)
    first = hvd.elastic.KerasState(model, opt, batch=3, epoch=2, lr=0.5)
    first.sync()
    first.commit()
    want = all_values(model, opt)
    number = first._number
    model2, opt2 = small_model(200 + RANK)
    second = hvd.elastic.KerasState(model2, opt2, batch=0, epoch=0, lr=0.1)
    second._number = number
    resets = []
    second.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, a, b=0):
        return (state.epoch, state.batch, state.lr, a, b)

    assert train(second, 1, b=2) == (2, 3, 0.5, 1, 2)
    for a, b in zip(all_values(model2, opt2), want):
        close(a, b)
    assert resets == []  # committed at this size: no reset
    # A commit made at another size: the reset callbacks run, on every
    # rank, before the sync.
    if RANK == 0:
        rec = committed(first)
        rec["size"] = SIZE + 3
        hvd.elastic._write_record(first.path, rec)
    hvd.barrier()
    assert train(second, 5)[3] == 5
    assert resets == [SIZE]
    # A model of another shape: one clear error.
    if RANK == 0:
        wrong = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        third = hvd.elastic.KerasState(wrong, keras.optimizers.SGD(),
                                       batch=0, epoch=0)
        third._number = number
        try:
            third.load_committed()
            raise AssertionError("no error")
        except ValueError as e:
            assert "the model changed" in str(e), e
    hvd.barrier()


@check
def run_without_a_launcher_just_runs():
    state = hvd.elastic.ObjectState(epoch=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.epoch)
        return "done"

    assert train(state) == "done" and calls == [0]
    # Not an elastic job: check_host_updates never raises, commit works.
    state.epoch = 4
    state.commit()
    state.check_host_updates()


@check
def internal_error_ends_the_rank():
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        raise hvd.elastic.HorovodInternalError("allreduce failed")

    try:
        train(state)
        raise AssertionError("no exception")
    except SystemExit as e:
        assert not NODIR and e.code == 1, e
    except hvd.elastic.HorovodInternalError:
        assert NODIR  # no restart to hand over to: the error itself

    # A kerasdist op's runtime failure counts as one (as Horovod's TF run
    # takes its ops' UnknownError); another error passes through.
    @hvd.elastic.run
    def failing(state, error):
        raise error

    aborted = tf.errors.AbortedError(
        None, None, "peer lost [Op:KerasdistAllreduce]")
    try:
        failing(state, aborted)
        raise AssertionError("no exception")
    except SystemExit as e:
        assert not NODIR and e.code == 1, e
    except tf.errors.AbortedError:
        assert NODIR
    try:
        failing(state, tf.errors.AbortedError(None, None, "another op"))
        raise AssertionError("no exception")
    except tf.errors.AbortedError:
        pass


@check
def keras_callbacks_count_and_resume_within_an_epoch():
    model, opt = small_model(3)
    state = hvd.elastic.KerasState(model, opt, batch=0, epoch=0)
    commits = []
    real_commit = state.commit

    def counting_commit():
        commits.append((state.epoch, state.batch))
        real_commit()

    state.commit = counting_commit
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((state.epoch, batch))

    x = np.ones((20, 3), np.float32)
    y = np.zeros((20, 2), np.float32)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state), Seen()]
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    assert (state.epoch, state.batch) == (2, 0)
    # Every batch but an epoch's last commits; every epoch end does.
    assert commits == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0),
                       (1, 1), (1, 2), (1, 3), (1, 4), (2, 0)], commits
    # Resumed in epoch 3 after 3 of its 5 batches: that epoch runs the
    # other 2, the next one all 5.
    state.epoch, state.batch = 2, 3
    del seen[:], commits[:]
    before = int(opt.iterations)
    model.fit(x, y, batch_size=4, epochs=4 - state.epoch,
              callbacks=callbacks, verbose=0)
    assert int(opt.iterations) - before == 7, int(opt.iterations)
    assert seen == [(2, 0), (2, 1)] + [(3, b) for b in range(5)], seen
    assert commits[:2] == [(2, 4), (3, 0)], commits
    assert (state.epoch, state.batch) == (4, 0)
    # With batches_per_commit=2 every other batch commits.
    del commits[:]
    state.epoch = 0
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])
    assert commits == [(0, 2), (0, 4), (1, 0)], commits


@check
def commits_are_data_never_code_and_fall_back():
    """A commit is arrays + JSON: every kind of value a state holds comes
    back as it was; a planted pickle never runs; a torn or foreign last
    commit gives way to the one before it."""
    values = dict(epoch=1, lr=0.5, big=1 << 70, name="ab", blob=b"\x00x",
                  arr=np.arange(3, dtype=np.int16), scalar=np.float32(2.5),
                  pair=(1, [2, None]), table={1: "a", (2, 3): True})
    # Every rank makes the states (their numbers name the files).
    state = hvd.elastic.ObjectState(**values)
    not_data = hvd.elastic.ObjectState(fn=len)
    if NODIR or RANK != 0:
        hvd.barrier()
        return
    state.save()
    state.persist()
    back = committed(state)["saved"]["objects"]
    assert back.keys() == values.keys()
    for k, v in values.items():
        if isinstance(v, (np.ndarray, np.generic)):
            assert type(back[k]) is type(v) and back[k].dtype == v.dtype
            close(back[k], v)
        else:
            assert back[k] == v and type(back[k]) is type(v), (k, back[k])
    state.epoch = 2
    state.save()
    state.persist()  # the commit of epoch=1 is now the fallback
    marker = os.path.join(DIR, "planted-pickle-ran")

    class Planted:
        def __reduce__(self):
            return (open, (marker, "w"))

    import pickle
    for bad in (pickle.dumps({"format": 2, "size": 1, "saved": Planted()}),
                open(state.path, "rb").read()[:100]):  # torn
        with open(state.path, "wb") as f:
            f.write(bad)
        # The old name of a commit, planted too: never read.
        with open(state.path[:-len(".npz")] + ".pkl", "wb") as f:
            f.write(pickle.dumps(Planted()))
        state.epoch = 99
        assert state.load_committed() == SIZE
        assert state.epoch == 1, state.epoch
        assert not os.path.exists(marker)
    with open(state.path + ".prev", "wb") as f:
        f.write(b"garbage")
    try:
        state.load_committed()
        raise AssertionError("no error")
    except ValueError as e:
        assert "no commit can be read" in str(e), e
    # A value that is not data: one clear error at the commit.
    try:
        not_data.persist()
        raise AssertionError("no error")
    except TypeError as e:
        assert "cannot write the committed state: it holds a value of " \
            "type builtin_function_or_method" in str(e), e
    hvd.barrier()


for fn in CHECKS:
    fn()
    print(f"ok {fn.__name__}", flush=True)
print("done", flush=True)
