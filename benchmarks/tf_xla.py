"""XLA on TensorFlow: W3's model.fit and W1's allreduce, XLA on against off.

    python benchmarks/tf_xla.py [--rounds 5] [--models cnn,mlp20]
        [--steps-cnn 20] [--steps-mlp 100] [--sizes 4K,16M] [--quick]

W3 (the models, data and optimizer of benchmarks/keras_scaling.py: batch
64 per rank, 1024 random images per rank, SGD momentum, one intra- and one
inter-op thread per process), one launch per model and size:

- np=1: kerasdist's `DistributedOptimizer` with `jit_compile=True` and
  with `jit_compile=False`, and plain Keras (the unwrapped optimizer) with
  each, four models in one process;
- np=2: kerasdist with `jit_compile=True` and `False`.

Inside a launch the systems take turns, one `model.fit` of --steps-* steps
each per round, the first system rotating; every system is warmed up
(traced, compiled) before the first round. A round's figure is images/s
per rank over its steps (timed between batch ends, the slowest rank's at
np=2); the table shows the median over the rounds with its range, and
the ratio to the reference system of the same round (kerasdist without
XLA) as a median with its range. `same` says every rank ended with the
same weights (np=2).

W1 at np=2: one float32 Sum allreduce of each --sizes through
`tf.function(jit_compile=True)` (row `tf.function XLA`: the XLA custom
call) against today's `tf.function` (the TF op), each call timed alone
after a barrier, the two alternating round by round, in the nccl-tests
table of allreduce.py (`ratio` = time / the `tf.function` one's; #wrong
checks every result).

--quick: one round, 3 steps, 5 calls (a check that the script runs, not a
measurement; about 5 minutes on 2 loaded cores, mostly TF starting and
compiling). Run it alone: the machine has 2 cores.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import _common

HERE = os.path.dirname(os.path.abspath(__file__))
W3_SYSTEMS = {1: ("kerasdist", "kerasdist XLA", "plain", "plain XLA"),
              2: ("kerasdist", "kerasdist XLA")}
REFERENCE = "kerasdist"
W1_REFERENCE = "tf.function"


class _Barrier:
    """`comm.Barrier()` for _common.timed, through kerasdist (no mpi4py)."""

    def __init__(self, kd):
        self._kd, self._count = kd, 0

    def Barrier(self):
        self._count += 1
        self._kd.barrier(name=f"bench.barrier.{self._count}")


def _slowest(kd, values, name):
    """The per-entry maximum over ranks (every rank gets the same)."""
    import numpy as np
    return np.asarray(kd.allreduce(np.asarray(values, np.float64),
                                   op=kd.Max, name=name)).tolist()


def w3_worker(model_name, steps, warmup, rounds):
    """One rank of a W3 launch: every system of this size, alternating."""
    import keras_scaling as ks
    import numpy as np

    ks._threads("tensorflow")
    import keras
    import tensorflow as tf

    import kerasdist as kd

    kd.init()
    rng = np.random.default_rng(kd.rank())
    x = rng.random((1024, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(1024,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        ks.BATCH).prefetch(2)
    models = {}
    for system in W3_SYSTEMS[kd.size()]:
        keras.utils.set_random_seed(0)
        model = ks._build(model_name)
        sgd = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(
            optimizer=(sgd if system.startswith("plain")
                       else kd.DistributedOptimizer(sgd)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=system.endswith("XLA"))
        kd.broadcast_variables(model.variables, root_rank=0)
        ks._timed_fit(model, data, 1, warmup)  # traced and compiled here
        models[system] = model
    names = list(models)
    rates = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(ks._timed_fit(models[name], data, steps, 1))
    out = {"model": model_name, "np": kd.size(), "rates": {}, "same": {},
           "xla": {}}
    for k, name in enumerate(names):
        # The slowest rank's rate: the job's pace.
        per_rank = [-v for v in _slowest(kd, [-v for v in rates[name]],
                                         f"bench.rates.{k}")]
        out["rates"][name] = per_rank
        out["xla"][name] = bool(models[name].jit_compile)
        mine = np.concatenate([w.ravel() for w in models[name].get_weights()])
        every = np.asarray(kd.allgather(mine[None, :],
                                        name=f"bench.weights.{k}"))
        out["same"][name] = all(np.array_equal(row, every[0])
                                for row in every)
    if kd.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def w1_worker(sizes, rounds, calls):
    """One rank of the W1 launch: each size through both functions."""
    import numpy as np

    _common.quiet_tf()
    tf = _common.tf_single_thread()
    import kerasdist as kd

    kd.init()
    rank, n = kd.rank(), kd.size()
    comm = _Barrier(kd)
    rows = []
    for nbytes in sizes:
        x = tf.constant(np.full(nbytes // 4, rank + 1, np.float32))
        want = np.float32(n * (n + 1) // 2)
        last = {}
        systems = {}
        for label, jit in ((W1_REFERENCE, False),
                           ("tf.function XLA", True)):
            fn = tf.function(
                lambda t, _name=f"w1.{nbytes}.{jit}": kd.allreduce(
                    t, op=kd.Sum, name=_name),
                jit_compile=jit)

            def call(fn=fn, label=label):
                last[label] = fn(x)
            systems[label] = call
        wrong = {}
        for label, call in systems.items():
            call()
            wrong[label] = int(np.count_nonzero(last[label].numpy() != want))
        samples = _common.alternate(systems, rounds, calls, comm)
        for k, label in enumerate(systems):
            samples[label] = _slowest(kd, samples[label],
                                      f"bench.w1.{nbytes}.{k}")
            wrong[label] = int(_slowest(kd, [wrong[label]],
                                        f"bench.w1.wrong.{nbytes}.{k}")[0])
        rows.append({"nbytes": nbytes, "samples": samples, "wrong": wrong})
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _launch(np_, argv):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        [_common.REPO_ROOT, HERE, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "kerasdist.run", "-np", str(np_),
           sys.executable, os.path.abspath(__file__), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                         cwd=_common.REPO_ROOT, timeout=3600)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"np={np_} {' '.join(argv)} failed (exit "
                       f"{out.returncode}):\n{out.stdout[-3000:]}"
                       f"{out.stderr[-3000:]}")


def _spread(values, fmt):
    """'median (min-max)'."""
    return (f"{fmt.format(_common.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})")


def _print_w3(results):
    print("# W3 on TensorFlow: images/s per rank (slowest rank), median "
          "(range) over the rounds; ratio = images/s / kerasdist's without "
          "XLA in the same round, median (range)")
    print(f"#{'model':>6} {'np':>3} {'system':>14} {'xla':>5} "
          f"{'img/s per rank':>22} {'ms/step':>8} {'ratio':>20} {'same':>5}")
    for res in results:
        ref = res["rates"][REFERENCE]
        for name, rates in res["rates"].items():
            ratios = [a / b for a, b in zip(rates, ref)]
            ms = 1e3 * 64 / _common.median(rates)
            print(f" {res['model']:>6} {res['np']:>3} {name:>14} "
                  f"{str(res['xla'][name]):>5} {_spread(rates, '{:.0f}'):>22} "
                  f"{ms:>8.1f} {_spread(ratios, '{:.2f}'):>20} "
                  f"{str(res['same'][name]):>5}", flush=True)


def _print_w1(rows, rounds):
    print(f"# W1 allreduce float32 Sum at np=2 through tf.function with and "
          f"without jit_compile, median of per-call times (slowest rank) "
          f"over {rounds} alternating rounds; ratio = time / "
          f"{W1_REFERENCE}'s")
    print(_common.TABLE_HEAD)
    factor = _common.busbw_factor("allreduce", 2)
    for row in rows:
        base = _common.median(row["samples"][W1_REFERENCE])
        for label, samples in row["samples"].items():
            sec = _common.median(samples)
            print(_common.table_row(row["nbytes"], row["nbytes"] // 4,
                                    "float", label, sec, factor,
                                    row["wrong"][label], sec / base),
                  flush=True)


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", choices=("w1", "w3"), help=argparse.SUPPRESS)
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5,
                   help="alternating rounds in each launch (default 5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps per W3 system before the rounds")
    p.add_argument("--models", default="cnn,mlp20",
                   help="comma-separated: cnn, mlp20")
    p.add_argument("--steps-cnn", type=int, default=20)
    p.add_argument("--steps-mlp", type=int, default=100)
    p.add_argument("--sizes", default="4K,16M",
                   help="W1 sizes in bytes (K/M suffixes); empty: no W1")
    p.add_argument("--nps", default="1,2", help="W3 sizes (default 1,2)")
    p.add_argument("--quick", action="store_true",
                   help="one round, 3 steps, few calls: proves the script "
                   "runs, measures nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = 1, 1
        args.steps_cnn = args.steps_mlp = 3
    return args


def main():
    args = _parse()
    sizes = [_common.parse_size(s) for s in args.sizes.split(",") if s]
    if args.worker == "w3":
        return w3_worker(args.model, args.steps, args.warmup, args.rounds)
    if args.worker == "w1":
        return w1_worker(sizes, args.rounds, args.calls)
    start = time.time()
    results = []
    for model in args.models.split(","):
        if model not in ("cnn", "mlp20"):
            raise SystemExit(f"--models: unknown {model!r}; use cnn, mlp20")
        steps = args.steps_cnn if model == "cnn" else args.steps_mlp
        for np_ in (int(v) for v in args.nps.split(",")):
            if np_ not in W3_SYSTEMS:
                raise SystemExit(f"--nps: {np_} is not 1 or 2")
            results.append(_launch(np_, [
                "--worker", "w3", "--model", model, "--steps", str(steps),
                "--warmup", str(args.warmup), "--rounds", str(args.rounds)]))
    if results:
        _print_w3(results)
    if sizes:
        calls = 5 if args.quick else 40
        rows = _launch(2, ["--worker", "w1", "--sizes", args.sizes,
                           "--rounds", str(args.rounds), "--calls",
                           str(calls)])
        _print_w1(rows, args.rounds)
    print(f"# {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
