"""Autotune on the MLP-20 (W3): does the setting it finds beat the start?

    python benchmarks/autotune_mlp.py [--rounds 5] [--steps 400]
        [--start KERASDIST_X=V ...] [--log tune.csv] [--plot tune.png]

The job starts from kerasdist's defaults, or from the settings given with
`--start` (environment variables, e.g. `--start KERASDIST_CYCLE_TIME=5`:
a user's poor choice for the tuner to correct).

1. Tuning: the MLP-20 of `keras_scaling.py` trains at np=2 under
   `model.fit` while rank 0's autotuner (`kerasdist.autotune`, default
   windows: 3 warm-up, 20 scored samples of at least 2 s) tries settings of
   the fusion threshold, cycle time and response cache. One `fit` call
   trains until the tuner is done (every 100 steps rank 0 broadcasts its
   flag and all ranks stop at the same step), so every window sees steady
   training. Its CSV (`--log`) has one row per window; the first scored
   sample is the starting setting, and the `confirm` rows are the tuner's
   own start-against-best check before it settles.
2. Check: the same MLP-20 job (as `keras_scaling.py` times it) runs with
   the starting setting and with the tuned one pinned through the environment
   (`KERASDIST_FUSION_THRESHOLD`, `KERASDIST_CYCLE_TIME`, and
   `KERASDIST_CACHE_CAPACITY=0` if the tuner turned the cache off),
   alternating, `--rounds` times. The ratio tuned / start of the total
   images/s, per round and median, is the answer; the tuner's own scores
   (bytes allreduced per second) are printed before it. When the tuner
   kept the starting setting there is nothing to check. (For scale: two
   such jobs with the same setting, run one after the other here, differ
   by up to 7%.)

Run it alone: the machine has 2 cores.
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

import keras_scaling

REPO_ROOT = keras_scaling.REPO_ROOT
CHECK = 100  # steps between checks of the tuner's flag while tuning
MAX_STEPS = 100000


def tune_worker(log_path, warmup):
    """One rank of the tuning job; rank 0 prints a RESULT line."""
    model, data = keras_scaling.setup_rank("mlp20")  # sets TF's threads first
    import keras
    import tensorflow as tf

    import kerasdist as kd

    data = data.prefetch(2)
    model.fit(data, steps_per_epoch=warmup, epochs=1, verbose=0)
    tuner = kd.autotune.start_autotune(log_path=log_path)  # None off rank 0
    steps = [0]

    # One long fit, as a training job runs; every CHECK steps rank 0 tells
    # the others whether the tuner is done, and all stop at that step.
    def check(batch, logs):
        steps[0] += 1
        if steps[0] % CHECK:
            return
        done = 1.0 if tuner is None or tuner.done.is_set() else 0.0
        flag = kd.broadcast(tf.constant([done]), root_rank=0,
                            name="autotune_mlp.done")
        if flag.numpy()[0] > 0:
            model.stop_training = True

    model.fit(data, steps_per_epoch=MAX_STEPS, epochs=1, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(
                  on_train_batch_end=check)])
    if steps[0] >= MAX_STEPS:
        raise RuntimeError(f"the autotuner did not finish in {MAX_STEPS} "
                           "steps")
    if kd.rank() == 0:
        if tuner.error is not None:
            raise RuntimeError(f"autotuner failed: {tuner.error!r}")
        threshold, cycle_ms, cache = tuner.best
        print("RESULT " + json.dumps({
            "threshold": threshold, "cycle_ms": cycle_ms, "cache": cache,
            "best_score": tuner.best_score, "samples": tuner.samples,
            "confirmed": tuner.confirmed,
            "steps": steps[0]}), flush=True)


def _tune(log_path, warmup, start_env):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **start_env)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "kerasdist.run", "-np", "2",
            sys.executable, os.path.abspath(__file__), "--worker",
            "--log", log_path, "--warmup", str(warmup)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=REPO_ROOT, timeout=1800)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"tuning job failed (exit {out.returncode}):\n"
                       f"{out.stdout[-3000:]}{out.stderr[-3000:]}")


def _pinned_env(best, start_env):
    """The environment that pins the tuned setting for a fresh job."""
    env = dict(start_env)
    env.update({"KERASDIST_FUSION_THRESHOLD": str(int(best["threshold"])),
                "KERASDIST_CYCLE_TIME": repr(float(best["cycle_ms"]))})
    if not best["cache"]:
        env["KERASDIST_CACHE_CAPACITY"] = "0"
    elif env.get("KERASDIST_CACHE_CAPACITY") == "0":
        env.pop("KERASDIST_CACHE_CAPACITY")
    return env


def _run_mlp(extra_env, steps, warmup):
    saved = {k: os.environ.get(k) for k in extra_env}
    os.environ.update(extra_env)
    try:
        return sum(keras_scaling._launch(2, "mlp20", steps, warmup)["rates"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _key(row):
    return row["threshold"], row["cycle_ms"], row["cache"]


def _summary_rows(rows):
    """(label, row) for the start (first sample) and the best sample."""
    samples = [r for r in rows if r["phase"] == "sample"]
    best = max(samples, key=lambda r: float(r["bytes_per_s"]))
    out = [("start", samples[0])]
    if _key(best) != _key(samples[0]):
        out.append(("best sample", best))
    return out


def _read_log(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _plot(path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [r for r in rows if r["phase"] == "sample"]
    xs = range(1, len(samples) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [float(r["bytes_per_s"]) / 1e9 for r in samples], "o-",
            label="sample")
    ax.plot(xs, [float(r["best_bytes_per_s"]) / 1e9 for r in samples], "k--",
            label="best so far")
    ax.axhline(float(samples[0]["bytes_per_s"]) / 1e9, color="gray",
               linewidth=0.8, label="start (sample 1)")
    confirms = [r for r in rows if r["phase"] == "confirm"]
    for label, marker in (("start", "s"), ("best sample", "^")):
        row = dict(_summary_rows(rows)).get(label)
        at = [(len(samples) + 1 + i, float(r["bytes_per_s"]) / 1e9)
              for i, r in enumerate(confirms)
              if row is not None and _key(r) == _key(row)]
        if at:
            ax.plot(*zip(*at), marker, label=f"confirmation: {label}")
    ax.set_xlabel("scored sample, then confirmation windows")
    ax.set_ylabel("GB allreduced / s (rank 0's runtime)")
    ax.set_title("autotune on the MLP-20, np=2, model.fit")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"# wrote {path}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5,
                   help="start/tuned pairs in the check (default 5)")
    p.add_argument("--steps", type=int, default=400,
                   help="timed steps per check run (default 400)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--start", action="append", default=[],
                   metavar="KERASDIST_X=V",
                   help="start from this setting instead of the default "
                   "(repeatable)")
    p.add_argument("--log", help="keep the tuner's CSV here")
    p.add_argument("--plot", help="draw the tuner's samples to this PNG")
    args = p.parse_args()
    if args.worker:
        tune_worker(args.log, args.warmup)
        return
    if args.plot:
        keras_scaling._check_matplotlib()
    start_env = {}
    for item in args.start:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("KERASDIST_"):
            p.error(f"--start wants KERASDIST_NAME=VALUE, got {item!r}")
        start_env[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or os.path.join(tmp, "tune.csv")
        best = _tune(os.path.abspath(log), args.warmup, start_env)
        rows = _read_log(log)
    print("# autotune, MLP-20 np=2 under model.fit: "
          f"{best['samples']} scored samples over {best['steps']} steps; "
          "GB/s allreduced by rank 0's runtime")
    print(f"# {'setting':>12} {'threshold(B)':>13} {'cycle(ms)':>9} "
          f"{'cache':>5} {'sample':>7} {'confirm':>8}")
    for label, row in _summary_rows(rows):
        key = _key(row)
        confirms = [float(r["bytes_per_s"]) for r in rows
                    if r["phase"] == "confirm" and _key(r) == key]
        confirm = (f"{statistics.median(confirms) / 1e9:.3f}" if confirms
                   else "-")
        print(f"  {label:>12} {int(row['threshold']):>13} "
              f"{float(row['cycle_ms']):>9.3f} "
              f"{'on' if int(row['cache']) else 'off':>5} "
              f"{float(row['bytes_per_s']) / 1e9:>7.3f} {confirm:>8}")
    print("# kept: " + ("the start (the best sample scored highest)"
                        if best["confirmed"] is None else
                        "the best sample (it won the confirmation)"
                        if best["confirmed"] else
                        "the start (in the confirmation the best sample "
                        "did not beat it by more than 2%)"))
    start = _summary_rows(rows)[0][1]
    if (int(best["threshold"]), float(best["cycle_ms"]), bool(best["cache"])) \
            == (int(start["threshold"]), float(start["cycle_ms"]),
                bool(int(start["cache"]))):
        print("# check: none needed, the tuner kept the starting setting")
        if args.plot:
            _plot(args.plot, rows)
        return
    pinned = _pinned_env(best, start_env)
    start_text = " ".join(f"{k}={v}" for k, v in start_env.items())
    print("# check: fresh MLP-20 jobs (keras_scaling.py's), alternating; "
          f"start: {start_text or 'defaults'}; tuned pinned by "
          + " ".join(f"{k}={v}" for k, v in pinned.items()))
    print(f"# {'round':>5} {'start img/s':>12} {'tuned img/s':>12} "
          f"{'tuned/start':>12}")
    ratios = []
    for i in range(args.rounds):
        base = _run_mlp(start_env, args.steps, args.warmup)
        tuned = _run_mlp(pinned, args.steps, args.warmup)
        ratios.append(tuned / base)
        print(f"  {i + 1:>5} {base:>12.1f} {tuned:>12.1f} "
              f"{tuned / base:>12.3f}", flush=True)
    print(f"# median tuned/start: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    if args.plot:
        _plot(args.plot, rows)


if __name__ == "__main__":
    main()
