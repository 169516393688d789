"""A certain deadlock ends the job: every rank waits on collectives that no
other rank submitted (uneven data, a skipped collective). Rank 0 fails every
rank's pending collectives after KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS with
one line naming each rank's collectives and the likely cause; a rank that is
only slow (nothing pending while it computes) is left alone."""

import re
import time

import pytest

from tests.support.helpers import launch
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(180)]

BOUND_S = 5
# From the fault to the launcher's exit: the bound, up to a second for the
# once-a-second check, then the ranks' exit and the launcher's stop.
WITHIN_S = BOUND_S + 20


def _run(mode):
    out = launch(2, worker_cmd("deadlock_worker.py", mode), timeout=150,
                 env=worker_env(KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS=BOUND_S))
    return out, time.time()


def _deadlock_line(out):
    lines = [l for l in out.stdout.splitlines() if "kerasdist: deadlock:" in l]
    assert len(lines) == 1, out.stdout[-4000:]
    return lines[0]


def _assert_ended_in_time(out, ended):
    faults = [float(t) for t in re.findall(r"FAULT (\d+\.\d+)", out.stdout)]
    assert faults, out.stdout[-4000:]
    took = ended - max(faults)
    print(f"fault to exit: {took:.1f} s")
    assert BOUND_S <= took < WITHIN_S, (took, out.stdout[-4000:])


def test_uneven_shards_end_the_job_naming_each_rank():
    out, ended = _run("uneven")
    assert out.returncode != 0, out.stdout[-4000:]
    assert "FAIL" not in out.stdout, out.stdout[-4000:]
    line = _deadlock_line(out)
    # rank 0 in its second step's gradient allreduce, rank 1 at the epoch end
    assert re.search(r"rank 0 waits on \d+ \(allreduce 'DistributedOptimizer",
                     line), line
    assert ("rank 1 waits on 1 (allgather 'kerasdist.metric_average.epoch')"
            in line), line
    assert "Likely cause: uneven data" in line, line
    assert "kd.data.shard" in line and "EqualizeStepsCallback" in line, line
    # The launcher's last line, said once; the ranks that died of it say
    # where in one line each, without their tracebacks through Keras.
    assert out.stdout.rstrip("\n").splitlines()[-1] == line, \
        out.stdout[-4000:]
    assert line.startswith("kerasdist: deadlock:"), line
    assert out.stdout.count("EqualizeStepsCallback") == 1, out.stdout[-4000:]
    assert "Traceback" not in out.stdout, out.stdout[-4000:]
    assert re.search(r"<stderr>:kerasdist: a collective failed at "
                     r"deadlock_worker\.py:\d+: the job is deadlocked, as "
                     r"rank 0's deadlock message says \(traceback left "
                     r"out\)\.",
                     out.stdout), out.stdout[-4000:]
    _assert_ended_in_time(out, ended)


def test_a_rank_that_skips_a_collective_ends_the_job():
    out, ended = _run("skip")
    assert out.returncode != 0, out.stdout[-4000:]
    assert "FAIL" not in out.stdout, out.stdout[-4000:]
    assert "ValueError: bad batch" in out.stdout, out.stdout[-4000:]
    line = _deadlock_line(out)
    assert "rank 0 waits on 1 (allreduce 'step.3')" in line, line
    assert "rank 1 waits on 1 (allreduce 'step.4')" in line, line
    assert "Likely cause: a rank skipped a collective" in line, line
    assert "exception it caught" in line, line
    assert out.stdout.rstrip("\n").splitlines()[-1] == line, \
        out.stdout[-4000:]
    _assert_ended_in_time(out, ended)


def test_a_slow_rank_is_not_ended():
    out, _ = _run("slow")
    assert out.returncode == 0, out.stdout[-4000:]
    assert out.stdout.count("OK slow") == 2, out.stdout[-4000:]
    assert "deadlock" not in out.stdout, out.stdout[-4000:]


def test_a_rank_waiting_in_join_is_not_ended():
    out, _ = _run("join_slow")
    assert out.returncode == 0, out.stdout[-4000:]
    assert out.stdout.count("OK join_slow") == 2, out.stdout[-4000:]
    assert "deadlock" not in out.stdout, out.stdout[-4000:]
