"""Clients that an attacker (or an unlucky neighbour) points at a job's
listeners, for tests that check the job is unaffected."""

import os
import random
import socket
import time


def foreigner(port, stop, sent):
    """Says what an attacker without the secret would, over and over:
    PMI commands, forged hellos, re-form requests (kd_stay,
    kd_reform), joins and rejoins (kd_join, kd_joiners, kd_rejoin),
    garbage, a huge line, idle connections."""
    lines = [b"cmd=barrier_in\n", b"cmd=finalize\n",
             b"cmd=put kvsname=k key=card[0] value=evil\n",
             b"cmd=initack pmiid=1\n", b"cmd=initack pmiid=0\n",
             b"cmd=kd_hello rank=1 size=2\n",
             b"cmd=kd_hello rank=1 size=2 proof=00\n",
             b"cmd=kd_auth job=unnamed nonce=x\ncmd=kd_hello rank=0 size=2"
             b" proof=1234\n", b"cmd=get kvsname=k key=card[1]\n",
             b"cmd=kd_stay\n", b"cmd=kd_reform generation=1 window=1 lost=0\n",
             b"cmd=initack pmiid=0\ncmd=kd_stay\n",
             b"cmd=kd_join node=n proof=00\n", b"cmd=kd_joiners\n",
             b"cmd=kd_rejoin rank=0 generation=0 proof=00\n",
             b"cmd=kd_auth job=unnamed nonce=x\ncmd=kd_join node=n proof=0\n",
             b"cmd=kd_auth job=unnamed nonce=x\ncmd=kd_rejoin rank=1 "
             b"generation=0 proof=0\n",
             os.urandom(2048), b"x" * 100000]
    idle = []
    rng = random.Random(1)
    while not stop.is_set():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(rng.choice(lines))
            sent.append(1)
            if len(idle) < 200:
                idle.append(s)  # kept open: a connection that idles
            else:
                s.close()
        except OSError:
            pass
        time.sleep(0.005)  # a flood, but one that leaves the job some CPU
    for s in idle:
        s.close()
