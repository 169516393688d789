"""A sharded optimizer's committed slots (with shard="weights", and the
model's weight shards) kept twice, so that recovery in place
(docs/failures-and-elastic.md, "Recovery in place") loses nothing when a
rank goes: each rank keeps its own shard of the commit and a copy of one
other rank's (its buddy's), and after a lost rank the survivors
re-partition the committed shards over the new size in memory.

    copies = buddies.commit(optimizer, copies)   # every rank, each commit
    ...                                          # a rank is lost; kd.init()
    copies = buddies.recover(optimizer, copies)  # every survivor

`commit` takes this rank's shard of every slot to host memory
(`files.take_shard`; with shard="weights" its weight shards too,
`files.take_weight_shards`, keyed "w<j>" as in the shard files) and,
in a job started with `--recover-in-place`
(KERASDIST_RECOVER_IN_PLACE=1), sends it to rank (r + d) % N, receiving
rank (r - d) % N's: d is the smallest offset that puts every rank's copy
on another host than the rank (`buddy_offset`; 1 where all ranks share a
host), so the loss of a host loses nothing either where there are others.
One alltoall of the shard's bytes, every rank's the same size.

`recover`, on every survivor after the runtime re-formed at the new size
M: the survivors agree on who was who (one small allgather); each old
rank k's shard is taken from k if it survived, else from its buddy
(k + d) % N; sharded weights are laid out at size M in place
(`resize_weights`: the same variables, of the new shard length); the
optimizer is built again at size M
(`ShardedStep.kerasdist_rebuild`: new shards and slots of the new
length, the shared variables kept); each survivor receives the elements
of its new shard (`layout.owned`) from whoever holds the old shards that
hold them (`layout.pieces`), in one alltoall; then it commits again at
the new size, buddies included. `ShardsLostError` (one line) where that
cannot be: a rank and its buddy both lost, or the survivors' copies of
different commits (a rank lost during a commit): the caller falls back to
the relaunch from the last commit on disk.

`grow`, on every rank after the job grew in place (the old ranks, whose
optimizer is still laid out at the old size, and the new ones, which
hold nothing of the commit): as `recover`, but every old rank is there,
so each sends the pieces of its own committed shard and the new ranks
only receive (their row in the agreement says they hold no commit).

Used by kerasdist.elastic (`_ShardCommits`); the Trainer's recovery may
use `commit` and `recover` alike.
"""

import hashlib
import os
import socket

import numpy as np

from kerasdist import basics
from kerasdist.keras.optimizer import shard_state
from kerasdist.keras.optimizer import sharded_in
from kerasdist.keras.sharding import files as _files
from kerasdist.keras.sharding.layout import owned
from kerasdist.keras.sharding.layout import partition
from kerasdist.keras.sharding.layout import pieces

RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"


class ShardsLostError(RuntimeError):
    """The committed shards cannot be re-partitioned in memory (says why
    in one line); the job resumes from its last commit on disk."""


def keeps_copies():
    """Whether commits copy each shard to a buddy: in a job that recovers
    in place, at more than one rank."""
    return os.environ.get(RECOVER_ENV) == "1" and basics.size() > 1


def buddy_offset(hosts):
    """The offset d (rank r's copy lives on rank (r + d) % N) for ranks on
    `hosts` (one host name or id a rank): the smallest d that puts every
    rank's copy on another host than the rank, else 1 (one host, or no
    such d); 0 for a single rank."""
    n = len(hosts)
    for d in range(1, n):
        if all(hosts[(r + d) % n] != hosts[r] for r in range(n)):
            return d
    return 1 if n > 1 else 0


class Copies:
    """One rank's commit of a sharded optimizer's slots.

    Attributes:
        values: this rank's shard of every slot ({optimizer variable
            index: 1-D array}, `files.take_shard`).
        copy: its buddy's source's shard, rank (rank - offset) % size's,
            in the same form; None where no copy is kept.
        rank, size, offset: this rank, the job's size and the buddy
            offset at the commit.
        slots: {optimizer variable index: (numel, chunk, dtype name)}.
        number: the commit's number (the same on every rank).
    """

    def __init__(self, values, copy, rank, size, offset, slots, number):
        self.values, self.copy = values, copy
        self.rank, self.size, self.offset = rank, size, offset
        self.slots, self.number = slots, number


def _slots(optimizer):
    """{key: (numel, chunk, dtype name)} of what a commit holds: each slot
    by its optimizer variable index, and with shard="weights" each of the
    model's weight shards by "w<j>" (j: its index in the layout; the
    shard files' keys, `files.take_weight_shards`)."""
    layout = shard_state(optimizer).layout
    out = {i: (layout.numels[j], layout.chunks[j], layout.dtypes[j])
           for i, _, j in _files.slot_variables(optimizer)}
    out.update({f"w{j}": (layout.numels[j], layout.chunks[j],
                          layout.dtypes[j])
                for j, _ in _files.weight_shards(optimizer)})
    return out


def _keys(slots):
    """`slots`' keys in one order on every rank: the slots' indices, then
    the weight shards' "w<j>" by j."""
    return sorted(slots, key=lambda k: (1, int(k[1:])) if isinstance(k, str)
                  else (0, k))


def take(optimizer):
    """This rank's shard of every slot and (shard="weights") of every
    weight, copied to host memory, by `_slots`' keys."""
    values = _files.take_shard(optimizer)
    values.update(_files.take_weight_shards(optimizer))
    return values


def assign(optimizer, values):
    """Assigns the slots and weight shards of `values` (by `_slots`' keys,
    laid out for the optimizer's size now) to their variables."""
    for i, v, _ in _files.slot_variables(optimizer):
        if i in values:
            v.assign(values[i])
    for j, v in _files.weight_shards(optimizer):
        if f"w{j}" in values:
            v.assign(values[f"w{j}"])


def _host_ids():
    """Every rank's host, as an int64 hash of its host name."""
    from kerasdist._core import host as _host
    mine = int.from_bytes(hashlib.sha256(
        socket.gethostname().encode()).digest()[:7], "little")
    return [int(h) for h in _host.host_allgather(
        np.array([mine], np.int64), "kerasdist.buddies.hosts")]


def _bytes(values, slots):
    """`values` (by slot index) as one uint8 array, in slot order."""
    parts = [np.ascontiguousarray(values[i]).reshape(-1).view(np.uint8)
             for i in _keys(slots)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _unbytes(blob, slots):
    out, at = {}, 0
    for i in _keys(slots):
        _, chunk, dtype = slots[i]
        dtype = _files.numpy_dtype(dtype)
        n = chunk * np.dtype(dtype).itemsize
        out[i] = np.array(blob[at:at + n]).view(dtype)
        at += n
    return out


def _alltoall(parts, recv_bytes, name):
    """Sends parts[q] (uint8) to rank q; returns the bytes each rank sent
    this one (recv_bytes[q] from rank q). Every part travels with one more
    byte, so that no rank sends or receives nothing."""
    from kerasdist._core import capi as _capi
    from kerasdist._core import host as _host
    send = np.concatenate([np.concatenate([np.zeros(1, np.uint8), p])
                           for p in parts])
    total = sum(recv_bytes) + len(recv_bytes)
    got = _host.run_host(_capi.OP_ALLTOALL, name, [send], [(total,)],
                         owned=True, splits=[p.size + 1 for p in parts])[0]
    out, at = [], 0
    for n in recv_bytes:
        out.append(got[at + 1:at + 1 + n])
        at += 1 + n
    return out


def commit(optimizer, previous=None):
    """Every rank of a built sharded optimizer: this rank's shard of
    every slot, taken to host memory, and (`keeps_copies()`) a copy of
    its buddy's source's shard, received as it sends its own to its
    buddy (a collective). `previous`: the last Copies (its offset is
    reused at the same size and rank). Returns the new Copies; the
    previous one stays as it was if the exchange fails."""
    state = shard_state(optimizer)
    rank, size = state.rank, state.layout.size
    values = take(optimizer)
    slots = _slots(optimizer)
    number = 0 if previous is None else previous.number + 1
    if not keeps_copies() or size != basics.size():
        return Copies(values, None, rank, size, 0, slots, number)
    if previous is not None and (previous.size, previous.rank) == \
            (size, rank) and previous.offset:
        offset = previous.offset
    else:
        offset = buddy_offset(_host_ids())
    blob = _bytes(values, slots)
    parts = [np.zeros(0, np.uint8)] * size
    parts[(rank + offset) % size] = blob
    recv = [0] * size
    recv[(rank - offset) % size] = blob.size  # every shard one size
    got = _alltoall(parts, recv, "kerasdist.buddies.copy")
    copy = _unbytes(got[(rank - offset) % size], slots)
    return Copies(values, copy, rank, size, offset, slots, number)


def resized(optimizer):
    """Whether the sharded optimizer in `optimizer` is laid out for
    another number of ranks than the job now has (after a recovery in
    place: `recover` is due)."""
    state = shard_state(optimizer)
    return state is not None and state.layout.size != basics.size()


def holders(copies, old_ranks):
    """{old rank k: (new rank holding k's shard, whether as its copy)} for
    every old rank of `copies`' commit, given the survivors' old ranks in
    new rank order; ShardsLostError where a shard is on no survivor."""
    new_of = {k: s for s, k in enumerate(old_ranks)}
    n, d = copies.size, copies.offset
    out = {}
    for k in range(n):
        if k in new_of:
            out[k] = (new_of[k], False)
        elif d and (k + d) % n in new_of:
            out[k] = (new_of[(k + d) % n], True)
        else:
            lost = sorted(set(range(n)) - set(old_ranks))
            what = "the model's sharded weights" if any(
                isinstance(key, str) for key in copies.slots) else \
                "the sharded optimizer's state"
            why = (f"it and its buddy, rank {(k + d) % n}, were both "
                   f"lost (ranks {lost})" if d else
                   "no copies are kept (a job started without "
                   "--recover-in-place, or a single rank)")
            raise ShardsLostError(f"rank {k}'s shard of {what} is lost: "
                                  f"{why}")
    return out


def _agree(copies):
    """The old rank of every rank now, in new rank order (-1 for a rank
    that holds no commit: `copies` None, a rank that joined a job grown
    in place, which only receives); ShardsLostError unless every rank
    that holds one holds copies of one commit at one size."""
    from kerasdist._core import host as _host
    row = np.array([[copies.rank, copies.size, copies.offset,
                     copies.number, copies.copy is not None]
                    if copies is not None else [-1, -1, -1, -1, 0]],
                   np.int64)
    table = _host.host_allgather(row, "kerasdist.buddies.agree")
    held = {tuple(r[1:]) for r in table.tolist() if r[0] >= 0}
    if len(held) != 1:
        raise ShardsLostError(
            "the ranks hold the sharded optimizer's state of different "
            "commits (a rank was lost during a commit)" if held else
            "no rank holds a commit of the sharded optimizer's state")
    return [int(r[0]) for r in table]


def _plan(copies, where, new_size, dest, src):
    """The pieces survivor `src` sends survivor `dest` at the new size:
    [(slot i, old rank k, from the copy, start, stop, at)], in one order
    on both sides."""
    out = []
    for i in _keys(copies.slots):
        numel, chunk, _ = copies.slots[i]
        lo, hi = owned(numel, partition([numel], new_size)[0], dest)
        for k, start, stop, at in pieces(numel, chunk, lo, hi):
            holder, from_copy = where[k]
            if holder == src:
                out.append((i, k, from_copy, start, stop, at))
    return out


def repartition(copies):
    """Every survivor, after the runtime re-formed among them: this rank's
    shard of every slot at the new size ({optimizer variable index: 1-D
    array, padded}), gathered from the survivors' committed shards and
    copies (one alltoall). ShardsLostError where a shard is lost."""
    return _exchange(copies, holders(copies, _agree(copies)))


def _exchange(copies, where):
    """This rank's shard of every slot of `copies`' commit at the job's
    size now, in one alltoall: each old rank k's shard sent by the rank
    `where[k]` names (from its own shard or its copy); a rank that holds
    nothing sends nothing (`copies.values` None: it only receives)."""
    me, size = basics.rank(), basics.size()
    parts, recv = [], []
    for dest in range(size):
        chunks = []
        for i, k, from_copy, start, stop, _ in _plan(copies, where, size,
                                                     dest, me):
            held = copies.copy if from_copy else copies.values
            chunks.append(np.ascontiguousarray(
                held[i][start:stop]).view(np.uint8))
        parts.append(np.concatenate(chunks) if chunks
                     else np.zeros(0, np.uint8))
    for src in range(size):
        recv.append(sum((stop - start) * np.dtype(_files.numpy_dtype(
            copies.slots[i][2])).itemsize for i, _, _, start, stop, _ in
            _plan(copies, where, size, me, src)))
    got = _alltoall(parts, recv, "kerasdist.buddies.repartition")
    out = {}
    for i in _keys(copies.slots):
        numel, _, dtype = copies.slots[i]
        out[i] = np.zeros(partition([numel], size)[0],
                          _files.numpy_dtype(dtype))
    for src in range(size):
        at_byte = 0
        for i, _, _, start, stop, at in _plan(copies, where, size, me,
                                              src):
            dtype = out[i].dtype
            n = (stop - start) * dtype.itemsize
            out[i][at:at + stop - start] = np.array(
                got[src][at_byte:at_byte + n]).view(dtype)
            at_byte += n
    return out


def recover(optimizer, copies, model=None):
    """Every survivor, after a recovery in place re-formed the runtime
    at a new size: re-partitions the committed slots and weight shards
    (`repartition`), lays the model's sharded weights out at the new size
    (`resize_weights`), builds the sharded optimizer again at the new
    size, assigns each slot its new shard, and commits again (buddies at
    the new size). Returns the new Copies. ShardsLostError (nothing
    changed) where a committed shard is on no survivor."""
    if copies is None:
        raise ShardsLostError("no commit of the sharded optimizer's state")
    values = repartition(copies)
    resize_weights(optimizer, values, model)
    sharded_in(optimizer).kerasdist_rebuild()
    assign(optimizer, values)
    return commit(optimizer, copies)


def resize_weights(optimizer, values, model=None):
    """shard="weights", after a recovery in place: each of the model's
    weight shards becomes this rank's shard at the job's size now, in
    place (the same Keras variable, now of the new shard length; its
    `WeightShard` notes the new size, rank and length, which the views'
    gathers and `own_piece` read), holding `values["w<j>"]` (padded, from
    `repartition`). On PyTorch each shard's backend value is a new
    Parameter, which `model`'s layers track again (as
    `kerasdist.shard_weights` has them). Nothing for another optimizer."""
    import keras

    from kerasdist.keras.sharding import weights as _weights

    pairs = _files.weight_shards(optimizer)
    size, rank = basics.size(), basics.rank()
    for j, v in pairs:
        weight = _weights.info(v)
        weight.size, weight.rank = size, rank
        weight.chunk = partition([weight.numel], size)[0]
        tensor = v._convert_to_tensor(values[f"w{j}"], dtype=v.dtype)
        v._shape = (weight.chunk,)
        v._ndim = 1
        v._initialize(tensor)
    if pairs and model is not None and \
            keras.backend.backend() == "torch":
        functional = getattr(model, "_functional", None)  # a Sequential's
        for layer in list(model._flatten_layers(
                include_self=True, recursive=True)) + \
                ([functional] if functional else []):
            if hasattr(layer, "_torch_params"):
                layer._track_variables()


def grow(optimizer, copies, model=None):
    """Every rank after the job grew in place (kerasdist/_core/grow.py),
    the old ranks and the new: the last commit's shards laid out at the
    new size. An old rank (`copies`: its commit, made at the old size
    where the grow began; its optimizer still laid out for it) sends the
    pieces of its own shard that each rank owns at the new size; a new
    rank (`copies` None or not of the commit: it holds nothing of it)
    only receives its shard. Then, as `recover`: the old ranks lay the
    model's sharded weights out at the new size (`resize_weights`) and
    build the optimizer again (`kerasdist_rebuild`), every rank assigns
    its new shard and commits again at the new size (buddies included,
    the commit's number the same on every rank). Nothing is gathered
    whole: a rank receives only its shard. Returns the new Copies."""
    from kerasdist.objects import broadcast_object

    holds = copies is not None and resized(optimizer)
    old_ranks = _agree(copies if holds else None)
    first = next(s for s, k in enumerate(old_ranks) if k >= 0)
    size, offset, number, slots = broadcast_object(
        (copies.size, copies.offset, copies.number, copies.slots)
        if holds else None, first, name="kerasdist.buddies.grow")
    if not holds:
        copies = Copies(None, None, -1, size, offset, slots, number)
    values = _exchange(copies, holders(copies, old_ranks))
    if holds:
        resize_weights(optimizer, values, model)
        sharded_in(optimizer).kerasdist_rebuild()
    assign(optimizer, values)
    return commit(optimizer, copies)
