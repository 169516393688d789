"""Memory per rank of the replicated and the sharded optimizer
(`DistributedOptimizer(shard=...)`), and their step times.

    python benchmarks/memory.py [--backend tensorflow] [--sizes 1,2,4]
        [--params 100e6] [--model mlp|transformer] [--width W] [--steps 4]
        [--json FILE] [--save] [--marginal 300e6] [--optimizer sgd]

For each size N and each of replicated, shard="optimizer_state",
shard="gradients" and shard="weights" (`kd.shard_weights(model)` first;
--modes picks some), one job of N ranks (`kerasdist run -np N`) trains a
model of about --params parameters (random weights: a deep MLP of square
layers, or a stack of transformer blocks) with Adam (or plain SGD,
--optimizer sgd: no moments), batch 2 a rank, for
--steps steps. Each rank reports, as bytes per parameter:

- held: what the framework holds after training, weights + optimizer
  variables (+ the sharded optimizer's 1-D shards of the weights), counted
  from the variables' shapes;
- peak: the peak resident set while training (VmHWM, started afresh once
  the model and the optimizer are built) above the same process's
  resident set before the model was built: weights, gradients, optimizer
  state, the collectives' buffers, activations and allocator slack.

Theory (float32, Adam): replicated 4 + 4 + 8 = 16 with the gradients, 12
held; sharded 4 + 12/N held (weights, moments and the weights' shard),
plus the whole gradients while a step runs; sharded weights 16/N held
(weight, gradient and moments of each shard), plus the whole weights the
step gathers.

- with --marginal P, the marginal peak: the same job again with a model
  of about P parameters, and the peak's bytes added per parameter between
  the two sizes. The peak per parameter of one size also divides the
  process's constants (the framework's start, compiling the step, the
  allocator's pools) by the parameters; the marginal peak leaves them
  out: what a model that does not fit pays for each parameter more.
- with --save, save: the peak resident set while `kd.save_model` writes
  the trained model to a .keras file (VmHWM started afresh before it),
  above the same base: rank 0's, the writer; and whole: the job's peak,
  training's or the save's, whichever is higher (rank 0).

Step time: the median interval between batch ends after the first, the
slower rank's; compare the modes of one size (the jobs run one after the
other on a shared machine: ratios, not absolute figures). Rank 0 of each
job prints one JSON line; the driver prints the table.
"""

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("replicated", "optimizer_state", "gradients", "weights")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak():
    """Starts the peak resident set (VmHWM) afresh (Linux 4.0 on)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(keras, kind, params, width=None):
    if kind == "mlp":
        width = width or 2048
        depth = max(1, round(params / (width * (width + 1))))
        layers = [keras.Input((width,))]
        layers += [keras.layers.Dense(width, activation="relu")
                   for _ in range(depth)]
        return keras.Sequential(layers + [keras.layers.Dense(1)]), (width,)
    # The transformer's width d: a block is 12 d^2 parameters (attention
    # 4 d^2, the feed-forward 8 d^2), so at one size a wider model has
    # fewer blocks, and each block's graph costs less a parameter.
    d, seq = width or 1024, 16
    blocks = max(1, round(params / (12 * d * d)))
    x = inputs = keras.Input((seq, d))
    for _ in range(blocks):
        a = keras.layers.MultiHeadAttention(8, d // 8)(x, x)
        x = keras.layers.LayerNormalization()(x + a)
        f = keras.layers.Dense(4 * d, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(d)(f))
    out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, out), (seq, d)


def _xla_temp_bytes(model, shape):
    """On JAX, the temporaries XLA's buffer assignment gives the jitted
    train step (`memory_analysis()` of it compiled, as Keras jits it: the
    state donated); printed whole on rank 0. 0 elsewhere."""
    import keras

    if keras.backend.backend() != "jax":
        return 0
    import jax

    def spec(vs):
        return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in vs]

    state = (spec(model.trainable_variables),
             spec(model.non_trainable_variables),
             spec(model.optimizer.variables), spec(model.metrics_variables))
    data = (jax.ShapeDtypeStruct((2,) + shape, "float32"),
            jax.ShapeDtypeStruct((2, 1), "float32"))
    stats = jax.jit(model.train_step, donate_argnums=0).lower(
        state, data).compile().memory_analysis()
    if os.environ.get("PMI_RANK", "0") == "0":
        print(f"XLA {stats}", file=sys.stderr, flush=True)
    return stats.temp_size_in_bytes


def join_cgroup(prefix):
    """Moves this rank into `prefix`_r<rank> (benchmarks/memory_cap.py's
    per-rank memory cap), before it imports anything large."""
    rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))
    with open(os.path.join(f"{prefix}_r{rank}", "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def rank_main(args):
    import keras
    import numpy as np

    import kerasdist as kd

    kd.init()
    if args.in_flight_mib is not None:
        from kerasdist.keras.sharding import step as _shard_step
        _shard_step.IN_FLIGHT_BYTES = args.in_flight_mib << 20
    # Before the base: on JAX and PyTorch it imports TensorFlow where it is
    # installed (about 400 MiB), which is not the model's.
    keras.utils.set_random_seed(0)
    base = _rss_bytes()
    shard = None if args.mode == "replicated" else args.mode
    if shard == "weights":
        # Built sharded, one layer whole at a time.
        with kd.shard_weights():
            model, shape = _model(keras, args.model, args.params,
                                  args.width)
        kd.shard_weights(model)
    else:
        model, shape = _model(keras, args.model, args.params, args.width)
    inner = (keras.optimizers.SGD(1e-4) if args.optimizer == "sgd"
             else keras.optimizers.Adam(1e-4))
    opt = kd.DistributedOptimizer(inner, shard=shard)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    batch = 2
    rng = np.random.default_rng(kd.rank())
    x = rng.normal(size=(batch * args.steps,) + shape).astype("float32")
    y = rng.normal(size=(batch * args.steps, 1)).astype("float32")
    ends = []
    # The peak of training: the weights' initial values, made before they
    # are copied into the variables, are not part of it.
    gc.collect()
    built = _rss_bytes()
    _reset_peak()

    first = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            if b == 1:
                # Step 1 traces and compiles the step: its peak apart.
                first.append(_peak_bytes())
                _reset_peak()

        def on_train_batch_end(self, b, logs=None):
            ends.append(time.perf_counter())

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0),
                         Clock()])
    # Whole parameters (a sharded weight's shard counts as its weight).
    n_params = sum(getattr(v, "_kerasdist_weight", None).numel
                   if getattr(v, "_kerasdist_weight", None) is not None
                   else int(np.prod(v.shape))
                   for v in model.trainable_variables)
    held = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    held += sum(int(np.prod(v.shape)) * 4 for v in opt.variables)
    state = getattr(opt, "_kerasdist_shard", None)
    if state is not None and args.mode != "weights":
        held += sum(int(np.prod(s.shape)) * 4 for s in state.shadows)
    steps = np.diff(ends)
    step = float(np.median(steps)) if len(steps) else float("nan")
    trained_peak = _peak_bytes()
    later_peak = trained_peak if first else 0
    first_peak = first[0] if first else trained_peak
    trained_peak = max(first_peak, later_peak)
    xla_temp = _xla_temp_bytes(model, shape) if args.xla else 0
    save_peak = 0
    if args.save:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            gc.collect()
            _reset_peak()
            kd.save_model(model, os.path.join(tmp, "model.keras"))
            save_peak = _peak_bytes()
    mine = np.array([held / n_params, (trained_peak - base) / n_params,
                     step, (save_peak - base) / n_params,
                     (max(trained_peak, save_peak) - base) / n_params,
                     (first_peak - base) / n_params,
                     (later_peak - base) / n_params, xla_temp / n_params,
                     (built - base) / n_params],
                    "float64")
    every = np.asarray(kd.allgather(mine[None, :].astype("float32"),
                                    name="bench.memory.report"))
    if kd.rank() == 0:
        print("RESULT " + json.dumps({
            "np": kd.size(), "mode": args.mode, "params": n_params,
            "held_bytes_per_param": float(every[:, 0].max()),
            "peak_bytes_per_param": float(every[:, 1].max()),
            "step_s": float(every[:, 2].max()),
            "save_peak_bytes_per_param": float(every[0, 3]),
            "whole_peak_bytes_per_param": float(every[0, 4]),
            "step1_peak_bytes_per_param": float(every[:, 5].max()),
            "later_peak_bytes_per_param": float(every[:, 6].max()),
            "xla_temp_bytes_per_param": float(every[:, 7].max()),
            "built_bytes_per_param": float(every[:, 8].max())}),
            flush=True)


def _job(args, n, mode, params):
    """One job of `n` ranks training a model of about `params`
    parameters in `mode`: rank 0's result."""
    cmd = [sys.executable, "-m", "kerasdist.run", "-np", str(n),
           sys.executable, os.path.abspath(__file__), "--rank",
           "--mode", mode, "--model", args.model, "--params",
           str(params), "--steps", str(args.steps),
           "--optimizer", args.optimizer] + (
               ["--width", str(args.width)] if args.width else []) + (
               ["--save"] if args.save else []) + (
               ["--xla"] if args.xla else []) + (
               ["--in-flight-mib", str(args.in_flight_mib)]
               if args.in_flight_mib is not None else [])
    env = dict(os.environ, KERAS_BACKEND=args.backend,
               TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=REPO_ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    result, stderr = run_job(cmd, env, f"np={n} {mode}")
    for line in stderr.splitlines():
        if "XLA " in line:
            print(f"np={n} {mode}: {line}", flush=True)
    return result


def run_job(cmd, env, what):
    """Runs one job's launcher `cmd`; returns (the JSON of its rank 0's
    "RESULT " line, its stderr). Exits naming `what`, with the output's
    end, where the job failed or printed no result."""
    out = subprocess.run(cmd, env=env, capture_output=True,
                         text=True, timeout=3600)
    found = [l.split("RESULT ", 1)[1] for l in out.stdout.splitlines()
             if "RESULT " in l]
    if out.returncode != 0 or not found:
        sys.exit(f"{what} failed ({out.returncode}):\n"
                 + (out.stdout + out.stderr)[-3000:])
    return json.loads(found[0]), out.stderr


def _marginal(small, large):
    """The peak's bytes per parameter added between two sizes of the
    model: what a parameter more costs, without the process's constants
    (the framework's start, compiling the step, allocator pools), which
    the peak per parameter of one size divides by its parameters."""
    added = (large["peak_bytes_per_param"] * large["params"]
             - small["peak_bytes_per_param"] * small["params"])
    return added / (large["params"] - small["params"])


def drive(args):
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        for mode in args.modes.split(","):
            rows.append(_job(args, n, mode, args.params))
            print(json.dumps(rows[-1]), flush=True)
            if args.marginal:
                large = _job(args, n, mode, args.marginal)
                print(json.dumps(large), flush=True)
                rows[-1]["marginal_peak_bytes_per_param"] = _marginal(
                    rows[-1], large)
    print(f"\n{args.model}, {rows[0]['params'] / 1e6:.1f}M parameters, "
          f"Adam, {args.backend}; bytes per parameter (max over ranks)")
    print("| np | optimizer | held | theory held | peak RSS | step 1 peak |"
          " later steps' peak | peak / held | step s | step / replicated |"
          + (" save peak (rank 0) | job peak (rank 0) |" if args.save
             else "") + (f" marginal peak (to {args.marginal / 1e6:.0f}M)"
                         " | marginal / held |" if args.marginal else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + (
        "---|---|" if args.save else "") + ("---|---|" if args.marginal
                                           else ""))
    for r in rows:
        n, held = r["np"], r["held_bytes_per_param"]
        theory = {"replicated": 12.0, "weights": 16.0 / n}.get(
            r["mode"], 4 + 12.0 / n)
        ref = next((x for x in rows if x["np"] == n
                    and x["mode"] == "replicated"), r)
        print(f"| {n} | {r['mode']} | {r['held_bytes_per_param']:.2f} | "
              f"{theory:.2f} | {r['peak_bytes_per_param']:.2f} | "
              f"{r['step1_peak_bytes_per_param']:.2f} | "
              f"{r['later_peak_bytes_per_param']:.2f} | "
              f"{r['peak_bytes_per_param'] / r['held_bytes_per_param']:.2f}"
              f" | {r['step_s']:.3f} | {r['step_s'] / ref['step_s']:.2f} |"
              + (f" {r['save_peak_bytes_per_param']:.2f} | "
                 f"{r['whole_peak_bytes_per_param']:.2f} |" if args.save
                 else "")
              + (f" {r['marginal_peak_bytes_per_param']:.2f} | "
                 f"{r['marginal_peak_bytes_per_param'] / held:.2f} |"
                 if args.marginal else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="replicated")
    p.add_argument("--backend", default="tensorflow")
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--modes", default=",".join(MODES),
                   help="which of " + ", ".join(MODES))
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--marginal", type=float,
                   help="also train a model of this many parameters and "
                   "print the peak's bytes per parameter added between "
                   "the two sizes (the process's constants left out)")
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--width", type=int,
                   help="the MLP's layer width (default 2048), or the "
                   "transformer's model width d (default 1024)")
    p.add_argument("--cgroup", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="sgd: no moments, to tell the update's memory "
                   "from the step's")
    p.add_argument("--json")
    p.add_argument("--xla", action="store_true",
                   help="on JAX, also XLA's temporaries of the step")
    p.add_argument("--in-flight-mib", type=int,
                   help="the sharded optimizer's whole gradients in flight "
                   "on TensorFlow (kerasdist.keras.sharding.step."
                   "IN_FLIGHT_BYTES; default its own, 64): a large value "
                   "turns the pacing off")
    p.add_argument("--save", action="store_true",
                   help="also measure kd.save_model's peak on rank 0")
    args = p.parse_args()
    args.params = int(args.params)
    if args.marginal:
        args.marginal = int(args.marginal)
    if args.rank:
        if args.cgroup:
            join_cgroup(args.cgroup)
        rank_main(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
