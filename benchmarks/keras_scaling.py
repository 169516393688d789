"""W3 (BENCHMARKS.md): model.fit images/s at np=1 and np=2 with kerasdist.

    python benchmarks/keras_scaling.py [--rounds 3] [--models cnn,mlp20]
        [--steps-cnn 40] [--steps-mlp 200] [--ceiling] [--mwms] [--np4]
        [--plot w3.png]

Runs each model under `python -m kerasdist.run -np N` (N = 1, 2), batch 64
per rank, 1024 random in-memory images per rank (repeated), SGD(0.01,
momentum 0.9), sparse CE from logits, no metrics, jit_compile=False, one
intra- and one inter-op thread per process. Steps are timed by wall clock
between batch ends after a warm-up. After training every rank's weights are
allgathered and compared with rank 0's (`same` column).

Every system runs once per round, in a fixed order, for --rounds rounds
(this machine's speed drifts by 20% over minutes, so an efficiency compares
runs of the same round). Prints a table: model, system, np, median img/s per
rank and total, median scaling efficiency (total at np=2 / (2 x the
kerasdist np=1 run of the same round)) and its range over the rounds.

With `--ceiling` a `no-comm` row runs np=2 with each rank training alone
(plain optimizer, no allreduce, weights not expected equal): the
efficiency two processes reach on this machine's shared cores and memory
with no communication at all, the ceiling for any synchronous system; a
`sync-only` row does the same but
the ranks meet once per step (a 4-byte allreduce after each batch): what
waiting for the slower rank alone costs on this machine. With `--mwms`
the same models also run under tf.distribute.MultiWorkerMirroredStrategy
with 2 local workers (RING collectives over loopback, TF_CONFIG, each
worker feeding its own 1024 images, auto-sharding off, 64 per replica).
Keras 3.15.1 needs two workarounds for MWMS in `model.fit` (keras#20585,
tensorflow#72388); neither touches the gradient path:
  1. `_maybe_symbolic_build` reduces the whole PerReplica batch to build
     the model: we build from the first local replica's batch instead;
  2. the train step's per-replica logs (a scalar loss) are reduced along
     axis 0, which fails: we reduce the logs as "first" (the loss logged is
     the first replica's; gradients are still all-reduced by the strategy).
With `--np4` kerasdist also runs at np=4, more ranks than a 2-core
machine has cores (the launcher then binds nobody): reported in a table of
its own, efficiency against 4 x the np=1 run. `--plot` draws total images/s
against the number of ranks for each model, with the ideal-linear line (np
x the np=1 median) and MWMS's point (matplotlib needed).
`--tcp` adds a `tcp` row: np=2 under `kerasdist run --nproc-per-node 2`
with KERASDIST_TRANSPORT=tcp (the transport recovery in place re-forms
across hosts) against the `kerasdist` row's MPI.
`--backends tensorflow,jax,torch` runs every row on each Keras backend
(KERAS_BACKEND for the ranks; default tensorflow alone), in the same
rounds: TensorFlow feeds a tf.data pipeline and compiles without XLA, JAX
feeds numpy batches to its jitted step (the collectives are XLA custom
calls), PyTorch feeds numpy batches to its eager step; one compute thread
per process on each (XLA_FLAGS / torch.set_num_threads). `--overhead` adds a
`plain` row at np=1 (the plain Keras optimizer, no DistributedOptimizer)
and a table of the per-step overhead of kerasdist at np=1 against it, per
backend and model. `--shard` adds rows at np=2 with
`DistributedOptimizer(shard="optimizer_state")`, `shard="gradients"` and
`shard="weights"` (after `kd.shard_weights(model)`; `shard-weights-units`
with `min_unit_bytes` 1 MiB: the smaller layers gather together at the
model's call) (the sharded optimizer's step time against the replicated
`kerasdist` row of the same round).
Run it alone: the machine has 2 cores.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64


def _build(name):
    import keras

    if name == "cnn":
        layers = [keras.Input((32, 32, 3))]
        for filters in (32, 64, 128):
            layers += [keras.layers.Conv2D(filters, 3, padding="same",
                                           activation="relu"),
                       keras.layers.Conv2D(filters, 3, padding="same",
                                           activation="relu"),
                       keras.layers.MaxPooling2D()]
        layers += [keras.layers.Flatten(),
                   keras.layers.Dense(384, activation="relu"),
                   keras.layers.Dense(10)]
    else:  # mlp20
        layers = [keras.Input((32, 32, 3)), keras.layers.Flatten()]
        layers += [keras.layers.Dense(256, activation="relu")
                   for _ in range(20)]
        layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def _timed_fit(model, data, steps, warmup, meet=None):
    """Trains warmup + steps batches; images/s over the steps after warmup,
    timed between batch ends. `meet`, if given, runs after every batch."""
    import keras

    ends = []

    def batch_end(batch, logs):
        if meet is not None:
            meet()
        ends.append(time.perf_counter())

    timer = keras.callbacks.LambdaCallback(on_train_batch_end=batch_end)
    model.fit(data, steps_per_epoch=warmup + steps, epochs=1,
              verbose=0, callbacks=[timer])
    return steps * BATCH / (ends[-1] - ends[warmup - 1])


def _threads(backend):
    """One compute thread of each kind on this rank (before the model)."""
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif backend == "torch":
        import torch
        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
    # JAX: XLA_FLAGS, set by _launch before the process starts.


def _batches(x, y):
    """Numpy batches of (x, y), repeated forever (JAX, PyTorch)."""
    while True:
        for i in range(0, len(x) - BATCH + 1, BATCH):
            yield x[i:i + BATCH], y[i:i + BATCH]


def setup_rank(model_name, communicate=True, backend="tensorflow",
               shard=None):
    """This rank's W3 job: one thread of each kind, kerasdist started,
    1024 random images of its own (repeated, batched), the model compiled
    with SGD momentum (inside DistributedOptimizer if `communicate`) and
    rank 0's weights broadcast. Returns (model, data): a tf.data pipeline
    on TensorFlow, a generator of numpy batches otherwise."""
    import numpy as np

    _threads(backend)
    import keras

    import kerasdist as kd

    kd.init()
    rng = np.random.default_rng(kd.rank())
    x = rng.random((1024, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(1024,))
    if backend == "tensorflow":
        import tensorflow as tf
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            BATCH).prefetch(2)
    else:
        data = _batches(x, y)
    model = _build(model_name)
    if shard in ("weights", "weights-units"):
        # -units: the layers under 1 MiB whole gather together at the
        # model's call (shard_weights' min_unit_bytes).
        kd.shard_weights(model, min_unit_bytes=(
            1 << 20 if shard == "weights-units" else 0))
        shard = "weights"
    sgd = keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(
        optimizer=(kd.DistributedOptimizer(sgd, shard=shard) if communicate
                   else sgd),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # W3 compares TF without XLA (benchmarks/tf_xla.py has it on);
        # JAX's step is jitted with the collectives inside.
        jit_compile=backend == "jax")
    kd.broadcast_variables(model.variables, root_rank=0)
    return model, data


def worker(model_name, steps, warmup, communicate=True, meet=False,
           backend="tensorflow", shard=None):
    """One rank: train, time, check weights; rank 0 prints a RESULT line.

    With communicate=False each rank trains on its own with the plain
    optimizer (no allreduce): the np=2 ceiling of this machine, i.e. what
    two processes sharing its cores and memory reach with no communication
    (at np=1: plain Keras). With meet=True as well, the ranks still meet
    once per step (a 4-byte allreduce after each batch): the cost of
    waiting for the slower rank.
    """
    import numpy as np

    import kerasdist as kd

    model, data = setup_rank(model_name, communicate, backend, shard)
    import keras

    def numpy(x):
        return np.asarray(keras.ops.convert_to_numpy(x))

    one = np.ones([1], np.float32)
    img_sec = _timed_fit(
        model, data, steps, warmup,
        meet=(lambda: kd.allreduce(one, name="bench.meet")) if meet else None)

    mine = np.concatenate([w.ravel() for w in model.get_weights()])
    every = numpy(kd.allgather(mine[None, :], name="bench.weights"))
    same = all(np.array_equal(row, every[0]) for row in every)
    rates = numpy(kd.allgather(np.array([img_sec], np.float32),
                               name="bench.rates")).tolist()
    if kd.rank() == 0:
        print("RESULT " + json.dumps({
            "model": model_name, "np": kd.size(), "rates": rates,
            "params": int(model.count_params()),
            "tensors": len(model.trainable_variables), "same": same,
            "backend": keras.backend.backend()}), flush=True)


def mwms_worker(model_name, steps, warmup):
    """One MWMS worker (TF_CONFIG set by the parent); prints its RESULT."""
    import hashlib

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from keras.src.backend.tensorflow import trainer as tf_trainer

    # Workaround 2: per-step logs reduced as "first" (see the docstring).
    original_reduce = tf_trainer.reduce_per_replica

    def reduce_first(values, strategy, reduction):
        return original_reduce(values, strategy,
                               "first" if reduction == "auto" else reduction)

    tf_trainer.reduce_per_replica = reduce_first
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation
        .RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=comm)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(index)
    x = rng.random((1024, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(1024,))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    replicas = strategy.num_replicas_in_sync
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        BATCH * replicas).with_options(options)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _build(model_name)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True),
            jit_compile=False)

    # Workaround 1: build from the first local replica's batch.
    def symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0],
                    batch)
                break
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = symbolic_build
    img_sec = _timed_fit(model, data, steps, warmup)
    digest = hashlib.sha256(b"".join(
        w.tobytes() for w in model.get_weights())).hexdigest()
    print("RESULT " + json.dumps({
        "model": model_name, "index": index, "rate": img_sec,
        "digest": digest, "params": int(model.count_params()),
        "tensors": len(model.trainable_variables)}), flush=True)


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def _launch_mwms(model_name, steps, warmup, workers=2):
    hosts = [f"127.0.0.1:{p}" for p in _free_ports(workers)]
    procs = []
    for index in range(workers):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CONFIG=json.dumps(
            {"cluster": {"worker": hosts},
             "task": {"type": "worker", "index": index}}))
        argv = [sys.executable, os.path.abspath(__file__), "--worker",
                "--system", "mwms", "--model", model_name, "--steps",
                str(steps), "--warmup", str(warmup)]
        procs.append(subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, cwd=REPO_ROOT))
    results, logs = [], []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=900)
            logs.append(out)
            results += [json.loads(line.split("RESULT ", 1)[1])
                        for line in out.splitlines() if "RESULT " in line]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    if len(results) != workers:
        raise RuntimeError(f"MWMS {model_name} failed:\n"
                           + "\n".join(log[-3000:] for log in logs))
    return {"model": model_name, "np": workers,
            "rates": [r["rate"] for r in results],
            "params": results[0]["params"], "tensors": results[0]["tensors"],
            "same": len({r["digest"] for r in results}) == 1}


def _launch(np_, model_name, steps, warmup, system="kerasdist",
            backend="tensorflow"):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND=backend)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if backend == "jax":  # one XLA CPU thread, as TF's one intra-op thread
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_"
                            "thread_eigen=false intra_op_parallelism_"
                            "threads=1").strip()
    ranks = ["-np", str(np_)]
    if system == "tcp":  # node mode over the TCP transport
        env["KERASDIST_TRANSPORT"] = "tcp"
        ranks, system = ["--nproc-per-node", str(np_)], "kerasdist"
    argv = [sys.executable, "-m", "kerasdist.run", *ranks,
            sys.executable, os.path.abspath(__file__), "--worker",
            "--system", system, "--model", model_name, "--steps", str(steps),
            "--warmup", str(warmup), "--backends", backend]
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=REPO_ROOT, timeout=900)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{backend} np={np_} {model_name} failed (exit "
                       f"{out.returncode}):\n{out.stdout[-3000:]}"
                       f"{out.stderr[-3000:]}")


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="kerasdist",
                        help=argparse.SUPPRESS)
    parser.add_argument("--mwms", action="store_true",
                        help="also run MultiWorkerMirroredStrategy at np=2")
    parser.add_argument("--ceiling", action="store_true",
                        help="also run np=2 with no communication at all "
                        "(each rank trains alone): this machine's ceiling, "
                        "and with only a meeting of the ranks per step")
    parser.add_argument("--steps", type=int, default=0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps per run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of all systems, alternating; the table "
                        "shows medians (default 3)")
    parser.add_argument("--models", default="cnn,mlp20",
                        help="comma-separated: cnn, mlp20")
    parser.add_argument("--backends", default="tensorflow",
                        help="comma-separated Keras backends: tensorflow, "
                        "jax, torch (default tensorflow)")
    parser.add_argument("--overhead", action="store_true",
                        help="also run plain Keras at np=1 and print "
                        "kerasdist's per-step overhead against it")
    parser.add_argument("--shard", action="store_true",
                        help="also DistributedOptimizer(shard=...) at np=2, "
                        "each mode (rows shard-optimizer_state, "
                        "shard-gradients, shard-weights and "
                        "shard-weights-units)")
    parser.add_argument("--tcp", action="store_true",
                        help="add a `tcp` row: np=2 in node mode over the "
                        "TCP transport (KERASDIST_TRANSPORT=tcp), the "
                        "recoverable one")
    parser.add_argument("--np4", action="store_true",
                        help="also run kerasdist at np=4 (oversubscribed on "
                        "a 2-core machine), reported separately")
    parser.add_argument("--plot", help="write images/s against ranks, with "
                        "the ideal-linear line, to this PNG")
    parser.add_argument("--steps-cnn", type=int, default=40)
    parser.add_argument("--steps-mlp", type=int, default=200)
    args = parser.parse_args(argv)
    args.backends = args.backends.split(",")
    bad = set(args.backends) - {"tensorflow", "jax", "torch"}
    if bad:
        parser.error(f"--backends: unknown {sorted(bad)}; use tensorflow, "
                     "jax, torch")
    return args


def _runs(args):
    """(backend, system, np) of one round, each backend's kerasdist np=1
    first (the reference of its efficiencies)."""
    runs = []
    for backend in args.backends:
        runs += [(backend, "kerasdist", 1), (backend, "kerasdist", 2)]
        if args.overhead:
            runs.append((backend, "plain", 1))
        if args.mwms and backend == "tensorflow":
            runs.append((backend, "mwms", 2))
        if args.ceiling:
            runs += [(backend, "no-comm", 2), (backend, "sync-only", 2)]
        if args.np4:
            runs.append((backend, "kerasdist", 4))
        if args.tcp:
            runs.append((backend, "tcp", 2))
        if args.shard:
            runs += [(backend, "shard-optimizer_state", 2),
                     (backend, "shard-gradients", 2),
                     (backend, "shard-weights", 2),
                     (backend, "shard-weights-units", 2)]
    return runs


def _label(backend, system):
    """The system column: TensorFlow's rows keep their names."""
    return system if backend == "tensorflow" else f"{system}-{backend}"


def _measure(model_name, steps, runs, args):
    """Every run once per round; totals, efficiencies (against the same
    backend's kerasdist np=1 of the same round) and the last RESULT."""
    totals = {run: [] for run in runs}
    effs = {run: [] for run in runs}
    info = {}
    for _ in range(args.rounds):
        single = {}
        for backend, system, np_ in runs:
            if system == "mwms":
                r = _launch_mwms(model_name, steps, args.warmup)
            else:
                r = _launch(np_, model_name, steps, args.warmup, system,
                            backend)
            total = sum(r["rates"])
            single.setdefault(backend, total)
            run = (backend, system, np_)
            totals[run].append(total)
            effs[run].append(total / (np_ * single[backend]))
            same = info.get(run, {}).get("same", True)
            info[run] = dict(r, same=same and r["same"])
    return totals, effs, info


def _overhead_rows(model_name, runs, totals):
    """kerasdist np=1 against plain Keras np=1, per backend: the per-step
    overhead (plain img/s / kerasdist img/s - 1) of each round, medians."""
    rows = []
    for backend, system, np_ in runs:
        if system != "plain":
            continue
        ours = totals[(backend, "kerasdist", 1)]
        plain = totals[(backend, "plain", 1)]
        over = [p / o - 1 for p, o in zip(plain, ours)]
        rows.append(f"  {model_name:>6} {backend:>10} "
                    f"{statistics.median(plain):>10.1f} "
                    f"{statistics.median(ours):>10.1f} "
                    f"{100 * statistics.median(over):>+8.1f}% "
                    f"{100 * min(over):>+6.1f}..{100 * max(over):+.1f}%")
    return rows


def main():
    args = _parse()
    if args.worker:
        if args.system == "mwms":
            mwms_worker(args.model, args.steps, args.warmup)
        else:
            worker(args.model, args.steps, args.warmup,
                   communicate=args.system not in ("no-comm", "sync-only",
                                                   "plain"),
                   meet=args.system == "sync-only",
                   backend=args.backends[0],
                   shard=(args.system[len("shard-"):]
                          if args.system.startswith("shard-") else None))
        return

    print(f"# W3: model.fit, batch 64 per rank, SGD momentum; {args.rounds} "
          "round(s), systems alternating; eff = total / (np x kerasdist np=1 "
          "of the same backend and round); medians, eff range over rounds; "
          f"backends {','.join(args.backends)} (system-<backend> rows)")
    print(f"# {'model':>6} {'system':>15} {'params':>9} {'tensors':>7} "
          f"{'np':>3} {'img/s/rank':>11} {'total':>9} {'eff':>5} "
          f"{'range':>11} {'same':>5}")
    models = [m for m in (("cnn", args.steps_cnn), ("mlp20", args.steps_mlp))
              if m[0] in args.models.split(",")]
    if args.plot:
        _check_matplotlib()
    summary = {}  # (model, system, np) -> median total img/s (TensorFlow)
    separate, overhead = [], []  # rows printed after the main table
    runs = _runs(args)
    for model_name, steps in models:
        totals, effs, info = _measure(model_name, steps, runs, args)
        for run in runs:
            backend, system, np_ = run
            r = info[run]
            total = statistics.median(totals[run])
            e = effs[run]
            span = f"{min(e):.2f}-{max(e):.2f}"
            if backend == "tensorflow":
                summary[(model_name, system, np_)] = total
            row = (f"  {model_name:>6} {_label(backend, system):>15} "
                   f"{r['params']:>9} {r['tensors']:>7} {np_:>3} "
                   f"{total / np_:>11.1f} {total:>9.1f} "
                   f"{statistics.median(e):>5.2f} {span:>11} "
                   f"{str(r['same']):>5}")
            if np_ > 2:
                separate.append(row)
            else:
                print(row, flush=True)
        overhead += _overhead_rows(model_name, runs, totals)
    if separate:
        print(f"# oversubscribed: more ranks than this machine's "
              f"{os.cpu_count()} CPUs (nobody bound); eff = total / "
              "(np x kerasdist np=1 of the same round)")
        for row in separate:
            print(row, flush=True)
    if overhead:
        print("# per-step overhead at np=1: plain Keras img/s / kerasdist "
              "img/s - 1 (same backend and round); medians, range")
        print(f"# {'model':>6} {'backend':>10} {'plain':>10} "
              f"{'kerasdist':>10} {'overhead':>9} {'range':>15}")
        for row in overhead:
            print(row, flush=True)
    if args.plot and ("tensorflow" in args.backends):
        _plot(args.plot, [m for m, _ in models], summary)


def _check_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib")


def _plot(path, model_names, summary):
    """Total images/s against ranks per model, with the ideal-linear line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(model_names), squeeze=False,
                             figsize=(5 * len(model_names), 4))
    for ax, name in zip(axes[0], model_names):
        nps = sorted(n for (m, s, n) in summary
                     if m == name and s == "kerasdist")
        single = summary[(name, "kerasdist", 1)]
        ax.plot(nps, [single * n for n in nps], "k--", label="ideal linear")
        ax.plot(nps, [summary[(name, "kerasdist", n)] for n in nps], "o-",
                label="kerasdist")
        for system, marker in (("mwms", "s"), ("no-comm", "^"),
                               ("sync-only", "v")):
            if (name, system, 2) in summary:
                ax.plot([2], [summary[(name, system, 2)]], marker,
                        label=system if system != "mwms"
                        else "MultiWorkerMirroredStrategy")
        ax.set_xticks(nps)
        ax.set_xticklabels([f"{n}" + (" (oversub.)" if n > (os.cpu_count() or 1)
                                      else "") for n in nps])
        ax.set_xlabel("ranks")
        ax.set_ylabel("images/s, all ranks (median)")
        ax.set_title(f"{name}: model.fit, batch 64 per rank")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"# wrote {path}", flush=True)


if __name__ == "__main__":
    main()
