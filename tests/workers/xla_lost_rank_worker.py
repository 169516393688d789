"""A rank lost while the other is inside a collective of an XLA-compiled
TensorFlow function (tests/integration/test_xla_lost_rank.py), started with
torchrun's variables (no launcher to end the job for it): rank 1 runs
STEPS_BEFORE compiled allreduces with rank 0 and SIGKILLs itself; rank 0
goes on calling the compiled function, whose custom call is then waiting
in the core for a rank that is gone. Rank 0 must end by the heartbeat with
its one line, not hang inside XLA."""

import os
import signal

import tensorflow as tf

import kerasdist as kd

STEPS_BEFORE = 3

kd.init()
rank = kd.rank()


@tf.function(jit_compile=True)
def step(x):
    return kd.allreduce(x * 1.0, op=kd.Sum, name="lost.sum")


x = tf.fill([1024], float(rank + 1))
# The function is compiled: its allreduce is a kerasdist custom call.
hlo = step.experimental_get_compiler_ir(x)(stage="hlo")
assert "kerasdist" in hlo, hlo[:2000]
for i in range(STEPS_BEFORE):
    got = step(x).numpy()
    assert (got == 3.0).all(), got[:4]
    print(f"rank {rank}: compiled step {i} done", flush=True)
if rank == 1:
    print("rank 1 kills itself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
while True:  # rank 0: the next compiled step never completes
    step(x)
    print("rank 0: a compiled step completed without rank 1", flush=True)
