"""The autotuner on real ranks: CSV samples, the best setting applied."""

import csv
import os
import sys

import pytest

from tests.helpers import REPO_ROOT, launch, rank_env, rank_lines

pytestmark = pytest.mark.parallel

WORKER = os.path.join(REPO_ROOT, "tests", "workers", "autotune_worker.py")


def _env(**extra):
    return rank_env(drop=("KERASDIST_AUTOTUNE", "KERASDIST_AUTOTUNE_LOG"), **extra)


def _ok(out, np_):
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(np_):
        assert any(l.startswith("OK autotune") for l in
                   rank_lines(out.stdout, r)), out.stdout[-4000:]


def test_start_autotune_samples_and_applies_best(tmp_path):
    log = tmp_path / "tune.csv"
    out = launch(2, [sys.executable, WORKER, "api", str(log)], timeout=240,
                 env=_env())
    _ok(out, 2)
    with open(log) as f:
        rows = list(csv.DictReader(f))

    def key(r):
        return r["threshold"], r["cycle_ms"], r["cache"]

    # The first scored sample is the starting setting: the worker's slow
    # one (5 ms cycle time), which some other sample beats.
    start = key(rows[2])
    assert start == ("67108864", "5.0", "1")
    best = key(max(rows[2:8], key=lambda r: float(r["bytes_per_s"])))
    assert best != start, rows
    # Then 2 confirmation rounds, start and best alternating; the best is
    # kept if its median (of two: the mean) beats the start's by over 2%,
    # as it does here by far.
    assert [r["phase"] for r in rows] == (["warmup"] * 2 + ["sample"] * 6
                                          + ["confirm"] * 4 + ["final"])
    pairs = rows[8:12]
    assert [key(r) for r in pairs] == [start, best, start, best]
    mean = {k: sum(float(r["bytes_per_s"]) for r in pairs if key(r) == k) / 2
            for k in (start, best)}
    assert mean[best] > 1.02 * mean[start], pairs
    assert key(rows[-1]) == best


def test_env_autotune_stopped_early(tmp_path):
    log = tmp_path / "tune_env.csv"
    out = launch(2, [sys.executable, WORKER, "env"], timeout=240,
                 env=_env(KERASDIST_AUTOTUNE=1, KERASDIST_AUTOTUNE_LOG=log))
    _ok(out, 2)
    assert log.read_text().splitlines()[0] == (
        "time,threshold,cycle_ms,cache,bytes_per_s,best_bytes_per_s,phase")
