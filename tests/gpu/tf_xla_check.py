"""TensorFlow's XLA on a GPU through kerasdist (tests/gpu/run_on_gpu.sh runs
it with a kerasdist built with NCCL and TF's XLA kernels):

    python -m kerasdist.run -np 1 python tests/gpu/tf_xla_check.py
    KERASDIST_GPU_OPERATIONS=MPI python -m kerasdist.run -np 2 \\
        python tests/gpu/tf_xla_check.py

Checks, every rank:
- the op library has the XLA kernels for GPUs (ops/tf/xla_ffi_cuda.cc);
- inside tf.function(jit_compile=True) on the GPU, allreduce Sum and
  Average, a grouped allreduce, broadcast and the barrier lower to
  kerasdist custom calls (in the GPU's HLO) and give numpy's results;
  allgather (no CUDA handler) is refused with a TF error naming it, and a
  tf.IndexedSlices gradient through DistributedGradientTape is allreduced
  dense instead, with one warning;
- model.fit with DistributedOptimizer and jit_compile=True keeps XLA, warns
  nothing and equals one process trained on the concatenated batch (SGD,
  float32 with TF32 off, to 1e-5), every rank holding the same weights.

--allow-cpu runs the same on the CPU (the CPU's XLA kernels; the GPU-only
assertions skipped): the dry run on a machine without a GPU.
"""

import argparse
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# TF32 matmuls round at 1e-3: the equivalence needs float32 products.
tf.config.experimental.enable_tensor_float_32_execution(False)
for gpu in tf.config.list_physical_devices("GPU"):
    # Two ranks share one GPU: neither may take most of its memory.
    tf.config.experimental.set_memory_growth(gpu, True)

import keras  # noqa: E402

import kerasdist as kd  # noqa: E402

B, STEPS, TOL = 8, 10, 1e-5


def _fail(msg):
    print(f"rank {kd.rank()}: FAIL {msg}", flush=True)
    return 1


def check_collectives(device):
    from kerasdist.tensorflow import _native
    r, n = kd.rank(), kd.size()
    if device.startswith("/GPU") and not _native.xla_gpu_kernels():
        return _fail("the op library has no XLA kernels for GPUs")

    @tf.function(jit_compile=True)
    def fn(x, rank):
        kd.barrier(name="g.barrier")
        return (kd.allreduce(x, op=kd.Sum, name="g.sum"),
                kd.allreduce(x, name="g.avg"),
                kd.grouped_allreduce([x, x[:2] * rank], op=kd.Sum,
                                     name="g.group"),
                kd.broadcast(x + rank, n - 1, name="g.bcast"))

    with tf.device(device):
        x = tf.constant(np.arange(5, dtype=np.float32) + 10 * r)
        rank = tf.constant(float(r))
        hlo = fn.experimental_get_compiler_ir(x, rank)(stage="hlo")
        s, avg, group, b = fn(x, rank)
    stack = np.stack([np.arange(5, dtype=np.float32) + 10 * k
                      for k in range(n)])
    failed = 0
    for target in ("allreduce", "grouped_allreduce", "broadcast",
                   "barrier"):
        if f'custom_call_target="kerasdist_{target}"' not in hlo:
            failed |= _fail(f"no kerasdist_{target} custom call in the HLO")
    if device.startswith("/GPU") and "GPU" not in s.device:
        failed |= _fail(f"the result lives on {s.device}, not the GPU")
    for got, want, what in (
            (s, stack.sum(0), "sum"), (avg, stack.mean(0), "average"),
            (group[0], stack.sum(0), "group 0"),
            (group[1], sum(stack[k, :2] * k for k in range(n)), "group 1"),
            (b, stack[n - 1] + n - 1, "broadcast")):
        if not np.allclose(got.numpy(), want, rtol=1e-6):
            failed |= _fail(f"{what}: got {got.numpy()}, want {want}")
    if device.startswith("/GPU"):
        gather = tf.function(lambda t: kd.allgather(t, name="g.gather"),
                             jit_compile=True)
        try:
            with tf.device(device):
                gather(tf.ones([2, 1]))
            failed |= _fail("allgather inside XLA on a GPU was not refused")
        except tf.errors.UnimplementedError as e:
            if "allgather 'g.gather'" not in str(e):
                failed |= _fail(f"allgather's refusal does not name it: {e}")
    failed |= check_sparse_gradient(device)
    if not failed:
        print(f"rank {r}: OK collectives inside jit_compile on {device}",
              flush=True)
    return failed


def check_sparse_gradient(device):
    """An Embedding-like tf.IndexedSlices gradient through
    DistributedGradientTape inside XLA: on a GPU (no allgather kernel) it
    is allreduced dense with one warning; the average either way."""
    r, n = kd.rank(), kd.size()
    with tf.device(device):
        table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))

    @tf.function(jit_compile=True)
    def step(ids, scale):
        with kd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = tf.reduce_sum(tf.gather(table, ids)) * scale
        return tf.convert_to_tensor(tape.gradient(loss, table))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tf.device(device):
            got = step(tf.constant([r % 6, 5]), tf.constant(r + 1.0)).numpy()
    said = [str(w.message) for w in caught if "kerasdist" in str(w.message)]
    want = np.zeros([6, 2], np.float32)
    for k in range(n):
        for row in (k % 6, 5):
            want[row] += (k + 1.0) / n
    failed = 0
    if not np.allclose(got, want, rtol=1e-6):
        failed |= _fail(f"sparse gradient: got {got}, want {want}")
    dense = n > 1 and device.startswith("/GPU")
    if dense != any("allreduced as a dense tensor" in m for m in said):
        failed |= _fail(f"sparse gradient: warnings {said}")
    return failed


def _model():
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    model.set_weights([(rng.normal(size=w.shape) * 0.5).astype(np.float32)
                       for w in model.get_weights()])
    return model


def check_fit():
    r, n = kd.rank(), kd.size()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n * B * STEPS, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 1))).astype(np.float32)
    truth = _model()
    truth.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  jit_compile=False)
    truth.fit(x, y, batch_size=n * B, shuffle=False, verbose=0)
    mine = x.reshape(STEPS, n, B, 4)[:, r].reshape(-1, 4)
    my_y = y.reshape(STEPS, n, B, 1)[:, r].reshape(-1, 1)
    model = _model()
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.05)), loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(mine, my_y, batch_size=B, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "kerasdist" in str(w.message)]
    failed = 0
    if said or model.jit_compile is not True:
        failed |= _fail(f"XLA did not stay on: jit_compile="
                        f"{model.jit_compile}, warnings {said}")
    got = np.concatenate([w.ravel() for w in model.get_weights()])
    want = np.concatenate([w.ravel() for w in truth.get_weights()])
    if not np.allclose(got, want, rtol=TOL, atol=TOL):
        failed |= _fail(f"fit != one process: max diff "
                        f"{np.abs(got - want).max()}")
    every = kd.allgather(got[None, :], name="g.weights").numpy()
    if not all(np.array_equal(row, every[0]) for row in every):
        failed |= _fail("the ranks' weights differ")
    if not failed:
        print(f"rank {r}: OK model.fit(jit_compile=True) == one process",
              flush=True)
    return failed


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args()
    kd.init()
    gpus = tf.config.list_physical_devices("GPU")
    print(f"rank {kd.rank()}: TF {tf.__version__} on {gpus}, "
          f"nccl_built={kd.nccl_built()}", flush=True)
    if not gpus and not args.allow_cpu:
        return _fail("TensorFlow sees no GPU (tensorflow[and-cuda]?)")
    device = "/GPU:0" if gpus else "/CPU:0"
    failed = check_collectives(device)
    failed |= check_fit()
    kd.shutdown()
    return failed


if __name__ == "__main__":
    sys.exit(main())
