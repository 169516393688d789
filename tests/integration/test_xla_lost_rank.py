"""A rank lost in the middle of an XLA-compiled TensorFlow step: the other
rank, blocked in a collective's custom call, ends by the heartbeat within
its bound with the lost-rank line and exit status 75, never hangs
(tests/workers/xla_lost_rank_worker.py; processes started with torchrun's
variables, so no launcher ends the job for it)."""

import re

import pytest

from tests.support.helpers import free_port
from tests.support.helpers import start_processes
from tests.support.helpers import torchrun_env
from tests.support.helpers import worker_cmd

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

HEARTBEAT_S = 3
# From the kill to rank 0's end: a dead peer's heartbeat connection closes
# at once; the rest is slack for a loaded machine.
BOUND_S = HEARTBEAT_S + 12


@pytest.mark.timeout(240)
def test_a_rank_lost_inside_a_compiled_step_ends_the_other():
    port, ended = free_port(), []
    envs = [torchrun_env(r, 2, port,
                         KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_S,
                         KERASDIST_HEARTBEAT_INTERVAL_SECONDS=0.5)
            for r in range(2)]
    [(rc0, out0), (rc1, out1)] = start_processes(
        worker_cmd("xla_lost_rank_worker.py"), envs, timeout=180,
        ended=ended)
    assert rc1 == -9 and "rank 1 kills itself" in out1, out1[-3000:]
    assert "rank 0: compiled step 2 done" in out0, out0[-3000:]
    assert "completed without rank 1" not in out0, out0[-3000:]
    assert rc0 == 75, out0[-3000:]
    assert re.search(r"kerasdist: rank 0: lost rank 1 .*; ending this rank",
                     out0), out0[-3000:]
    took = ended[0] - ended[1]
    assert 0 <= took < BOUND_S, (took, out0[-3000:])
