"""One rank of a small job started as a platform would (torchrun's
variables, no mpiexec): kd.init(), then stays in the job for HOLD_S
seconds (so that a second job meets it while it runs), then one allreduce
of its job's tag (TAG: a number per job, so that a job of both shows in
the sum). Prints "ok TAG RANK SIZE SUM". No framework."""

import os
import time

import numpy as np

import kerasdist as kd
from tests.support.collectives import allreduce

kd.init()
time.sleep(float(os.environ.get("HOLD_S", "0")))
tag = float(os.environ["TAG"])
got = allreduce(np.full(2, tag, np.float32), name="tag", op=kd.Sum)
os.write(1, f"ok {os.environ['TAG']} {kd.rank()} {kd.size()} "
            f"{got[0]:g}\n".encode())
