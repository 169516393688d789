"""Attempts of a job whose hosts come and go (tests/cluster/test_faults.py,
with --max-restarts and --min-np). Every attempt checks an allreduce against
numpy at its size and prints "attempt A size S host H" on each rank.

argv: STATE_DIR
  attempt 0: the last rank writes STATE_DIR/fault0 and takes its host's
             link down; the heartbeat ends the job.
  attempt 1: rank 0 writes STATE_DIR/attempt1, waits for STATE_DIR/go (the
             test brings the link back first), then exits with code 3.
  attempt 2: finishes ("finished" on every rank).
"""

import os
import socket
import sys
import time

import numpy as np

import kerasdist as kd
from tests.support import host_faults
from tests.support.collectives import allreduce

STATE = sys.argv[1]
ATTEMPT = int(os.environ["KERASDIST_RESTART_ATTEMPT"])


def main():
    kd.init()
    rank, size = kd.rank(), kd.size()
    x = np.full(256, rank + 1, np.float64)
    total = allreduce(x, name="check", op=kd.Sum)
    np.testing.assert_array_equal(total, np.full(256, size * (size + 1) / 2))
    print(f"attempt {ATTEMPT} size {size} host {socket.gethostname()}",
          flush=True)
    if ATTEMPT == 0 and rank == size - 1:
        open(os.path.join(STATE, "fault0"), "w").close()
        host_faults.take_this_hosts_link_down()
    if ATTEMPT == 0:
        for step in range(10**6):
            allreduce(x, name="grad")
    if ATTEMPT == 1 and rank == 0:
        open(os.path.join(STATE, "attempt1"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(STATE, "go")):
            if time.monotonic() > deadline:
                sys.exit("nobody said go")
            time.sleep(0.1)
        sys.exit(3)
    allreduce(x, name="last")
    print("finished", flush=True)


if __name__ == "__main__":
    main()
