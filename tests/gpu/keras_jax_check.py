"""Keras on JAX on a GPU through kerasdist (tests/gpu/run_on_gpu.sh runs it
with a kerasdist built with NCCL and JAX's CUDA handlers):

    python -m kerasdist.run -np 1 python tests/gpu/keras_jax_check.py --bench
    KERASDIST_GPU_OPERATIONS=MPI python -m kerasdist.run -np 2 \\
        python tests/gpu/keras_jax_check.py

Checks, every rank:
- the arrays live on the GPU, and kerasdist.jax's collectives run inside
  jax.jit on them (the CUDA FFI handlers of ops/jax/ffi_cuda.cc): allreduce
  Sum/Average, a grouped allreduce, broadcast, against numpy;
- model.fit with kerasdist.DistributedOptimizer (Keras' jitted JAX step)
  equals one process trained on the concatenated batch (SGD with momentum,
  Adam; float32 with full-precision matmuls, to 1e-5), and every rank holds
  the same weights.
With --bench (np=1, NCCL) also: an nccl-tests style table of float32
allreduce from 1 MiB to 256 MiB, kerasdist.jax.allreduce inside jax.jit next
to cupy's NCCL allreduce of the same device buffers, and model.fit's step
time with DistributedOptimizer against plain Keras (at np=1 nothing is
communicated: the wrapper's overhead).

--allow-cpu runs the same code on JAX's CPU devices (no cupy column): the
dry run that prepares the check on a machine without a GPU.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
# Two ranks share one GPU: no process may take most of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

# TF32 matmuls (JAX's GPU default) round at 1e-3: the equivalence needs
# float32 products.
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402
import kerasdist.jax as kj  # noqa: E402

B, STEPS, ATOL = 8, 10, 1e-5


def _fail(msg):
    print(f"rank {kd.rank()}: FAIL {msg}", flush=True)
    return 1


def check_placement(allow_cpu):
    platform = jax.devices()[0].platform
    print(f"rank {kd.rank()}: JAX {jax.__version__} on {jax.devices()}, "
          f"keras {keras.__version__}, nccl_built={kd.nccl_built()}",
          flush=True)
    if platform != "gpu" and not allow_cpu:
        raise AssertionError(f"JAX runs on {platform}, not on a GPU")
    return platform


def check_collectives():
    """Inside jax.jit, on device arrays, against numpy."""
    r, n = kd.rank(), kd.size()
    x = jnp.arange(1000, dtype=jnp.float32) + r

    @jax.jit
    def step(x):
        total = kj.allreduce(x, op=kj.Sum, name="gpu.sum")
        mean = kj.allreduce(x, op=kj.Average, name="gpu.avg",
                            prescale_factor=2.0, postscale_factor=0.5)
        a, b = kj.grouped_allreduce([x, 2 * x], op=kj.Sum, name="gpu.group")
        root = kj.broadcast(x, n - 1, name="gpu.bcast")
        return total, mean, a, b, root

    base = np.arange(1000, dtype=np.float64)
    want_sum = n * base + n * (n - 1) / 2
    got = [np.asarray(v) for v in step(x)]
    np.testing.assert_allclose(got[0], want_sum, rtol=1e-6)
    np.testing.assert_allclose(got[1], want_sum / n, rtol=1e-6)
    np.testing.assert_allclose(got[2], want_sum, rtol=1e-6)
    np.testing.assert_allclose(got[3], 2 * want_sum, rtol=1e-6)
    np.testing.assert_array_equal(got[4], base + n - 1)
    print(f"rank {r}: OK collectives in jax.jit on "
          f"{step(x)[0].devices()}", flush=True)


def _data():
    rng = np.random.default_rng(0)
    n = kd.size() * B * STEPS
    x = rng.normal(size=(n, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1))).astype("float32")
    return x, y


def _mine(a):
    g = a.reshape(STEPS, kd.size(), B, *a.shape[1:])
    return g[:, kd.rank()].reshape(STEPS * B, *a.shape[1:])


def _model():
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    model.set_weights([(rng.normal(size=w.shape) * 0.3).astype("float32")
                       for w in model.get_weights()])
    return model


def _fit(opt, x, y, batch):
    model = _model()
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return np.concatenate([w.ravel() for w in model.get_weights()])


def check_fit():
    x, y = _data()
    for label, make in (
            ("sgd_momentum", lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
            ("adam", lambda: keras.optimizers.Adam(0.01))):
        truth = _fit(make(), x, y, kd.size() * B)
        got = _fit(kd.DistributedOptimizer(make()), _mine(x), _mine(y), B)
        diff = float(np.max(np.abs(got - truth)))
        if diff > ATOL:
            raise AssertionError(f"fit {label}: max diff {diff} > {ATOL}")
        every = np.asarray(kj.allgather(jnp.asarray(got)[None],
                                        name=f"gpu.fit.{label}"))
        if not all(np.array_equal(row, every[0]) for row in every):
            raise AssertionError(f"fit {label}: ranks differ")
        print(f"rank {kd.rank()}: OK fit {label} (max diff {diff:.1e})",
              flush=True)


def _busbw(algbw, n):
    return algbw * 2 * (n - 1) / n  # nccl-tests' allreduce bus bandwidth


def _cupy_nccl():
    try:
        import cupy
        from cupy.cuda import nccl
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        return cupy, nccl, comm
    except Exception as e:  # noqa: BLE001 - report, the table goes on
        print(f"# cupy's NCCL unavailable ({type(e).__name__}: {e})")
        return None, None, None


def _time(fn, iters):
    fn()  # warm-up (and compile)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_allreduce(iters):
    cupy, nccl, comm = _cupy_nccl()
    print("#\n# float32 allreduce (sum) inside jax.jit on device arrays, "
          f"np={kd.size()}, KERASDIST_GPU_OPERATIONS="
          f"{os.environ.get('KERASDIST_GPU_OPERATIONS', 'NCCL')}; raw: "
          "cupy.cuda.nccl on the same buffers")
    print(f"# {'size(B)':>10} {'count':>10} {'type':>6} | kerasdist.jax "
          f"{'time(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | "
          f"raw nccl {'time(us)':>9} {'algbw':>7} {'#wrong':>6}")
    wrong_total = 0
    for mib in (1, 4, 16, 64, 256):
        nbytes = mib << 20
        count = nbytes // 4
        # Integers below 2**24: exact in float32, so the check is exact.
        x = ((jnp.arange(count, dtype=jnp.int32) % 251)
             + kd.rank()).astype(jnp.float32)
        f = jax.jit(lambda a, mib=mib: kj.allreduce(a, op=kj.Sum,
                                                    name=f"bench.{mib}"))
        out = [None]

        def ours():
            out[0] = f(x)
            out[0].block_until_ready()

        its = iters if mib < 64 else max(3, iters // 4)
        t = _time(ours, its)
        want = kd.size() * (np.arange(count) % 251) + kd.size() * (
            kd.size() - 1) / 2
        wrong = int(np.count_nonzero(np.asarray(out[0]) != want))
        raw_t, raw_wrong = float("nan"), 0
        if comm is not None:
            src = cupy.from_dlpack(x)  # the same device buffer, no copy
            dst = cupy.empty_like(src)
            stream = cupy.cuda.Stream(non_blocking=True)

            def raw():
                comm.allReduce(src.data.ptr, dst.data.ptr, count,
                               nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
                stream.synchronize()

            raw_t = _time(raw, its)
            raw_wrong = int(cupy.count_nonzero(dst != src).get())
        alg = nbytes / t / 1e9
        raw_alg = nbytes / raw_t / 1e9
        print(f"  {nbytes:>10} {count:>10} {'float':>6} | kerasdist.jax "
              f"{t * 1e6:>9.1f} {alg:>7.2f} {_busbw(alg, kd.size()):>7.2f} "
              f"{wrong:>6} | raw nccl {raw_t * 1e6:>9.1f} {raw_alg:>7.2f} "
              f"{raw_wrong:>6}", flush=True)
        wrong_total += wrong + raw_wrong
    return wrong_total


def bench_step(steps):
    """model.fit's time per step at np=1: DistributedOptimizer (nothing to
    communicate) against the plain optimizer, alternating, medians."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 256)).astype("float32")
    y = rng.integers(0, 10, size=(64 * steps,))
    times = {"plain": [], "kerasdist": []}
    for _ in range(3):
        for system in times:
            model = keras.Sequential(
                [keras.Input((256,))]
                + [keras.layers.Dense(256, activation="relu")
                   for _ in range(8)] + [keras.layers.Dense(10)])
            opt = keras.optimizers.SGD(0.01, momentum=0.9)
            if system == "kerasdist":
                opt = kd.DistributedOptimizer(opt)
            model.compile(opt, keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
            model.fit(x[:128], y[:128], batch_size=64, verbose=0)  # compile
            t0 = time.perf_counter()
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
            times[system].append((time.perf_counter() - t0) / steps)
    plain = float(np.median(times["plain"]))
    ours = float(np.median(times["kerasdist"]))
    print(f"# model.fit MLP 8x256, batch 64, {steps} steps, np=1, medians "
          f"of 3 alternating runs: plain {plain * 1e3:.3f} ms/step, "
          f"DistributedOptimizer {ours * 1e3:.3f} ms/step "
          f"(ratio {ours / plain:.3f})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on JAX's CPU devices when there is no GPU")
    args = p.parse_args()
    kd.init()
    t0 = time.perf_counter()
    try:
        check_placement(args.allow_cpu)
        check_collectives()
        check_fit()
        wrong = 0
        if args.bench and kd.size() == 1:
            wrong = bench_allreduce(args.iters)
            bench_step(args.steps)
        if wrong:
            return _fail(f"{wrong} wrong elements in the bandwidth table")
    except Exception as e:  # noqa: BLE001 - one line per failure, exit 1
        return _fail(f"{type(e).__name__}: {e}")
    print(f"rank {kd.rank()}/{kd.size()}: Keras-on-JAX GPU check OK in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
