"""The sharded optimizer's partition (`Layout`): which elements of each
variable each rank owns, a pure function of the variables' shapes and
dtypes and the number of ranks, shared by the step, the optimizer class
and the shard files.

Variable i of n_i elements is padded to N * c_i elements,
c_i = ceil(n_i / N), and rank r owns elements [r * c_i, (r + 1) * c_i).
Every rank thus owns 1/N of every variable (the shards are balanced by
bytes to within N - 1 elements a variable), and every rank's shard of a
variable has the same shape, so every rank builds the same optimizer
slots and traces the same program. A padded element has a zero gradient
and a zero weight, which every elementwise optimizer leaves at zero.
"""

import math

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist.keras import reduction as _reduction


def partition(numels, size):
    """The shard length of each variable: ceil(numel / size), at least 1.
    Rank r owns elements [r * c, (r + 1) * c) of the variable flattened and
    zero-padded to size * c elements (a pure function: the same on every
    rank, for a given model and size)."""
    if size < 1:
        raise ValueError(f"partition: size must be >= 1; got {size}.")
    return [max(1, math.ceil(int(n) / size)) for n in numels]


def owned(numel, chunk, rank):
    """The elements [lo, hi) of a variable that `rank` owns (hi == lo
    where its shard is all padding)."""
    lo = min(rank * chunk, numel)
    return lo, min(lo + chunk, numel)


def pieces(numel, chunk, lo, hi):
    """Where elements [lo, hi) of a variable of `numel` elements lie in
    shards of length `chunk` (rank k's shard holds elements
    [k * chunk, (k + 1) * chunk)): a list of (k, start, stop, at), element
    `at + j` of the range being element `start + j` of rank k's shard.
    Re-partitioning a checkpoint written at one size for another reads
    only these pieces (a pure function of the two layouts)."""
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"pieces: bad range [{lo}, {hi}) of {numel}.")
    if chunk < 1:
        raise ValueError(f"pieces: chunk must be >= 1; got {chunk}.")
    out = []
    at = lo
    while at < hi:
        k = at // chunk
        stop = min(hi, (k + 1) * chunk)
        out.append((k, at - k * chunk, stop - k * chunk, at - lo))
        at = stop
    return out


def flat_range(dataset, lo, hi):
    """Elements [lo, hi) of `dataset` (an array-like with a shape, such as
    an h5py dataset) flattened in C order, reading only the rows of its
    first axis that hold them: a rank loads its shard of a whole saved
    variable without reading the rest."""
    import numpy as np

    shape = tuple(dataset.shape)
    if len(shape) <= 1:
        return np.asarray(dataset[lo:hi]).reshape(-1)
    row = math.prod(shape[1:])
    if row == 0 or hi <= lo:
        return np.zeros((0,), dataset.dtype)
    first, last = lo // row, -(-hi // row)
    block = np.asarray(dataset[first:last]).reshape(-1)
    return block[lo - first * row:hi - first * row]


class Layout:
    """Where each variable's shard lies, for `size` ranks.

    Attributes:
        shapes, numels, dtypes: the variables'.
        chunks: each variable's shard length (`partition`).
        buckets: lists of variable indices, one dtype each, reduced and
            gathered together (`bucket_bytes` of them in backprop order,
            or one bucket a dtype).
    """

    def __init__(self, shapes, dtypes, size, bucket_bytes=None):
        self.size = size
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.dtypes = [str(d) for d in dtypes]
        self.chunks = partition(self.numels, size)
        # The replicated optimizer's rule (kerasdist.keras.reduction.plan):
        # its buckets (or one group a dtype), and its names, as suffixes
        # of the optimizer's prefix.
        sizes = [n * itemsize(d) for n, d in zip(self.numels, self.dtypes)]
        the_plan = _reduction.plan(sizes, self.dtypes, "",
                                   bucket_bytes=bucket_bytes or None,
                                   one_bucket=True, kinds_apart=True)
        self.buckets, self.names = the_plan.buckets, the_plan.names

    def shard_bytes(self):
        """Bytes of one rank's shards (padding included)."""
        return sum(c * itemsize(d) for c, d in zip(self.chunks, self.dtypes))


def itemsize(dtype):
    import numpy as np
    if dtype == "bfloat16":
        return 2
    return np.dtype(dtype).itemsize


def size_and_rank(process_set_id):
    if process_set_id:
        return (_process_sets.set_size(process_set_id),
                _process_sets.set_rank(process_set_id))
    return basics.size(), basics.rank()


# ---- the step ---------------------------------------------------------------


# A shard at least this large is reduced and gathered alone: its N x chunk
# rows are the variable itself (padded), so neither side copies a strided


class ShardState:
    """A sharded optimizer's state outside Keras' tracking: the model's
    variables, their shadows (this rank's shards, which the Keras
    optimizer updates), the layout, and which optimizer variables are
    slots of which shard."""

    def __init__(self, variables, shadows, layout, rank, framework):
        self.variables = variables
        self.shadows = shadows
        self.layout = layout
        self.rank = rank
        self.framework = framework
        self._ids = [id(v) for v in variables]
        self._model_of = {id(s): v for s, v in zip(shadows, variables)}
        self._index_of = {id(s): j for j, s in enumerate(shadows)}
        self._slots = {}  # id(slot) -> index of its variable
        self.whole = None  # whole_state's gathered values while saving

    def note_slot(self, slot, reference):
        j = self._index_of.get(id(reference))
        if j is not None:
            self._slots[id(slot)] = j

    def slot_index(self, variable):
        """The index of the variable whose shard `variable` is a slot of,
        or None for a shared optimizer variable."""
        return self._slots.get(id(variable))

    def model_variable(self, shadow):
        return self._model_of.get(id(shadow))

    def positions(self, variables):
        """The indices of `variables` among the optimizer's, which they
        must be all of or some of, in the same order."""
        where = {vid: i for i, vid in enumerate(self._ids)}
        out = [where.get(id(v)) for v in variables]
        if None in out or out != sorted(set(out)):
            self.check_variables(variables)  # raises
        return out

    def check_variables(self, variables):
        if [id(v) for v in variables] != self._ids:
            raise ValueError(
                "DistributedOptimizer(shard=...): apply() got other "
                f"variables ({len(variables)}) than the optimizer was built "
                f"with ({len(self._ids)}); a sharded optimizer updates the "
                "variables it was built with (all or some of them, with "
                "backward_passes_per_step=1), in one order.")

    def release(self, grads, mode):
        """With shard="gradients", drops the whole gradients the framework
        keeps between steps once they are reduce-scattered (PyTorch's
        `.grad`)."""
        if mode != "gradients":
            return
        for v in self.variables:
            tensor = getattr(v, "value", None)
            if getattr(tensor, "grad", None) is not None:
                tensor.grad = None
