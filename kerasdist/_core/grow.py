"""A rank's side of growing in place (private; docs/failures-and-elastic.md,
"Growing in place").

Under `kerasdist run --recover-in-place --host-discovery-script`, the
launcher writes a grow request (kerasdist/run/grow.py) before it asks the
ranks to resize. `hvd.elastic.run` (kerasdist/elastic.py) then, at the
commit where the ranks agree on the launcher's resize request:

* `begin()`: rank 0 reads the request (and removes it), every rank gets it
  by broadcast (`request()`), and every rank starts a thread that starts
  the new ranks with the others (MPI_Comm_spawn over the job's
  communicator, ops/core/transport/mpi_grow.cc) and merges them into a new
  communicator, while the runtime goes on on its own: the ranks train on
  while the new ones start (their Python, imports, kd.init()). False where
  there is no request (the job then stops for a relaunch, as without
  recovery in place).
* `spawning()`: whether that thread still runs; the commits' check
  (State.check_host_updates) agrees on it in its one small allreduce, and
  at the first commit where it has ended on every rank raises
  HostsUpdatedInterrupt, where `run` calls
* `finish(state, log)`: starts the runtime on the grown job, runs the
  state's reset callbacks and syncs the state to every rank, the new ones
  included.
* A new rank (KERASDIST_GROWN_RANK set; its kd.init() merged it into the
  job): `joined()` is true, and `run` syncs the state from rank 0 before
  it calls the training function, instead of loading the last commit.

Over the TCP transport (KERASDIST_TRANSPORT=tcp) no launcher's request
and no spawn: processes started with KERASDIST_JOIN=1 wait at the job's
rendezvous (kerasdist/rendezvous/joining.py). Rank 0 asks the server at
each commit how many wait (`waiting()`); where any do, the request is
theirs (`{"join": N}`), `begin()` starts nothing (they run already) and
`finish()`'s re-form lets them in (kerasdist/_core/tcp_start.py,
rendezvous/reform.py): on any host that reaches the coordinator.

kerasdist.Trainer (kerasdist/trainer/trainer.py) takes the same steps at
its commits' steps; its new ranks' `Trainer.fit()` takes the commit and
its point from rank 0 where `joined()` is true.
"""

import ctypes
import json
import os
import stat
import sys
import threading
import time

from kerasdist import basics
from kerasdist._core import capi as _capi
from kerasdist._core import resize as _resize
from kerasdist._core import tcp_start as _tcp_start
from kerasdist.rendezvous import joining as _joining

REQUEST_NAME = "grow.json"  # kerasdist/run/grow.py's
GROWN_RANK_ENV = "KERASDIST_GROWN_RANK"  # kerasdist/run/_rank.py's
RECOVER_ENV = "KERASDIST_RECOVER_IN_PLACE"
ELASTIC_DIR_ENV = "KERASDIST_ELASTIC_DIR"

_joined = {"pending": GROWN_RANK_ENV in os.environ or
           _joining.wanted(os.environ)}


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
    if not os.path.lexists(path):
        return None
    why = trusted_request_file(path)
    if why:
        print(f"kerasdist.elastic: ignoring the grow request {path}: {why} "
              f"(a grow request names the commands the new ranks run, so "
              f"only the launcher's is taken: a regular file of this "
              f"user's that no other user can write)",
              file=sys.stderr, flush=True)
        return None
    try:
        with open(path) as f:
            body = json.load(f)
        os.remove(path)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("old_np") != basics.size() \
            or not (body.get("ranks") or body.get("leave")):
        return None
    return body


def trusted_request_file(path):
    """Why the grow request at `path` is not the launcher's to take (it
    names commands to run), or None: it must be a regular file (not a
    link), owned by this process's user, that no other user can write
    (the launcher writes it with mode 0600)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"it belongs to user {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o022:
        return f"other users can write it (mode {st.st_mode & 0o777:o})"
    return None


def request():
    """Every rank: the grow request rank 0 read, or None (see the module's
    doc); or a shrink request, which names the ranks that leave instead
    (kerasdist/_core/shrink.py). Collective in a job with recovery in
    place; None at once elsewhere."""
    if os.environ.get(RECOVER_ENV) != "1":
        return None
    body = None
    if basics.rank() == 0:
        body = _read_request()
        joiners = _tcp_start.joiners() if body is None else 0
        if joiners:
            body = {"join": joiners, "why": f"{joiners} process(es) asked "
                    f"to join"}
    if basics.size() > 1:
        from kerasdist.objects import broadcast_object
        body = broadcast_object(body, 0, name="kerasdist.elastic.grow")
    return body


# The grow under way on this rank: its thread, its request, MPI's error
# (None: none), when it began and at how many ranks.
_grow = {"thread": None}


def is_request(body):
    """Whether the in-place request `body` (request()'s) asks to grow: it
    names the ranks to start, or says that processes wait to join."""
    return isinstance(body, dict) and bool(body.get("ranks") or
                                           body.get("join"))


def waiting():
    """Whether processes wait to join this TCP job: rank 0 asks the
    rendezvous (every commit of a job that re-forms over TCP); False on
    the other ranks and elsewhere."""
    return basics.rank() == 0 and _tcp_start.joiners() > 0


def joinable():
    """Whether processes may join this job at its commits: it runs over
    TCP with recovery in place."""
    return _tcp_start.re_forms()


def begin(body):
    """Every rank, at the commit where the ranks agreed on a resize
    request (`body`: request()'s): starts growing as the launcher's
    request asks, in the background (the ranks go on training meanwhile);
    False where there is no grow request (the job then stops for a
    relaunch, or shrinks in place)."""
    if not is_request(body):
        return False
    ranks = [(r["argv"], r.get("info", []))
             for r in body.get("ranks", [])] if basics.rank() == 0 else []

    def spawn():
        if body.get("join"):
            # Over TCP the new processes started themselves and wait at
            # the rendezvous: finish()'s re-form lets them in.
            return
        try:
            _spawn(ranks)
        except RuntimeError as e:
            _grow["error"] = (str(e).strip().splitlines() or
                              ["MPI's error"])[0]

    thread = threading.Thread(target=spawn, name="kerasdist-grow",
                              daemon=True)
    _grow.update(thread=thread, body=body, error=None,
                 began=time.monotonic(), was=basics.size())
    _resize.served()
    if body.get("join"):
        _tcp_start.grow_next()
    thread.start()
    return True


def started():
    """Whether this rank is growing (begin() started, finish() not yet)."""
    return _grow["thread"] is not None


def spawning():
    """Whether this rank's part of the start of the new ranks still runs
    (they have not all joined yet)."""
    thread = _grow["thread"]
    return thread is not None and thread.is_alive()


def finish(state, log):
    """Every rank, at the first commit after the new ranks joined (or at
    the end of training): starts the runtime on the grown job, runs the
    state's reset callbacks and syncs the state to every rank, the new ones
    included; `log(line)` says so on rank 0. A failure to start the new
    ranks leaves the job at its size, said in one line; a failure after
    that ends this rank with one line (a relaunch resumes from the last
    commit on disk)."""
    _grow["thread"].join()
    grown, _grow["thread"] = dict(_grow), None
    stopped = time.monotonic()

    def reset():
        state.on_reset()
        state.sync()

    restart_or_end(reset, "kerasdist.elastic: growing in place failed")
    if basics.rank() != 0:
        return
    if grown["error"] is not None:
        log(f"growing in place failed ({grown['error']}); going on at "
            f"{grown['was']} rank(s)")
        return
    now = time.monotonic()
    started = "" if grown["body"].get("join") else (
        f"the new ranks started in {stopped - grown['began']:.2f} s while "
        f"the others trained, ")
    log(f"grew in place to {basics.size()} rank(s) (was {grown['was']}; "
        f"{grown['body'].get('why', 'the hosts changed')}): {started}the "
        f"job re-formed in {now - stopped:.2f} s, resuming from the last "
        f"commit")


def restart_or_end(then, failed, between=None):
    """Starts the runtime again on the job as it is now (shutdown, then
    init: after a lost rank the survivors, after a grow the merged job;
    `between()`, if given, runs in between: a shrink's split) and calls
    `then()`. Any failure on the way ends this rank at once with one line
    (end_rank). Used by growing (`finish`), shrinking
    (kerasdist/_core/shrink.py) and recovery in place
    (kerasdist.elastic.recover_in_place)."""
    try:
        basics.shutdown()
        if between is not None:
            between()
        basics.init()
        then()
    except Exception as e:
        end_rank(failed, e)


def end_rank(failed, error):
    """Ends this rank at once with one line, `failed: why; ending this
    rank (...)`: a relaunch resumes from the last commit on disk."""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    print(f"{failed}: {why}; ending this rank (a relaunch resumes from "
          f"the last commit on disk)", file=sys.stderr, flush=True)
    # At once, without atexit's shutdown and MPI_Finalize: the job's MPI
    # has lost ranks twice, and a normal exit here once hung for minutes in
    # the tests (1 run in about 10; where, not found).
    sys.stdout.flush()
    os._exit(1)


def joining():
    """Whether this rank joined a running job (grown in place) and has not
    taken the job's state yet (its first `hvd.elastic.run` syncs it): what
    it starts with is replaced by the job's (kd.shard_weights then skips
    its broadcast of the initial weights, which the old ranks do not
    run)."""
    return _joined["pending"] and os.environ.get(RECOVER_ENV) == "1"


def joined():
    """True once, in a rank that joined a running job (grown in place),
    at its first `hvd.elastic.run`."""
    pending, _joined["pending"] = _joined["pending"], False
    return pending and os.environ.get(RECOVER_ENV) == "1"
