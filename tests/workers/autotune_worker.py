"""Trains-like allreduce steps while rank 0's autotuner runs.

    autotune_worker.py api LOG   # start_autotune with short windows, from a
                                 # slow starting setting (5 ms cycle time)
    autotune_worker.py env       # KERASDIST_AUTOTUNE(_LOG) via maybe_start,
                                 # stopped early with stop_autotune

Every step allreduces 16 tensors (Sum) in one tf.function and checks the
results exactly, so a setting change mid-run that broke the fusion plan
would show. Ranks stop together: a Max allreduce of rank 0's "tuner done"
flag ends the loop. Rank 0 then checks that the best setting is applied and
prints "OK autotune".
"""

import csv
import os
import sys

import numpy as np
import tensorflow as tf

import kerasdist as kd
from kerasdist import autotune

COUNT, ELEMS = 16, 4096


def main():
    mode = sys.argv[1]
    kd.init()
    rank, n = kd.rank(), kd.size()
    if mode == "api":
        if rank == 0:
            # A slow start (the longest cycle time): some sample beats it,
            # so the confirmation runs, and the tuned setting must win it.
            autotune.set_tunables(67108864, 5.0, True)
        tuner = autotune.start_autotune(
            log_path=sys.argv[2], sample_seconds=0.3, min_collectives=5,
            warmup_samples=2, max_samples=6, seed=1, confirm_rounds=2)
    else:
        tuner = autotune.maybe_start()
    assert (tuner is not None) == (rank == 0), (rank, tuner)
    xs = [tf.fill([ELEMS], float(rank + i)) for i in range(COUNT)]
    want = [sum(r + i for r in range(n)) for i in range(COUNT)]

    @tf.function(autograph=False)
    def step(tensors):
        return [kd.allreduce(t, op=kd.Sum, name=f"at.{i}")
                for i, t in enumerate(tensors)]

    steps = 0
    while True:
        for got, w in zip(step(xs), want):
            assert np.all(got.numpy() == w), (steps, got.numpy()[:4], w)
        steps += 1
        done = 0.0
        if rank == 0:
            if mode == "env" and tuner.samples >= 2:
                autotune.stop_autotune()
            done = float(tuner.done.is_set())
        flag = kd.allreduce(tf.constant([done]), op=kd.Max, name="at.done")
        if flag.numpy()[0] > 0 or steps > 100000:
            break
    if rank == 0:
        assert tuner.error is None, repr(tuner.error)
        applied = autotune.get_tunables()
        assert tuner.best is not None
        assert applied == (tuner.best[0], tuner.best[1], tuner.best[2]), (
            applied, tuner.best)
        log = sys.argv[2] if mode == "api" else os.environ[
            "KERASDIST_AUTOTUNE_LOG"]
        with open(log) as f:
            rows = list(csv.DictReader(f))
        phases = [r["phase"] for r in rows]
        want_samples = 6 if mode == "api" else 2
        assert phases.count("warmup") == (2 if mode == "api" else 3), phases
        assert phases.count("sample") == want_samples, phases
        assert phases[-1] == "final", phases
        final = rows[-1]
        assert (int(final["threshold"]), float(final["cycle_ms"]),
                bool(int(final["cache"]))) == applied
        scores = [float(r["bytes_per_s"]) for r in rows
                  if r["phase"] == "sample"]
        assert all(s > 0 for s in scores), scores
        # The score kept: the best sample's, or the median of the kept
        # setting's confirmation windows.
        kept = (final["threshold"], final["cycle_ms"], final["cache"])
        confirms = [float(r["bytes_per_s"]) for r in rows
                    if r["phase"] == "confirm"
                    and (r["threshold"], r["cycle_ms"], r["cache"]) == kept]
        want_score = (float(np.median(confirms)) if "confirm" in phases
                      else max(scores))
        assert abs(float(final["best_bytes_per_s"]) - want_score) < 0.2, (
            final, want_score)
        print(f"OK autotune steps={steps} best={applied} "
              f"samples={len(scores)} confirmed={tuner.confirmed}",
              flush=True)
    else:
        print("OK autotune", flush=True)


if __name__ == "__main__":
    main()
