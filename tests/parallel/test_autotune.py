"""The autotuner on real ranks: its log, its verdict and the setting it
leaves applied follow its rule, whatever the measured speeds."""

import csv
import os
import statistics
import sys

import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.helpers import launch
from tests.support.helpers import rank_env
from tests.support.helpers import rank_lines

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

WORKER = os.path.join(REPO_ROOT, "tests", "workers", "autotune_worker.py")


def _env(**extra):
    return rank_env(drop=("KERASDIST_AUTOTUNE", "KERASDIST_AUTOTUNE_LOG"),
                    **extra)


def _ok(out, np_):
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(np_):
        assert any(l.startswith("OK autotune") for l in
                   rank_lines(out.stdout, r)), out.stdout[-4000:]


def _key(row):
    return row["threshold"], row["cycle_ms"], row["cache"]


def _score(row):
    return float(row["bytes_per_s"])


def test_start_autotune_samples_confirms_and_keeps_by_its_rule(tmp_path):
    # What the tuner measures depends on the machine; what it must do with
    # the measurements does not: those are checked here, from its log.
    log = tmp_path / "tune.csv"
    out = launch(2, [sys.executable, WORKER, "api", str(log)], timeout=240,
                 env=_env())
    _ok(out, 2)
    with open(log) as f:
        rows = list(csv.DictReader(f))
    phases = [r["phase"] for r in rows]
    assert phases[:8] == ["warmup"] * 2 + ["sample"] * 6, phases
    samples = rows[2:8]
    # The first scored sample is the setting the job started with (the
    # worker's, with the longest cycle time).
    start = ("67108864", "5.0", "1")
    assert _key(samples[0]) == start
    best = _key(max(samples, key=_score))
    if best == start:
        # Nothing beat the start: no confirmation, the start stays.
        assert phases[8:] == ["final"], phases
        kept, confirmed = start, "None"
    else:
        # Two rounds of start and best in turn; the best is kept only if
        # its median beats the start's by more than 2%.
        assert phases[8:] == ["confirm"] * 4 + ["final"], phases
        pairs = rows[8:12]
        assert [_key(r) for r in pairs] == [start, best, start, best]
        median = {k: statistics.median(_score(r) for r in pairs
                                       if _key(r) == k)
                  for k in (start, best)}
        won = median[best] > 1.02 * median[start]
        kept, confirmed = (best if won else start), str(won)
    assert _key(rows[-1]) == kept, rows[-1]
    # Rank 0 checked that the runtime runs with the final row's setting;
    # it reports the tuner's verdict.
    line = [l for l in rank_lines(out.stdout, 0) if l.startswith("OK ")]
    assert f"confirmed={confirmed}" in line[0], line


def test_env_autotune_stopped_early_by_stop_autotune(tmp_path):
    log = tmp_path / "tune_env.csv"
    out = launch(2, [sys.executable, WORKER, "env"], timeout=240,
                 env=_env(KERASDIST_AUTOTUNE=1, KERASDIST_AUTOTUNE_LOG=log))
    _ok(out, 2)
    assert log.read_text().splitlines()[0] == (
        "time,threshold,cycle_ms,cache,bytes_per_s,best_bytes_per_s,phase")
