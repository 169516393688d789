"""Horovod's process sets: collectives over a subset of the job's ranks.

Each set runs on a runtime of its own in the core
(ops/core/process_sets.cc): its own communicator, background thread,
negotiation, fusion and response cache, so collectives of different sets
never wait for each other and may be issued in different orders on
different ranks. The whole job is `global_process_set` (id 0).

    even = kd.ProcessSet([0, 2])
    kd.init(process_sets=[even])          # or kd.add_process_set([0, 2])
    if even.included():
        total = kd.allreduce(x, op=kd.Sum, process_set=even)

As in Horovod, ranks given to collectives (a broadcast's `root_rank`) are
ranks of the job, not of the set. Unlike Horovod, `add_process_set` and
`remove_process_set` work with or without `init(process_sets="dynamic")`:
every set has its own runtime, so adding one never changes another's.
Both are collective over every rank of the job.

A set lives as long as the runtime it was added to: `shutdown()` drops
every set but the global one, and so does a recovery in place
(docs/failures-and-elastic.md, "Recovery in place"), whose `init()` starts
the survivors, renumbered, as a new job. As in Horovod, whose elastic
reset is `shutdown()` and `init()` too, a set is not re-created: its ranks
name the old job's processes. Its `ProcessSet` object then fails every
collective, and `add_process_set`, with one error that says so; a reset
callback adds the set again with the new ranks.
"""

import weakref

from kerasdist._core import capi as _capi

__all__ = ["ProcessSet", "add_process_set", "global_process_set",
           "remove_process_set"]


class ProcessSet:
    """A set of ranks that run collectives together.

    Build it from a list of ranks (or an mpi4py communicator whose ranks
    are a subset of the job's), then pass it to `init(process_sets=[...])`
    or `add_process_set`; `process_set_id` is set then.
    """

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError(
                "ProcessSet should be initialized with a list of process "
                "ranks or an mpi4py Comm object") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(
                "ProcessSet should be initialized with a list of process "
                f"ranks (ints) or an mpi4py Comm object; got {ranks!r}")
        self.ranks = ranks

    _dropped = None  # why a set added to an earlier runtime is gone

    def _invalidate(self):
        self.process_set_id = None

    def _drop(self, why):
        self.process_set_id = None
        self._dropped = why

    def _check_live(self):
        if self._dropped is not None:
            raise ValueError(
                f"{self}: this process set was dropped when {self._dropped}; "
                "its ranks are the old job's. Add the set again with the new "
                "ranks (kerasdist.add_process_set([...]) on every rank, e.g. "
                "in a reset callback: state.register_reset_callbacks) and "
                "use the ProcessSet it returns.")

    def size(self):
        """The number of ranks in the set; None before it is added."""
        self._check_live()
        if self.process_set_id is None:
            return None
        ranks = _capi.process_set_ranks(self.process_set_id)
        return None if ranks is None else len(ranks)

    def rank(self):
        """This process's rank within the set (-1 when not a member); None
        before it is added. Collectives still take ranks of the job."""
        self._check_live()
        if self.process_set_id is None:
            return None
        r = _capi.process_set_rank(self.process_set_id)
        return None if r == -2 else r

    def included(self):
        """Whether this process is in the set; None before its ranks are
        known."""
        if self.process_set_id == 0:
            return True
        self._check_live()
        if self.ranks is None:
            return None
        from kerasdist import basics
        return basics.rank() in self.ranks

    def __eq__(self, other):
        return (isinstance(other, ProcessSet)
                and self.process_set_id == other.process_set_id
                and self.ranks == other.ranks)

    def __hash__(self):
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __str__(self):
        return (f"ProcessSet(process_set_id={self.process_set_id}, "
                f"ranks={self.ranks}, mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

# The sets added to the running runtime (weak: an object the program let
# go needs no dropping). The next init() drops them.
_live = []
_recoveries_seen = 0  # the core's count of recoveries in place, at init()


def _comm_ranks(comm):
    """The job ranks of an mpi4py communicator's members."""
    from mpi4py import MPI

    from kerasdist import basics
    # Every rank of the job calls this; members tell the others.
    world = MPI.COMM_WORLD
    mine = sorted(MPI.Group.Translate_ranks(
        comm.Get_group(), list(range(comm.Get_size())), world.Get_group()))
    if world.Get_size() != basics.size():
        raise ValueError("ProcessSet(comm) needs kerasdist's job to be "
                         "MPI.COMM_WORLD.")
    return mine


def add_process_set(process_set):
    """Adds a set of ranks (a `ProcessSet` or a list of ranks) and returns
    it with its `process_set_id`.

    Collective: every rank of the job calls it with the same ranks, also
    those outside the set, and in the same order as other add/remove calls.

    Raises:
        ValueError: ranks out of range, a set of these ranks exists already
            (or they are the whole job), or the ranks disagree.
        RuntimeError: before `init()`.
    """
    from kerasdist import basics
    if not basics.is_initialized():
        raise RuntimeError("add_process_set() needs kerasdist.init() first.")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    process_set._check_live()
    if process_set.ranks is None:
        process_set.ranks = _comm_ranks(process_set.mpi_comm)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} has been added already.")
    process_set.process_set_id = _capi.add_process_set(process_set.ranks)
    _live.append(weakref.ref(process_set))
    from kerasdist._core import host
    host.forget_set_names(process_set.process_set_id)
    return process_set


def remove_process_set(process_set):
    """Removes a set added before; its pending collectives fail. Returns
    whether it was removed (False for the global set or one never added).

    Collective: every rank of the job calls it for the same set.
    """
    pid = getattr(process_set, "process_set_id", None)
    if pid is None or pid == 0:
        return False
    process_set._invalidate()
    _capi.remove_process_set(pid)
    return True


def _init_process_sets(process_sets):
    """After the core started (init): adds `process_sets` in order; a list
    that names the same ranks twice adds them once (the later objects are
    left without an id, as in Horovod). The sets of an earlier runtime are
    dropped first."""
    _drop_sets()
    global_process_set.ranks = list(range(_size()))
    if process_sets is None or isinstance(process_sets, str):
        if process_sets not in (None, "dynamic"):
            raise ValueError("init(process_sets=...) takes a list of "
                             "ProcessSet objects or \"dynamic\"; got "
                             f"{process_sets!r}.")
        return
    seen = {}
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        ps._dropped = None  # given again: its ranks are this job's
        if ps.ranks is None:
            ps.ranks = _comm_ranks(ps.mpi_comm)
        key = tuple(ps.ranks)
        if key == tuple(global_process_set.ranks) or key in seen:
            ps.process_set_id = 0 if key == tuple(
                global_process_set.ranks) else None
            if ps.process_set_id == 0:
                _live.append(weakref.ref(ps))
            continue
        ps.process_set_id = None
        add_process_set(ps)
        seen[key] = ps


def _drop_sets():
    """At init(): every set added before (to a runtime since shut down) is
    dropped; its object says why when used."""
    global _recoveries_seen
    recoveries = _capi.lib().kerasdist_recoveries()
    lost, _recoveries_seen = recoveries > _recoveries_seen, recoveries
    if not _live:
        return
    from kerasdist import basics
    why = (f"the job re-formed in place after a lost rank (now "
           f"{basics.size()} ranks, renumbered)" if lost else
           "kerasdist shut down (kerasdist.shutdown()) and started again")
    for ref in _live:
        ps = ref()
        if (ps is not None and ps is not global_process_set
                and ps.process_set_id is not None):
            ps._drop(why)
    del _live[:]


def _size():
    from kerasdist import basics
    return basics.size()


def _register():
    from kerasdist import basics
    basics.add_init_hook(_init_process_sets)


_register()


def resolve(process_set):
    """The id of `process_set` (a ProcessSet, or None for the whole job)
    that a collective runs on."""
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        process_set._check_live()
        if process_set.process_set_id is None:
            raise ValueError(
                f"{process_set} has not been added: pass it to "
                "kerasdist.init(process_sets=[...]) or "
                "kerasdist.add_process_set() first.")
        pid = int(process_set.process_set_id)
        if pid and _capi.process_set_ranks(pid) is None:
            raise ValueError(
                f"{process_set}: process set {pid} does not exist (removed, "
                "or never added); the sets are "
                f"{_capi.process_set_ids()}.")
        return pid
    raise TypeError("process_set must be a kerasdist.ProcessSet; got "
                    f"{type(process_set).__name__}.")


def set_size(process_set_id):
    """The size of set `process_set_id` (ValueError if unknown)."""
    ranks = _capi.process_set_ranks(process_set_id)
    if ranks is None:
        raise ValueError(f"process set {process_set_id} does not exist.")
    return len(ranks)


def set_rank(process_set_id):
    """This rank within set `process_set_id`."""
    r = _capi.process_set_rank(process_set_id)
    if r == -2:
        raise ValueError(f"process set {process_set_id} does not exist.")
    return r


def current_size():
    """The size of the process set collectives now run on (the innermost
    `process_set=` scope; the job's size outside any)."""
    ps = _capi.current_process_set()
    return set_size(ps) if ps else _size()
