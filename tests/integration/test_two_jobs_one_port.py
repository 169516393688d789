"""Two real jobs on one coordinator's port, started as platforms start
them (torchrun's variables, no mpiexec), never form a job of both: with
the same id or none (`TORCHELASTIC_RUN_ID=none`, torchrun's default
outside --standalone, counts as none), every process of both ends with a
line naming the port and what to do, whichever starts first and in
whichever order their ranks arrive, while a job runs or while it forms.
A second job with an id of its own is refused and the first goes on.

Each job's ranks stay in the job a few seconds after kd.init() (the second
job meets the first while it runs), then allreduce their job's tag: a
mixed job would show in the sum. No framework; every launch has a timeout
that kills the process trees.
"""

import os
import sys

import pytest

from tests.support.helpers import WORKERS
from tests.support.helpers import free_port
from tests.support.helpers import start_processes
from tests.support.helpers import torchrun_env

pytestmark = pytest.mark.parallel

WORKER = [sys.executable, os.path.join(WORKERS, "two_jobs_worker.py")]
SECRET = "one-secret-two-launches-0123456789"
# Start offsets (s) of job 1's ranks 0, 1 and job 2's ranks 0, 1.
ORDERS = {
    # Job 1 forms and runs; job 2 comes later, rank 0 first.
    "one_then_two": [0, 0, 2, 2],
    # Job 2's rank 1 comes first and joins job 1's forming server; job 1's
    # own rank 1 comes last.
    "crossed": [0, 3, 1.5, 1],
    # Job 2's rank 1, then its rank 0, while job 1 runs.
    "two_rank1_late": [0, 0, 2.5, 1.5],
}


def _env(port, tag, rank, extra):
    env = torchrun_env(rank, 2, port, TAG=tag, HOLD_S="4",
                       KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS="30", **extra)
    env["PYTHONPATH"] = WORKERS + os.pathsep + env["PYTHONPATH"]
    return env


def _run(order, extra1, extra2):
    port = free_port()
    envs = [_env(port, 1, 0, extra1), _env(port, 1, 1, extra1),
            _env(port, 2, 0, extra2), _env(port, 2, 1, extra2)]
    return port, start_processes(WORKER, envs, delays=ORDERS[order],
                                 timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order,ids", [
    ("one_then_two", {}),
    ("crossed", {}),
    ("two_rank1_late", {"TORCHELASTIC_RUN_ID": "none"}),
    ("crossed", {"TORCHELASTIC_RUN_ID": "none"}),
    ("one_then_two", {"KERASDIST_JOB_ID": "same-name"}),
    ("crossed", {"KERASDIST_JOB_SECRET": SECRET}),
])
def test_two_launches_of_one_id_on_one_port_both_end(order, ids):
    port, results = _run(order, ids, ids)
    for i, (rc, out) in enumerate(results):
        who = f"job {1 + i // 2} rank {i % 2} (rc {rc})"
        assert rc != 0, f"{who}:\n{out}"
        assert "ok " not in out, f"{who}:\n{out}"
        assert f"coordinator's port {port}" in out, f"{who}:\n{out}"
        assert "give each job a port of its own (MASTER_PORT)" in out, \
            f"{who}:\n{out}"
        said = [line for line in out.splitlines()
                if f"coordinator's port {port}" in line and
                "unauthenticated" not in line]
        assert len(said) == 1, f"{who}:\n{out}"
        # What rank 0's notice says of two jobs on one port is true.
        if "unauthenticated" in out:
            assert "kept apart by their name" not in out, out
            assert "is refused with it, never merged" in out, out


@pytest.mark.timeout(120)
def test_a_second_job_with_its_own_id_is_refused_and_the_first_goes_on():
    port, results = _run("crossed", {"KERASDIST_JOB_ID": "first"},
                         {"KERASDIST_JOB_ID": "second"})
    for r in (0, 1):
        rc, out = results[r]
        assert rc == 0 and f"ok 1 {r} 2 2\n" in out, f"rank {r}:\n{out}"
    for rc, out in results[2:]:
        assert rc != 0 and "ok " not in out, out
        assert (f"the coordinator's port {port} serves another job (job "
                f"first), not this one (second)") in out, out
