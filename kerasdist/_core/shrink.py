"""A rank's side of shrinking in place (private; docs/failures-and-elastic.md,
"Shrinking in place").

Under `kerasdist run --recover-in-place --host-discovery-script`, when the
script lists fewer slots the launcher writes a shrink request
(kerasdist/run/grow.py: the request file a grow uses, naming the ranks that
leave instead of the ranks to start) before it asks the ranks to resize.
`hvd.elastic.run` (kerasdist/elastic.py) then, at the commit where the
ranks agree on the launcher's resize request (State.check_host_updates):

* `take(body)`: every rank has the request by broadcast (grow.request());
  a shrink request is noted here, and the commit raises
  HostsUpdatedInterrupt on every rank, where `run` calls
* `finish(state, log)`: the runtime stops on every rank; the ranks split
  the job's communicator (MPI_Comm_split, MPI_UNDEFINED for those that
  leave: ops/core/transport/mpi_grow.cc); a rank that leaves says so in
  one line and ends with exit code 0 (SystemExit(0)); the others start the
  runtime on the job without them (new `kd.size()` and `kd.rank()`, in
  their order), restore the commit they all just made (the same values;
  a sharded state laid out over them, the leavers' shards from their
  buddies' copies), run the state's reset callbacks, sync the state, and
  train on from that commit: no step is lost or trained twice.

The Trainer (kerasdist/trainer/trainer.py) uses the same two steps at a
step where its ranks agree on the request: `take(body)`, a commit in
memory, then `finish` with a state whose `restore()` puts that commit
back at the new size.

A failure on the way (a rank lost during the split) ends the rank with one
line: the launcher's relaunch resumes from the last commit on disk.
"""

import ctypes
import sys
import time

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import grow as _grow
from kerasdist._core import resize as _resize

# How long the split may take (the ranks agreed at one commit, so only a
# rank lost or frozen meanwhile makes it wait).
SPLIT_DEADLINE_S = 60.0

_pending = {"body": None}


def is_request(body):
    """Whether the in-place request `body` (grow.request()'s) is a shrink:
    it names the ranks that leave."""
    return isinstance(body, dict) and isinstance(body.get("leave"), list)


def take(body):
    """Every rank, at the commit where the ranks agreed on a resize
    request: notes the shrink request `body` (see is_request); the commit
    then ends the training function (HostsUpdatedInterrupt) and `run` calls
    finish(). False where `body` is no shrink request, or one for another
    size (the job then stops for a relaunch)."""
    if not is_request(body) or body.get("old_np") != basics.size():
        return False
    try:
        leave = sorted({int(r) for r in body["leave"]
                        if 0 <= int(r) < basics.size()})
    except (TypeError, ValueError):  # not the launcher's: no shrink
        return False
    if not leave or len(leave) >= basics.size():
        return False
    _pending["body"] = dict(body, leave=leave)
    _resize.served()
    return True


def pending():
    """Whether a shrink was agreed on and not finished yet."""
    return _pending["body"] is not None


def _split(leave):
    """The C API's shrink (the runtime stopped; collective over the job):
    raises RuntimeError with MPI's error where the split fails."""
    lib = _capi.lib()
    lib.kerasdist_shrink.argtypes = [ctypes.c_int, ctypes.c_double]
    lib.kerasdist_shrink.restype = ctypes.c_int
    if lib.kerasdist_shrink(1 if leave else 0, SPLIT_DEADLINE_S) != 0:
        raise RuntimeError(_capi.last_error())


def finish(state, log):
    """Every rank, at the commit the ranks agreed on the shrink: the ranks
    that leave end here (SystemExit(0), after one line); the others go on
    on the smaller job, from that commit, with the reset callbacks run and
    the state synced; `log(line)` says so on rank 0 of the smaller job (see
    the module's doc)."""
    body, _pending["body"] = _pending["body"], None
    was, rank, began = basics.size(), basics.rank(), time.monotonic()
    leaving = rank in body["leave"]
    why = body.get("why", "the hosts changed")
    failed = "kerasdist.elastic: shrinking in place failed"

    def split():
        _split(leaving)

    if leaving:
        try:
            basics.shutdown()
            split()
        except Exception as e:
            _grow.end_rank(failed, e)
        print(f"kerasdist.elastic: rank {rank} leaves the job ({why}); the "
              f"others go on at {was - len(body['leave'])} rank(s) from "
              f"the last commit; this rank ends with exit code 0",
              file=sys.stderr, flush=True)
        raise SystemExit(0)

    def reset():
        # The commit just made, restored: the same values, and a sharded
        # state's shards (the optimizer's, the model's weights') laid out
        # over the ranks that stay, the leavers' from their buddies'
        # copies (kerasdist/keras/sharding/buddies.py), as after a lost
        # rank.
        state.restore()
        state.on_reset()
        state.sync()

    _grow.restart_or_end(reset, failed, between=split)
    if basics.rank() == 0:
        gone = ", ".join(str(r) for r in body["leave"])
        log(f"shrank in place to {basics.size()} rank(s) (was {was}; {why}):"
            f" rank(s) {gone} left, the job re-formed in "
            f"{time.monotonic() - began:.2f} s, going on from the last "
            f"commit")
