"""kerasdist under whichever MPI it was built against (the mpich wheel, Open
MPI, ...) and that MPI's launcher: one launch, many checks, at any -np >= 2.

    kerasdist run -np 2 -H a:1,b:1 python tests/workers/openmpi_worker.py

Prints `MPI <vendor> <loaded library>` (the build record's vendor and
MPI_Get_library_version of the libmpi loaded), then `OK <check>` for:
the collectives (allreduce sum/average/min/max, allgather of uneven rows,
broadcast, alltoall, reducescatter, barrier) against numpy, and a Keras
`model.fit` on the JAX backend with kerasdist.DistributedOptimizer against
plain Keras on one process over the global batch; then `WEIGHTS <hex>`
(the fitted weights' bytes, float32: equal across MPIs, since 2 ranks' sum
is exact whatever the order) and `DONE`. A failed check raises.
"""

import hashlib
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
import kerasdist.jax as kdj  # noqa: E402
from kerasdist._core import site_mpi  # noqa: E402

kd.init()
R, N = kd.rank(), kd.size()
assert N >= 2, f"run with -np 2 or more (got {N})"
assert N == int(os.environ.get("OMPI_COMM_WORLD_SIZE") or
                os.environ.get("PMI_SIZE") or
                os.environ.get("SLURM_STEP_NUM_TASKS") or N)
print(f"MPI {site_mpi.record().get('vendor')} "
      f"{kd.build_info().get('mpi_library', '?')}", flush=True)


def np_of(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def ok(name):
    print(f"OK {name}", flush=True)


# ---- collectives against numpy ----------------------------------------------
def mine(r, n=1000):
    return (r * 1000 + np.arange(n)).astype(np.float32)


every = [mine(r) for r in range(N)]
for op, truth in ((kdj.Sum, np.sum(every, 0)),
                  (kdj.Average, np.mean(every, 0)),
                  (kdj.Min, np.min(every, 0)), (kdj.Max, np.max(every, 0))):
    got = np_of(kdj.allreduce(mine(R), op=op, name=f"site.ar.{int(op)}"))
    np.testing.assert_allclose(got, truth, rtol=1e-6)
ok("allreduce")

rows = np.full((R + 1, 3), R, np.float32)  # rank r gives r + 1 rows
got = np_of(kdj.allgather(rows, name="site.ag"))
np.testing.assert_array_equal(got, np.concatenate(
    [np.full((r + 1, 3), r, np.float32) for r in range(N)]))
ok("allgather")

got = np_of(kdj.broadcast(mine(R, 17), root_rank=N - 1, name="site.bc"))
np.testing.assert_array_equal(got, mine(N - 1, 17))
ok("broadcast")

# Rank r sends row block j (j + 1 rows of value 100 r + j) to rank j.
send = np.concatenate([np.full((j + 1, 2), 100 * R + j, np.float32)
                       for j in range(N)])
got = np_of(kdj.alltoall(send, splits=np.arange(1, N + 1),
                         name="site.a2a")[0])
np.testing.assert_array_equal(got, np.concatenate(
    [np.full((R + 1, 2), 100 * r + R, np.float32) for r in range(N)]))
ok("alltoall")

# 2N rows on every rank; rank r keeps rows 2r, 2r + 1 of the sum.
total = np.sum([mine(r, 2 * N) for r in range(N)], 0).reshape(2 * N, 1)
got = np_of(kdj.reducescatter(mine(R, 2 * N).reshape(2 * N, 1), op=kdj.Sum,
                              name="site.rs"))
np.testing.assert_array_equal(got, total[2 * R:2 * R + 2])
ok("reducescatter")

kdj.barrier()
ok("barrier")

# ---- Keras fit against one process ------------------------------------------
B, STEPS = 4, 3
rng = np.random.default_rng(0)
x = rng.normal(size=(N * B * STEPS, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1))).astype("float32")


def model_and_weights():
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    w = np.random.default_rng(1)
    model.set_weights([(w.normal(size=v.shape) * 0.5).astype("float32")
                       for v in model.get_weights()])
    return model


def fit(model, opt, xs, ys, batch):
    model.compile(optimizer=opt, loss="mse")
    model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


part = lambda a: a.reshape(STEPS, N, B, -1)[:, R].reshape(STEPS * B, -1)  # noqa: E731
got = fit(model_and_weights(), kd.DistributedOptimizer(
    keras.optimizers.SGD(0.1)), part(x), part(y), B)
truth = fit(model_and_weights(), keras.optimizers.SGD(0.1), x, y, N * B)
for g, t in zip(got, truth):
    np.testing.assert_allclose(g, t, atol=1e-5)
flat = np.concatenate([np.ravel(w).astype(np.float32) for w in got])
same = np_of(kdj.allgather(flat.reshape(1, -1), name="site.weights"))
assert (same == same[0]).all(), "the ranks' weights differ"
ok("fit")
print(f"WEIGHTS {hashlib.sha256(flat.tobytes()).hexdigest()[:16]}",
      flush=True)
print("DONE", flush=True)
