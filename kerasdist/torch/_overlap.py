"""Gradient buckets on PyTorch: each bucket's allreduce starts while
backprop is still running, as PyTorch DDP's reducer does.

`GradientBuckets` puts a post-accumulate-grad hook on every parameter
(`torch.Tensor.register_post_accumulate_grad_hook`). Its buckets, their
names and scale factors are the reduction's plan
(`kerasdist.keras.reduction.plan`, the rule every reduction follows:
backprop order, the last layer's gradients first; see `plan_for`). When
backprop has produced the last gradient of a bucket, the hook enqueues
that bucket's grouped allreduce in the core (`start_grouped_allreduce`)
and returns: the core communicates on its own thread while autograd
computes the next layers' gradients. `collect` (from the optimizer's
`apply`) waits for the buckets and returns the reduced gradients.

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
from kerasdist.keras import reduction as _reduction
from kerasdist.keras.reduction import label_members
from kerasdist.torch import collectives as _collectives


def _hook(ref, index, param):
    # Weak: a dropped optimizer's buckets stop acting at once.
    buckets = ref()
    if buckets is not None:
        buckets.ready(index, param)


def plan_for(params, name, op, predivide, bucket_bytes,
             first_bucket_bytes=_buckets.DEFAULT_FIRST_BUCKET_BYTES,
             labels=None):
    """The reduction's plan (`kerasdist.keras.reduction.plan`) for torch
    parameters: their sizes, one bucket kind per dtype and device, buckets
    even where there is one (each starts from its hooks)."""
    sizes = [p.numel() * p.element_size() for p in params]
    kinds = [(str(p.dtype), str(p.device)) for p in params]
    return _reduction.plan(sizes, kinds, name, op, predivide,
                           bucket_bytes=bucket_bytes, labels=labels,
                           first_bucket_bytes=first_bucket_bytes,
                           one_bucket=True)


class ParamHooks:
    """A post-accumulate-grad hook on each parameter that calls
    `self.ready(index, param)`, held weakly (a dropped owner's hooks stop
    acting at once); `remove` takes them off and `drain`s what is in
    flight. The base of GradientBuckets and the sharded optimizer's
    ShardBuckets (kerasdist/torch/_shard_overlap.py)."""

    def _hook_params(self, params):
        """Hooks every parameter of `params` (None: none for it)."""
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(_hook, ref, i))
            for i, p in enumerate(params) if p is not None]

    def remove(self):
        """Removes the hooks (and waits for what is in flight)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.drain()

    def __del__(self):
        for h in getattr(self, "_hooks", ()):
            h.remove()


class GradientBuckets(ParamHooks):
    """Hooks and in-flight allreduces for one optimizer's parameters.

    Args:
        params: the torch parameters (leaf tensors), in the variables'
            order.
        plan: the reduction's `Plan` of them (`plan_for`): buckets, names,
            timeline labels, op and scale factors.
        compression: a `kerasdist.Compression` (compress in the hook,
            decompress in `collect`).
        process_set: the core's process set id.
        inplace: reduce into the wires themselves (the `.grad` tensors,
            uncompressed), as DDP does, and have backward end only once
            its buckets have (see `_start`). Only for an average: a
            bucket that then takes the synchronous path is averaged
            again, which leaves the average as it is.

    `last_events` records the last step: ("grad", i) when parameter i's
    hook ran, ("start", k) when bucket k's allreduce was enqueued,
    ("collect", redo) when apply took the results.
    """

    def __init__(self, params, plan, compression, process_set,
                 inplace=False):
        self.params = list(params)
        self.inplace = inplace
        self.buckets = plan.buckets
        self.names = plan.names
        self._bucket_of = {}
        for k, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = k
            label_members(self.names[k], [plan.labels[i] for i in members])
        self._op = plan.op
        self._prescale, self._postscale = plan.prescale, plan.postscale
        self._compression = compression
        self._process_set = process_set
        self.events, self.last_events = [], []
        self._reset()
        self._hook_params(self.params)

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

    def start_all(self, grads):
        """Starts every bucket from `grads` (one per parameter), the
        gradients of a backward pass the hooks did not see (the step that
        installed them), as the hooks would have; `collect` follows."""
        for k, members in enumerate(self.buckets):
            for i in members:
                self._grads[i] = grads[i]
                self._versions[i] = grads[i]._version
            if all(grads[i].layout == torch.strided for i in members):
                self._start(k, in_backward=False)
            else:
                self._broken.add(k)

    def _start(self, k, in_backward=True):
        members = self.buckets[k]
        with torch.no_grad():
            wires = [self._compression.compress(self._grads[i])
                     for i in members]
        pending = _collectives.start_grouped_allreduce(
            [w for w, _ in wires], self.names[k], self._op, self._prescale,
            self._postscale, process_set=self._process_set,
            inplace=self.inplace)
        if self.inplace and in_backward:
            # The core writes into the gradients: backward returns only
            # once it is done (the engine's final callback, as DDP's),
            # so nothing done to `.grad` after backward meets its writes.
            torch.autograd.Variable._execution_engine.queue_callback(
                pending.settle)
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
