"""Gradient buckets on PyTorch: each bucket's allreduce starts while
backprop is still running, as PyTorch DDP's reducer does.

`GradientBuckets` puts a post-accumulate-grad hook on every parameter
(`torch.Tensor.register_post_accumulate_grad_hook`). The buckets are
`kerasdist.keras.buckets.variable_buckets` of the parameters (reverse order:
backprop produces the last layer's gradients first). When backprop has
produced the last gradient of a bucket, the hook enqueues that bucket's
grouped allreduce in the core (`start_grouped_allreduce`) and returns: the
core communicates on its own thread while autograd computes the next
layers' gradients. `collect` (from the optimizer's `apply`) waits for the
buckets and returns the reduced gradients.

A bucket is used only if the gradients given to `collect` are the very
tensors its hooks saw, unchanged since (same object, same `_version`).
Otherwise (a gradient missing, sparse, modified in place, produced by a
second backward pass before `apply`, or gradients that are not the
parameters' `.grad`), its allreduce is still waited for (every rank
started it) and the caller reduces its gradients synchronously, so the
result is always that of the synchronous reduction.
"""

import functools
import weakref

import torch

from kerasdist.keras import buckets as _buckets
from kerasdist.keras.reduction import label_members
from kerasdist.torch import collectives as _collectives


def _hook(ref, index, param):
    # Weak: a dropped optimizer's buckets stop acting at once.
    buckets = ref()
    if buckets is not None:
        buckets.ready(index, param)


class GradientBuckets:
    """Hooks and in-flight allreduces for one optimizer's parameters.

    Args:
        params: the torch parameters (leaf tensors), in the variables'
            order.
        name: prefix of the buckets' collective names.
        op, prescale, postscale: the allreduce's (as
            `kerasdist.keras.reduction.scales` computes them).
        compression: a `kerasdist.Compression` (compress in the hook,
            decompress in `collect`).
        process_set: the core's process set id.
        bucket_bytes, first_bucket_bytes: the caps (`kerasdist.keras.buckets`).
        labels: a name per parameter for the timeline (None: none).

    `last_events` records the last step: ("grad", i) when parameter i's
    hook ran, ("start", k) when bucket k's allreduce was enqueued,
    ("collect", redo) when apply took the results.
    """

    def __init__(self, params, name, op, prescale, postscale, compression,
                 process_set, bucket_bytes,
                 first_bucket_bytes=_buckets.DEFAULT_FIRST_BUCKET_BYTES,
                 labels=None):
        self.params = list(params)
        sizes = [p.numel() * p.element_size() for p in self.params]
        kinds = [(str(p.dtype), str(p.device)) for p in self.params]
        self.buckets = _buckets.variable_buckets(sizes, kinds, bucket_bytes,
                                                 first_bucket_bytes)
        n = len(self.buckets)
        self.names = [f"{name}.bucket{k}of{n}" for k in range(n)]
        self._bucket_of = {}
        for k, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = k
            if labels is not None:
                label_members(self.names[k], [labels[i] for i in members])
        self._op, self._prescale, self._postscale = op, prescale, postscale
        self._compression = compression
        self._process_set = process_set
        self.events, self.last_events = [], []
        self._reset()
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(_hook, ref, i))
            for i, p in enumerate(self.params)]

    def _reset(self):
        self._grads = {}      # index -> gradient seen by its hook
        self._versions = {}   # index -> its _version then
        self._left = [len(b) for b in self.buckets]
        self._started = {}    # bucket -> (PendingAllreduce, contexts)
        self._broken = set()  # buckets that must take the fallback

    def matches(self, params):
        """True if `params` are this object's parameters, in order."""
        return len(params) == len(self.params) and all(
            a is b for a, b in zip(params, self.params))

    def remove(self):
        """Removes the hooks (and waits for what is in flight)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.drain()

    def __del__(self):
        for h in getattr(self, "_hooks", ()):
            h.remove()

    # ---- from autograd ------------------------------------------------------

    def ready(self, index, param):
        """The post-accumulate-grad hook of parameter `index`."""
        k = self._bucket_of[index]
        self.events.append(("grad", index))
        grad = param.grad
        if index in self._grads or k in self._started:
            # A second backward pass before apply: the bucket's data is not
            # what apply will get.
            self._broken.add(k)
            return
        if grad is None or grad.layout != torch.strided:
            self._broken.add(k)
            return
        self._grads[index] = grad
        self._versions[index] = grad._version
        self._left[k] -= 1
        if self._left[k] == 0 and k not in self._broken:
            self._start(k)

    def _start(self, k):
        members = self.buckets[k]
        with torch.no_grad():
            wires = [self._compression.compress(self._grads[i])
                     for i in members]
        pending = _collectives.start_grouped_allreduce(
            [w for w, _ in wires], self.names[k], self._op, self._prescale,
            self._postscale, process_set=self._process_set)
        # The core reads the inputs in place: the hook's versions are
        # taken after compression, which may be the gradient itself.
        for i in members:
            self._versions[i] = self._grads[i]._version
        self._started[k] = (pending, [ctx for _, ctx in wires])
        self.events.append(("start", k))

    # ---- from apply ---------------------------------------------------------

    def drain(self):
        """Waits for every started bucket and forgets the step."""
        try:
            for pending, _ in self._started.values():
                pending.wait()
        finally:
            self._reset()
            self.events = []

    def collect(self, grads):
        """(reduced, redo): `grads` (one per parameter, None kept) with the
        started buckets' results where they hold these very gradients, and
        the sorted indices of the others, which the caller reduces
        synchronously. The step's record moves to `last_events`."""
        out = list(grads)
        redo = []
        try:
            for k, members in enumerate(self.buckets):
                started = self._started.get(k)
                ok = started is not None and k not in self._broken and all(
                    grads[i] is self._grads.get(i)
                    and grads[i]._version == self._versions[i]
                    for i in members)
                reduced = started[0].wait() if started is not None else None
                if ok:
                    for i, r, ctx in zip(members, reduced, started[1]):
                        out[i] = self._compression.decompress(r, ctx)
                else:
                    redo += members
        finally:
            self._reset()
            self.events.append(("collect", tuple(sorted(redo))))
            self.last_events, self.events = self.events, []
        return out, sorted(redo)
