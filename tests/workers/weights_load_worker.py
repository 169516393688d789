"""Loading and saving sharded weights (`kd.shard_weights`,
`DistributedOptimizer(shard="weights")`) under `kerasdist run -np N`; one
job per size, each reading the files the job before wrote (ROOT shared):

    KERAS_BACKEND=jax python -m kerasdist.run -np 2 python \
        tests/workers/weights_load_worker.py np2 ROOT
    (then -np 3 ... np3 ROOT, then -np 1 ... np1 ROOT)

np2  A plain Keras model trained one epoch on one process (no kerasdist),
     written by rank 0: ROOT/plain.keras and ROOT/plain.weights.h5.
     A sharded fit of the same epoch, `kd.save_model` to
     ROOT/sharded2.keras, `kd.load_model(shard="weights")` and a second
     epoch: the weights equal one process's two epochs on the
     concatenated batches, and the load read each rank's slices only.
     `model.load_weights` of the plain `.weights.h5` into a sharded model
     reads slices and gives plain Keras' weights exactly.
     `kd.save_model` of an 8-layer Dense(1024) model raises no rank's
     peak resident set by a third of its whole weights and moments.
np3  Both .keras files load sharded at 3 ranks (slices only): the weights
     and iterations saved, exactly; a further epoch equals one process
     continuing from the file on the concatenated batches.
np1  Both load replicated (`kd.load_model(path)`) and sharded at one rank:
     exactly the saved weights; a further epoch equals plain Keras'.
     load_model(shard="weights") refuses a .weights.h5 file and
     root_rank, each with one line saying what to do.

Prints `OK <check>` per passed check, `DONE` at the end; a failed check
raises. Truths: plain Keras on one process (keras.models.load_model, fit
on the concatenated batches), the h5py reads counted at h5py's own
Dataset methods.
"""

import argparse
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402

B = 4        # per-rank batch
ROWS = 96    # rows an epoch: 12 steps at np 2, 8 at np 3, 24 at np 1
ATOL = 1e-5
EXACT = 0.0


def data(epoch):
    rng = np.random.default_rng(10 + epoch)
    x = rng.normal(size=(ROWS, 16)).astype("float32")
    y = (np.tanh(x[:, :4]).sum(axis=1, keepdims=True)).astype("float32")
    return x, y


def my_part(a, n, r):
    g = a.reshape(-1, n, B, *a.shape[1:])
    return g[:, r].reshape(-1, *a.shape[1:])


def make_model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)),
                             keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def adam():
    return keras.optimizers.Adam(0.01)


def plain_epoch(model, epoch, n):
    """One process's epoch on the concatenated batches of n ranks."""
    x, y = data(epoch)
    model.fit(x, y, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
    return model


def my_epoch(model, epoch):
    x, y = data(epoch)
    n, r = kd.size(), kd.rank()
    model.fit(my_part(x, n, r), my_part(y, n, r), batch_size=B, epochs=1,
              shuffle=False, verbose=0)
    return model


def close(got, truth, what, atol=ATOL):
    got, truth = list(got), list(truth)
    assert len(got) == len(truth), (what, len(got), len(truth))
    for g, t in zip(got, truth):
        g = np.asarray(g, np.float64)
        t = np.asarray(t, np.float64)
        assert g.shape == t.shape, (what, g.shape, t.shape)
        diff = float(np.max(np.abs(g - t))) if g.size else 0.0
        assert diff <= atol, f"{what}: max abs diff {diff} > {atol}"


class Reads:
    """Elements h5py reads from each dataset (by its name), counted at
    h5py's own Dataset.__getitem__ and read_direct."""

    def __init__(self):
        self.count = {}
        self.shape = {}

    def __enter__(self):
        reads = self
        self._get = h5py.Dataset.__getitem__
        self._direct = h5py.Dataset.read_direct
        get, direct = self._get, self._direct

        def getitem(ds, *args, **kwargs):
            out = get(ds, *args, **kwargs)
            reads.note(ds, np.size(out))
            return out

        def read_direct(ds, dest, *args, **kwargs):
            out = direct(ds, dest, *args, **kwargs)
            reads.note(ds, np.size(dest))
            return out

        h5py.Dataset.__getitem__ = getitem
        h5py.Dataset.read_direct = read_direct
        return self

    def note(self, ds, n):
        self.count[ds.name] = self.count.get(ds.name, 0) + int(n)
        self.shape[ds.name] = tuple(ds.shape)

    def __exit__(self, *exc):
        h5py.Dataset.__getitem__ = self._get
        h5py.Dataset.read_direct = self._direct
        return False

    def assert_sliced(self, n, what):
        """Every weight and slot read, each by this rank's slice: at most
        its shard's elements plus one row either side."""
        layers = [k for k in self.count if "/layers/" in k]
        slots = [k for k in self.count if "/optimizer/" in k]
        assert len(layers) == 6, (what, sorted(self.count))
        for name, count in self.count.items():
            shape = self.shape[name]
            numel = math.prod(shape)
            if numel < n:
                continue
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            limit = math.ceil(numel / n) + 2 * row
            assert count <= limit and (n == 1 or count < numel), (
                f"{what}: {name} of {numel} elements: {count} read "
                f"(a rank's slice is at most {limit})")
        return len(layers), len(slots)


def ok(name):
    print(f"OK {name}", flush=True)


def sharded_load(path, what):
    with Reads() as reads:
        model = kd.load_model(path, shard="weights")
    layers, slots = reads.assert_sliced(kd.size(), what)
    assert all(len(v.shape) == 1 for v in model.trainable_variables)
    return model, slots


def iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def mode_np2(root):
    n = kd.size()
    plain_keras = os.path.join(root, "plain.keras")
    plain_h5 = os.path.join(root, "plain.weights.h5")
    sharded_keras = os.path.join(root, "sharded2.keras")
    # Every rank builds the same models in the same order (a sharded
    # weight's collectives are named by its path); rank 0 writes.
    plain = make_model()
    plain.compile(adam(), "mse")
    plain_epoch(plain, 0, n)
    if kd.rank() == 0:
        plain.save(plain_keras)
        plain.save_weights(plain_h5)
    kd.barrier()

    # Uninterrupted, one process: epochs 0 and 1 on the global batches.
    truth = make_model()
    truth.compile(adam(), "mse")
    plain_epoch(truth, 0, n)
    after_one = truth.get_weights()
    plain_epoch(truth, 1, n)

    m = kd.shard_weights(make_model())
    m.compile(kd.DistributedOptimizer(adam(), shard="weights"), "mse")
    my_epoch(m, 0)
    close(m.get_weights(), after_one, "sharded first epoch")
    kd.save_model(m, sharded_keras)
    kd.barrier()
    loaded, slots = sharded_load(sharded_keras, "np2 load")
    assert slots >= 12, slots  # Adam's two moments of six weights
    assert iterations(loaded) == ROWS // (n * B), iterations(loaded)
    close(loaded.get_weights(), m.get_weights(), "loaded", EXACT)
    my_epoch(loaded, 1)
    close(loaded.get_weights(), truth.get_weights(),
          "save, load, second epoch == uninterrupted")
    ok("save_load_sharded_continues_like_one_process")

    fresh = kd.shard_weights(make_model(seed=9))
    with Reads() as reads:
        fresh.load_weights(plain_h5)
    reads.assert_sliced(n, "load_weights")
    wanted = keras.models.load_model(plain_keras).get_weights()
    close(fresh.get_weights(), wanted, "load_weights of plain", EXACT)
    ok("load_weights_reads_slices")

    # kd.save_model streams: each whole weight (and slot) is gathered as
    # it is written to the file and freed, so no rank holds the whole
    # model, or the file, at once (Keras would otherwise build the file's
    # weights in memory first). The save's peak rise, against the whole
    # weights and Adam moments (96 MiB): about 10-20 MiB streamed, over
    # 100 MiB in memory.
    keras.utils.set_random_seed(1)
    big = kd.shard_weights(keras.Sequential(
        [keras.Input((1024,))] + [keras.layers.Dense(1024, use_bias=False)
                                  for _ in range(8)]))
    big.compile(kd.DistributedOptimizer(adam(), shard="weights"), "mse")
    x = np.zeros((2 * B, 1024), "float32")
    big.fit(x, x, batch_size=B, epochs=1, verbose=0)
    whole = 3 * 4 * 8 * 1024 * 1024  # weights, two moments, float32
    rise = save_peak_rise(big, os.path.join(root, "big.keras"))
    assert rise < whole // 3, (rise >> 20, "MiB of", whole >> 20)
    ok("save_streams_the_weights")


def save_peak_rise(model, path):
    """kd.save_model's peak resident set above the one before it, bytes
    (the kernel's high-water mark, reset first)."""
    import gc

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {key} in /proc/self/status")

    gc.collect()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident set now
    kd.save_model(model, path)
    return status("VmHWM") - before


def continue_from(path, what, n):
    """The file loaded by plain Keras, an epoch on one process (truth),
    against kd.load_model(shard="weights") and a sharded epoch."""
    truth = keras.models.load_model(path)
    saved, steps = truth.get_weights(), iterations(truth)
    plain_epoch(truth, 1, n)
    loaded, _ = sharded_load(path, what)
    close(loaded.get_weights(), saved, f"{what}: loaded", EXACT)
    assert iterations(loaded) == steps, (iterations(loaded), steps)
    my_epoch(loaded, 1)
    close(loaded.get_weights(), truth.get_weights(), f"{what}: an epoch")


def mode_np3(root):
    n = kd.size()
    continue_from(os.path.join(root, "plain.keras"), "plain at np 3", n)
    ok("plain_keras_file_loads_sharded_np3")
    continue_from(os.path.join(root, "sharded2.keras"), "np 2 at np 3", n)
    ok("sharded_np2_file_loads_sharded_np3")


def mode_np1(root):
    for name in ("plain.keras", "sharded2.keras"):
        path = os.path.join(root, name)
        truth = keras.models.load_model(path)
        saved = truth.get_weights()
        plain_epoch(truth, 1, 1)
        replicated = kd.load_model(path)
        close(replicated.get_weights(), saved, f"{name} replicated", EXACT)
        my_epoch(replicated, 1)
        close(replicated.get_weights(), truth.get_weights(),
              f"{name}: replicated epoch")
        continue_from(path, f"{name} sharded at np 1", 1)
    ok("files_load_replicated_and_sharded_np1")

    def refused(make, words):
        try:
            make()
        except ValueError as e:
            assert all(w in str(e) for w in words), (words, e)
        else:
            raise AssertionError(f"accepted: {words}")

    plain = os.path.join(root, "plain.keras")
    refused(lambda: kd.load_model(os.path.join(root, "plain.weights.h5"),
                                  shard="weights"),
            ["shard='weights'", ".keras", "model.load_weights(path)"])
    refused(lambda: kd.load_model(plain, shard="weights", root_rank=0),
            ["root_rank", "whole file"])
    ok("load_model_shard_weights_refusals")


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
