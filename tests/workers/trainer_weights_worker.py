"""Trainer(shard="weights") checkpoints under `kerasdist run -np N`; one job
per size, each reading the files the job before wrote (ROOT is shared):

    python -m kerasdist.run -np 2 python \
        tests/workers/trainer_weights_worker.py np2 ROOT
    (then -np 3 ... np3 ROOT, then -np 1 ... np1 ROOT)

np2  Trains 2 epochs with sharded weights (ROOT/wa, step checkpoints too)
     and replicated (ROOT/ra): the same weights and optimizer state
     (1e-9, float64). Each rank holds 1/N of every weight; each rank's
     shard file holds its shards of the weights and slots, and the
     weight file no sharded weight. Stopped in epoch 2 after a step
     checkpoint and resumed (ROOT/wb), it ends where ROOT/wa ended.
     Saves ROOT/wa.npz and ROOT/ra.npz (the whole state, gathered).
np3  ROOT/wa (2 ranks) resumes with sharded weights and replicated, and
     ROOT/ra (replicated) with sharded weights: each holds the saved
     state exactly; sharded and replicated then train an epoch alike
     (ROOT/s3, ROOT/r3). Saves ROOT/s3.npz.
np1  ROOT/s3 (3 ranks) resumes with sharded weights, replicated and with
     shard="optimizer_state": each holds s3.npz's state exactly.

Prints `OK <check>` per passed check, `DONE` at the end; a failed check
raises. Truths: the replicated Trainer's state, the whole state gathered
by allgather (`get_weights`, `kerasdist_whole_values`) saved with numpy,
the files on disk read with h5py.
"""

import argparse
import os
import sys

import h5py  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
from kerasdist.trainer import checkpoints  # noqa: E402
from tests.workers import trainer_shard_worker as base  # noqa: E402 (tf)

Toy, Stop, settings = base.Toy, base.Stop, base.settings
whole_state, assert_state = base.whole_state, base.assert_state
save_state, load_state, ok = base.save_state, base.load_state, base.ok


def weights(**kw):
    return settings(**dict(dict(shard="weights"), **kw))


def check_weight_files(directory, size):
    """The newest checkpoint: a shard file a rank holding its shards of
    the 4 weights and 8 slots; the weight file none of the weights."""
    manifest = checkpoints.latest(directory)
    record = manifest["optimizer_shards"]
    assert record["size"] == size, record
    saved = record["weights"]
    assert [e["shape"] for e in saved] == [[6, 5], [5], [5, 3], [3]], saved
    for r, f in enumerate(record["files"]):
        with h5py.File(os.path.join(directory, f["name"]), "r") as h:
            assert sorted(k for k in h.keys() if k.startswith("w")) == \
                ["w0", "w1", "w2", "w3"], list(h.keys())
            for e in saved:
                assert h[e["key"]].shape == (e["chunk"],)
    with h5py.File(manifest["weights_path"], "r") as h:
        held = []
        h.visititems(lambda name, obj: held.append(name)
                     if isinstance(obj, h5py.Dataset) else None)
    assert not [n for n in held if n.startswith("layers/")], held
    return manifest


def check_held(trainer):
    n = kd.size()
    shapes = [tuple(v.shape) for v in trainer.model.trainable_variables]
    assert shapes == [(-(-30 // n),), (-(-5 // n),), (-(-15 // n),),
                      (-(-3 // n),)], shapes


def mode_np2(root):
    a = Toy(**weights(checkpoint_dir=os.path.join(root, "wa"),
                      checkpoint_every_steps=2))
    a.fit()
    check_held(a)
    r = Toy(**settings(shard=None, checkpoint_dir=os.path.join(root, "ra")))
    r.fit()
    state, want = whole_state(a), whole_state(r)
    assert_state(state, want, 1e-9, "sharded weights vs replicated")
    if kd.rank() == 0:
        manifest = check_weight_files(os.path.join(root, "wa"), 2)
        assert manifest["epoch"] == 2 and manifest["samples"] == 0
    kd.barrier(name="test.wa_checked")
    ok("weights_trainer_like_replicated_shard_files")
    save_state(state, os.path.join(root, "wa.npz"))
    save_state(want, os.path.join(root, "ra.npz"))

    directory = os.path.join(root, "wb")
    b = Toy(**weights(checkpoint_dir=directory,
                      checkpoint_every_seconds=1e-9))
    b.stop_at = (1, 4)
    try:
        b.fit()
        raise AssertionError("StopAt did not stop the job")
    except Stop:
        pass
    if kd.rank() == 0:
        manifest = check_weight_files(directory, 2)
        assert manifest["epoch"] == 1 and 0 < manifest["samples"] <= 80, \
            manifest
    kd.barrier(name="test.wb_checked")
    resumed = Toy(**weights(checkpoint_dir=directory))
    resumed.fit()
    assert resumed.initial_epoch == 1 and resumed.initial_samples > 0
    assert_state(whole_state(resumed), state, 1e-12, "step resume")
    ok("weights_step_checkpoint_resume_equals_straight_run")


def mode_np3(root):
    wa, ra = load_state(os.path.join(root, "wa.npz")), \
        load_state(os.path.join(root, "ra.npz"))
    x, y = base.make_data(base.N, 1)
    s3 = Toy.from_checkpoint(os.path.join(root, "wa"), **weights(
        epochs=3, checkpoint_dir=os.path.join(root, "s3")))
    base.prepare(s3, x, y)
    check_held(s3)
    assert_state(whole_state(s3), wa, 0.0, "2 -> 3 sharded weights")
    r3 = Toy.from_checkpoint(os.path.join(root, "wa"), **settings(
        epochs=3, shard=None, checkpoint_dir=os.path.join(root, "r3")))
    base.prepare(r3, x, y)
    assert_state(whole_state(r3), wa, 0.0, "2 sharded -> 3 replicated")
    ok("weights_resume_2_to_3_sharded_and_replicated_exact")
    back = Toy.from_checkpoint(os.path.join(root, "ra"), **weights(
        checkpoint_dir=os.path.join(root, "unused")))
    base.prepare(back, x, y)  # each rank reads its slices of ra's file
    assert_state(whole_state(back), ra, 0.0, "replicated -> sharded")
    ok("replicated_checkpoint_resumes_sharded_weights_exact")
    s3.fit()
    r3.fit()
    s, r = whole_state(s3), whole_state(r3)
    assert_state(s, r, 1e-9, "sharded weights vs replicated at np 3")
    assert any(np.any(s[k] != wa[k]) for k in wa)  # it trained
    if kd.rank() == 0:
        check_weight_files(os.path.join(root, "s3"), 3)
    kd.barrier(name="test.s3_checked")
    ok("weights_continue_like_replicated_np3")
    save_state(s, os.path.join(root, "s3.npz"))


def mode_np1(root):
    s3 = load_state(os.path.join(root, "s3.npz"))
    x, y = base.make_data(base.N, 1)
    for shard in ("weights", None, "optimizer_state"):
        t = Toy.from_checkpoint(os.path.join(root, "s3"), **settings(
            epochs=3, shard=shard, checkpoint_dir=os.path.join(
                root, f"one_{shard}")))
        base.prepare(t, x, y)
        assert_state(whole_state(t), s3, 0.0, f"3 -> 1, shard={shard}")
    ok("weights_resume_3_to_1_any_mode_exact")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["np2", "np3", "np1"])
    parser.add_argument("root")
    args = parser.parse_args()
    kd.init()
    {"np2": mode_np2, "np3": mode_np3, "np1": mode_np1}[args.mode](args.root)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
