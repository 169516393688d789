"""The sharded optimizer's reduce-scatter during backprop, on PyTorch.

`ShardBuckets` puts a post-accumulate-grad hook on every parameter, as
`kerasdist.torch._overlap.GradientBuckets` does for the replicated
optimizer. Its buckets are the sharded layout's
(`kerasdist.keras.sharding.layout.Layout`: backprop order, one dtype a
bucket) and it reduces them as the synchronous step does
(`kerasdist.keras.sharding.step.scatter`): a gradient whose shard is
large alone, the small ones of a bucket side by side, one reducescatter
each. When backprop has produced the last gradient of a bucket, the hook
enqueues its reducescatters and returns; the core communicates on its own
thread while autograd computes the next layers' gradients. `collect`
(from the optimizer's `apply`) waits and returns this rank's shards.

With `release` (`shard="gradients"`, ZeRO-2) the hook also drops the
parameters' whole `.grad` once their bucket is enqueued, and each later
hook takes the results that have arrived, freeing their inputs: the
whole gradients never all exist at once, and after `loss.backward()` a
parameter's `.grad` is None (its gradient is in the optimizer's shard),
as with PyTorch's FSDP. `optimizer.apply` then takes the `.grad` list as
it is (None where released). Without `release` (`"optimizer_state"`)
the `.grad` tensors stay and a bucket's result is used only where
`apply` gets those very tensors, unchanged (as GradientBuckets).

Anything else falls back to the synchronous reducescatter of what
`apply` was given: a bucket none of whose hooks ran, or one not complete
(a parameter without a gradient this step), or with other gradients than
the hooks saw. A second backward pass before `apply` after the whole
gradients were released cannot be served (they are gone): one clear
error.
"""

import torch

from kerasdist._core import errors as _errors
from kerasdist.keras import reduction as _reduction
from kerasdist.keras.sharding import step as _step
from kerasdist.keras.sharding.layout import itemsize
from kerasdist.keras.sharding.step import ALONE_BYTES
from kerasdist.torch import collectives as _collectives
from kerasdist.torch._overlap import ParamHooks


def _rows(grad, numel, chunk, size):
    flat = grad.reshape(-1)
    pad = size * chunk - numel
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.reshape(size, chunk)


class ShardBuckets(ParamHooks):
    """Hooks and in-flight reducescatters for one sharded optimizer.

    Args:
        params: the torch parameters (leaf tensors), one per variable of
            the layout (None where a variable gets no hook).
        layout: the optimizer's `Layout`.
        prefix: the optimizer's name prefix (the collectives' names).
        compression: a `kerasdist.Compression`.
        op, predivide: the reduction (`kerasdist.keras.reduction.scales`).
        process_set: the core's process set id.
        release: drop each `.grad` once its bucket is enqueued.
    """

    def __init__(self, params, layout, prefix, compression, op, predivide,
                 process_set, release):
        self.params = list(params)
        self.layout = layout
        self.release = release
        # The synchronous step's names (step.scatter), for the same
        # collectives: a rank whose hooks reduced a bucket meets a rank
        # that reduces it in apply (its first step, hooks installed
        # later, a bucket one of its gradients missed).
        self._names = [prefix + n for n in layout.names]
        self._bucket_of = {i: k for k, members in enumerate(layout.buckets)
                           for i in members}
        self._op, self._prescale, self._postscale = _reduction.scales(
            op, predivide)
        self._compression = compression
        self._process_set = process_set
        self.events = []
        self._reset()
        self._hook_params(self.params)

    def _reset(self):
        self._grads = {}       # index -> the gradient its hook saw
        self._versions = {}    # index -> its _version when enqueued
        self._left = [len(b) for b in self.layout.buckets]
        self._pending = {}     # bucket -> [(members, Pending, ctx)]
        self._shards = {}      # index -> this rank's reduced shard
        self._released = set()
        self._inflight = []    # (bucket, part, input bytes), oldest first

    def drain(self):
        """Waits for every enqueued reducescatter and forgets the step. A
        failed one is forgotten too: its error reached the step already
        (from `collect`, or the hook that took it), and a recovery in
        place drops the hooks with the ranks' pending collectives
        failed."""
        try:
            for parts in self._pending.values():
                for _, pending, _ in parts:
                    if pending is not None:
                        try:
                            pending.wait()
                        except _errors.KerasdistError:
                            pass
        finally:
            self._reset()

    # ---- from autograd ------------------------------------------------------

    def ready(self, index, param):
        """The post-accumulate-grad hook of variable `index`."""
        if index in self._released:
            self.drain()
            raise RuntimeError(
                "kerasdist: a second backward pass before optimizer.apply() "
                "with DistributedOptimizer(shard=\"gradients\") on PyTorch: "
                "the first pass's gradients were reduce-scattered and their "
                "whole tensors released as backprop made them, so they "
                "cannot be summed with this pass's. Accumulate with "
                "DistributedOptimizer(..., backward_passes_per_step=N), or "
                "use shard=\"optimizer_state\", which keeps .grad.")
        k = self._bucket_of[index]
        grad = param.grad
        self.events.append(("grad", index))
        if (index in self._grads or k in self._pending or grad is None
                or grad.layout != torch.strided):
            # Served by the synchronous path from what apply gets.
            self._left[k] = -1
            return
        self._grads[index] = grad
        self._left[k] -= 1
        if self._left[k] == 0:
            self._start(k)
        self._take_finished()

    def _start(self, k):
        layout = self.layout
        alone, small = [], []
        for i in layout.buckets[k]:
            big = layout.chunks[i] * itemsize(layout.dtypes[i]) >= ALONE_BYTES
            (alone if big else small).append(i)
        parts = []
        with torch.no_grad():
            for p, i in enumerate(layout.buckets[k]):
                if i in alone:
                    parts.append(([i], self._enqueue(
                        [self._grads[i]], [i], f"{self._names[k]}.{p}")))
            if small:
                parts.append((small, self._enqueue(
                    [self._grads[i] for i in small], small, self._names[k])))
        self._pending[k] = [(m, pending, ctx) for m, (pending, ctx) in parts]
        self._inflight += [(k, n, sum(self._grads[i].numel() *
                                      self._grads[i].element_size()
                                      for i in m))
                           for n, (m, _) in enumerate(parts)]
        for i in layout.buckets[k]:
            self._versions[i] = self._grads[i]._version
            if self.release:
                self.params[i].grad = None
                self._released.add(i)
                self._grads[i] = None
        self.events.append(("start", k))

    def _enqueue(self, grads, members, name):
        layout = self.layout
        rows = [_rows(g, layout.numels[i], layout.chunks[i], layout.size)
                for g, i in zip(grads, members)]
        matrix = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        wire, ctx = self._compression.compress(matrix)
        return _collectives.start_reducescatter(
            wire, name, self._op, self._prescale, self._postscale,
            process_set=self._process_set), ctx

    def _take_finished(self):
        # The results that have arrived: their inputs (the whole
        # gradients, released) go now, not at apply; the oldest waited
        # for while too many bytes are in flight.
        # At most step.IN_FLIGHT_BYTES of whole gradients wait in
        # enqueued reducescatters (with `release`): past it, a hook waits
        # for the oldest before backprop goes on, so a core that falls
        # behind backprop does not let every whole gradient pile up (as
        # FSDP's limit on all-gathers in flight; TensorFlow's step paces
        # backprop to the same limit, step.scatter).
        waiting = sum(b for _, _, b in self._inflight)
        left = []
        for k, n, nbytes in self._inflight:
            members, pending, ctx = self._pending[k][n]
            if pending.done() or (self.release
                                  and waiting > _step.IN_FLIGHT_BYTES):
                self._split(members, pending, ctx)
                self._pending[k][n] = (members, None, ctx)
                waiting -= nbytes
            else:
                left.append((k, n, nbytes))
        self._inflight = left

    def _split(self, members, pending, ctx):
        mine = self._compression.decompress(pending.wait(), ctx)
        start = 0
        for i in members:
            self._shards[i] = mine[start:start + self.layout.chunks[i]]
            start += self.layout.chunks[i]

    # ---- from apply ---------------------------------------------------------

    def collect(self, grads):
        """(shards, redo): this rank's reduced shard of each gradient of
        `grads` (one per variable of the layout) that the hooks reduced,
        None elsewhere, and the sorted indices the caller reduces
        synchronously from `grads`."""
        shards = [None] * len(grads)
        redo = []
        try:
            for k, members in enumerate(self.layout.buckets):
                parts = self._pending.get(k)
                if parts is None:
                    redo += [i for i in members if grads[i] is not None]
                    continue
                for ms, pending, ctx in parts:
                    if pending is not None:
                        self._split(ms, pending, ctx)
                if all(self._same(i, grads[i]) for i in members):
                    for i in members:
                        shards[i] = self._shards[i]
                elif any(i in self._released for i in members):
                    raise ValueError(
                        "kerasdist: DistributedOptimizer(shard=\"gradients\")"
                        " on PyTorch reduce-scatters the gradients during "
                        "backprop and releases their .grad; apply() got "
                        "other gradients for those parameters. Pass the "
                        "parameters' .grad as loss.backward() left them "
                        "(None), or use shard=\"optimizer_state\", which "
                        "keeps .grad, to change the gradients before apply().")
                else:
                    redo += [i for i in members if grads[i] is not None]
        finally:
            self.events.append(("collect", tuple(sorted(redo))))
            self.last_events, self.events = self.events, []
            self._reset()
        return shards, sorted(redo)

    def _same(self, i, grad):
        if i in self._released:
            return grad is None
        seen = self._grads.get(i)
        return (grad is not None and grad is seen
                and grad._version == self._versions.get(i))
