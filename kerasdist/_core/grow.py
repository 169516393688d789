"""A rank's side of growing in place (private; docs/failures-and-elastic.md,
"Growing in place").

Under `kerasdist run --recover-in-place --host-discovery-script`, the
launcher writes a grow request (kerasdist/run/grow.py) before it asks the
ranks to resize. `hvd.elastic.run` (kerasdist/elastic.py) then, at the
commit where the ranks agree on the request (HostsUpdatedInterrupt):

* `request()`: rank 0 reads the request (and removes it), every rank gets
  it by broadcast; None where there is none (the job then stops for a
  relaunch, as without recovery in place).
* `grow(state, request, log)`: stops the runtime, starts the new ranks
  (MPI_Comm_spawn, ops/core/transport/mpi_grow.cc) and merges them into the
  job, starts the runtime on the grown job, runs the state's reset
  callbacks and syncs the state to every rank, the new ones included.
* A new rank (KERASDIST_GROWN_RANK set; its kd.init() merged it into the
  job): `joined()` is true, and `run` syncs the state from rank 0 before
  it calls the training function, instead of loading the last commit.
"""

import ctypes
import json
import os
import sys
import time

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import resize as _resize

REQUEST_NAME = "grow.json"  # kerasdist/run/grow.py's
GROWN_RANK_ENV = "KERASDIST_GROWN_RANK"  # kerasdist/run/_rank.py's
RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"
ELASTIC_DIR_ENV = "KERASDIST_ELASTIC_DIR"

_joined = {"pending": GROWN_RANK_ENV in os.environ}


def _spawn(ranks):
    """The C API's grow (ops/core/transport/mpi_grow.cc; the runtime
    stopped): collective. `ranks`: on rank 0, one (argv, info lines) per
    new rank, where info lines are Open MPI's spawn info ("host=h");
    ignored elsewhere. Raises RuntimeError with MPI's error when the new
    ranks cannot be started (the job is as it was)."""
    lib = _capi.lib()
    strings = ctypes.POINTER(ctypes.c_char_p)
    lib.kerasdist_grow.argtypes = [ctypes.c_int, strings, strings]
    lib.kerasdist_grow.restype = ctypes.c_int
    n = len(ranks)
    argvs = (ctypes.c_char_p * max(n, 1))(
        *["\x1f".join(argv).encode() for argv, _ in ranks])
    infos = (ctypes.c_char_p * max(n, 1))(
        *["\n".join(info).encode() for _, info in ranks])
    if lib.kerasdist_grow(n, argvs, infos) != 0:
        raise RuntimeError(_capi.last_error())


def _read_request():
    """Rank 0: the launcher's request for this size, or None; removed once
    read."""
    directory = os.environ.get(ELASTIC_DIR_ENV)
    if not directory:
        return None
    path = os.path.join(directory, REQUEST_NAME)
    try:
        with open(path) as f:
            body = json.load(f)
        os.remove(path)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("old_np") != basics.size() \
            or not body.get("ranks"):
        return None
    return body


def request():
    """Every rank: the grow request rank 0 read, or None (see the module's
    doc). Collective in a job with recovery in place; None at once
    elsewhere."""
    if os.environ.get(RECOVER_ENV) != "1":
        return None
    body = _read_request() if basics.rank() == 0 else None
    if basics.size() > 1:
        from kerasdist.objects import broadcast_object
        body = broadcast_object(body, 0, name="kerasdist.elastic.grow")
    return body


def grow(state, body, log):
    """Every rank of the job: grows it as `body` asks (see the module's
    doc); `log(line)` says how on rank 0. A failure to start the new ranks
    leaves the job at its size, said in one line; a failure after that
    ends this rank with one line (a relaunch resumes from the last commit
    on disk)."""
    was, began = basics.size(), time.monotonic()
    ranks = [(r["argv"], r.get("info", [])) for r in body["ranks"]] \
        if basics.rank() == 0 else []
    basics.shutdown()
    failed = None
    try:
        _spawn(ranks)
    except RuntimeError as e:
        failed = (str(e).strip().splitlines() or ["MPI's error"])[0]
    try:
        basics.init()
        _resize.served()
        state.on_reset()
        state.sync()
    except Exception as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"kerasdist.elastic: growing in place failed: {why}; ending "
              f"this rank (a relaunch resumes from the last commit on disk)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    if basics.rank() != 0:
        return
    took = time.monotonic() - began
    if failed is not None:
        log(f"growing in place failed ({failed}); going on at {was} "
            f"rank(s)")
    else:
        log(f"grew in place to {basics.size()} rank(s) (was {was}) in "
            f"{took:.2f} s ({body.get('why', 'the hosts changed')}), "
            f"resuming from the last commit")


def joined():
    """True once, in a rank that joined a running job (grown in place),
    at its first `hvd.elastic.run`."""
    pending, _joined["pending"] = _joined["pending"], False
    return pending and os.environ.get(RECOVER_ENV) == "1"
