"""Worker for tests/cluster/test_intel_mpi.py: one job that says which MPI
library it runs on, checks every collective against numpy and trains a
small Keras model, whatever MPI kerasdist was built against.

    site_mpi_worker.py [--collectives] [--fit OUT.npz]

With SITE_MPI_BUILD=DIR it imports DIR/kerasdist (another build). Prints
`MPI_LIB <path of the libmpi loaded> | <MPI_Get_library_version's first
line>`, `PACKAGE <the directory kerasdist was imported from>`,
`TOPO rank=R size=N local_rank=L local_size=S host=H` and `CPUS <the CPUs
it may run on after kd.init(), comma-separated>`.
--collectives: every check of core_collectives_worker.py in its "hosts"
mode (the single-node paths allowed, and taken only when all ranks share
one host; `OK ...` lines and `DONE`). Needs no TensorFlow.
--fit OUT.npz: 6 steps of SGD on a float64 Dense model with
kd.DistributedOptimizer, checked against the same fit in one process on the
whole data (rtol 1e-9, see keras_optimizer_worker.py); rank 0 writes the
final weights to OUT.npz (arrays w0, w1, ...) so that runs on two MPIs can
be compared bit for bit. Prints `OK fit`.
"""

import ctypes
import os
import runpy
import socket
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# A directory holding another build's kerasdist package, to import first
# (the launcher puts the source tree first on PYTHONPATH).
if os.environ.get("SITE_MPI_BUILD"):
    sys.path.insert(0, os.environ["SITE_MPI_BUILD"])


def say(line):
    """Writes LINE and its newline in one write(2): a launcher that forwards
    each rank's output as it comes (Intel's and MPICH's hydra) interleaves
    ranks between writes, and print() writes the newline apart when
    stdout is unbuffered."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def loaded_libmpi():
    """The path of the libmpi this process mapped (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libmpi.so"):
                return path
    return None


def library_version(path):
    buf = ctypes.create_string_buffer(8192)
    n = ctypes.c_int()
    ctypes.CDLL(path).MPI_Get_library_version(buf, ctypes.byref(n))
    return buf.value.decode(errors="replace").strip().splitlines()[0]


def main(argv):
    collectives = "--collectives" in argv
    out = argv[argv.index("--fit") + 1] if "--fit" in argv else None
    if collectives:
        # Defines the checks and calls kd.init() the way "hosts" mode does.
        sys.argv = [os.path.join(HERE, "core_collectives_worker.py"),
                    "hosts"]
        runpy.run_path(sys.argv[0])
    import kerasdist as kd
    if not collectives:
        kd.init()
    lib = loaded_libmpi()
    say(f"MPI_LIB {lib} | {library_version(lib)}")
    say(f"PACKAGE {os.path.dirname(os.path.dirname(kd.__file__))}")
    say(f"TOPO rank={kd.rank()} size={kd.size()} "
        f"local_rank={kd.local_rank()} local_size={kd.local_size()} "
        f"host={socket.gethostname()}")
    say("CPUS " + ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    if collectives:
        from tests.support import checks
        checks.main(rank=kd.rank(), argv=[])
    if out is not None:
        fit(kd, out)
    kd.shutdown()


def fit(kd, out):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    tf.get_logger().setLevel("ERROR")
    keras.backend.set_floatx("float64")
    rank, size, batch, steps = kd.rank(), kd.size(), 4, 6
    rng = np.random.default_rng(0)
    x = rng.normal(size=(size * batch * steps, 4))
    y = x @ rng.normal(size=(4, 1)) + 0.1 * rng.normal(size=(len(x), 1))

    def model():
        m = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1)])
        init = np.random.default_rng(1)
        m.set_weights([init.normal(size=w.shape) * 0.5
                       for w in m.get_weights()])
        return m

    def train(m, opt, xs, ys, b):
        m.compile(optimizer=opt, loss="mse")
        m.fit(xs, ys, batch_size=b, epochs=1, shuffle=False, verbose=0)
        return m.get_weights()

    def mine(a):  # rank r's rows of every global batch
        g = a.reshape(steps, size, batch, *a.shape[1:])
        return g[:, rank].reshape(steps * batch, *a.shape[1:])

    truth = train(model(), keras.optimizers.SGD(0.1), x, y, size * batch)
    got = train(model(), kd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                mine(x), mine(y), batch)
    flat = np.concatenate([w.ravel() for w in got])
    want = np.concatenate([w.ravel() for w in truth])
    if not np.allclose(flat, want, rtol=1e-9, atol=1e-12):
        raise AssertionError(f"fit: max abs diff {np.abs(flat - want).max()}")
    start = np.concatenate([w.ravel() for w in model().get_weights()])
    if np.allclose(flat, start):
        raise AssertionError("fit: the weights did not move")
    every = kd.allgather(tf.constant(flat[None, :]), name="fit.same").numpy()
    if not all(np.array_equal(e, every[0]) for e in every):
        raise AssertionError("fit: the ranks' weights differ")
    if rank == 0:
        np.savez(out, **{f"w{i}": w for i, w in enumerate(got)})
    print("OK fit", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
