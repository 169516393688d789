"""kerasdist.torch._overlap.GradientBuckets on plain PyTorch parameters,
in one process (np=1, where the allreduce returns its input): the hooks
start each bucket as its last gradient is accumulated, `collect` returns
the buckets whose tensors are unchanged and names the others (a gradient
changed in place, a second backward pass, a missing gradient). The
multi-rank equality checks are in tests/workers/keras_backend_worker.py."""

import os
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT

CODE = r'''
import torch
import kerasdist as kd
from kerasdist import basics
from kerasdist.keras.compression import Compression
from kerasdist.torch._overlap import GradientBuckets
kd.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
params = list(net.parameters())  # w0 (48 B), b0 (12), w1 (12), b1 (4)
b = GradientBuckets(params, "t", basics.Sum, 1.0, 1.0, Compression.none, 0,
                    bucket_bytes=16)
assert b.buckets == [[3, 2], [1], [0]], b.buckets

def step(twice=False, touch=None, drop=None):
    for p in params:
        p.grad = None
    for _ in range(2 if twice else 1):
        net(torch.ones(2, 4)).sum().backward()
    if touch is not None:
        params[touch].grad.mul_(1.0)  # same values, new version
    grads = [p.grad for p in params]
    if drop is not None:
        grads[drop] = None
    out, redo = b.collect(grads)
    return grads, out, redo, b.last_events

grads, out, redo, ev = step()
assert redo == [], redo
assert all(torch.equal(o, g) for o, g in zip(out, grads))
assert [e for e in ev if e[0] == "start"] == [("start", 0), ("start", 1),
                                            ("start", 2)], ev
last_grad = max(i for i, e in enumerate(ev) if e[0] == "grad")
assert ev.index(("start", 0)) < last_grad, ev
assert step(touch=2)[2] == [2, 3]
assert step(twice=True)[2] == [0, 1, 2, 3]
_, out, redo, _ = step(drop=1)
assert redo == [1] and out[1] is None, (redo, out[1])
assert step()[2] == []
b.remove()
for p in params:
    p.grad = None
net(torch.ones(2, 4)).sum().backward()
assert b.events == [], b.events
print("OK")
'''


def test_torch_gradient_buckets_hooks_and_fallback():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True,
                         text=True, timeout=120, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert out.returncode == 0 and "OK" in out.stdout, (
        out.stdout[-3000:] + out.stderr[-3000:])
