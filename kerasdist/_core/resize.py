"""A rank's side of growing and shrinking jobs (private).

`kerasdist run --host-discovery-script` sets KERASDIST_ELASTIC=1 for every
rank and, when the hosts it lists change, sends SIGUSR1 to the ranks (see
kerasdist/run/resize.py). kd.init() then installs `install()`'s handler,
which only notes the request; the Trainer checks it at its checkpoint
boundaries, where all ranks agree on it, write a checkpoint and exit with
RESIZE_EXIT_CODE (raising `Resize`). A program that does not check never
sees more of it than a flag set.

The names below are the launcher's (kerasdist/run/_rank.py), copied: the
rank side may not import the launcher. A unit test holds them equal.
Standard library only.
"""

import atexit
import os
import signal
import sys
import threading

ELASTIC_ENV = "KERASDIST_ELASTIC"
RESIZE_EXIT_CODE = 76
RESIZABLE_MARKER = b"\x1ekerasdist-resizable"
GROWS_IN_PLACE_WORD = b" grows=in-place"
SHRINKS_IN_PLACE_WORD = b" shrinks=in-place"
PROGRESS_MARKER = b"\x1ekerasdist-progress"
MARKERS_READ_ENV = "KERASDIST_MARKERS_READ"
RANK_MARKER_TOKEN_ENV = "KERASDIST_RANK_MARKER_TOKEN"

_state = {"installed": False, "requested": False, "announced": False}


class Resize(SystemExit):
    """Ends the process with RESIZE_EXIT_CODE after the Trainer wrote the
    checkpoint the job resumes from at its new size. A SystemExit, so
    `except Exception` does not catch it and no traceback is printed."""

    def __init__(self):
        super().__init__(RESIZE_EXIT_CODE)


def elastic(environ=None):
    """Whether the launcher runs this job as an elastic one."""
    return (os.environ if environ is None else environ).get(
        ELASTIC_ENV) == "1"


def install():
    """Installs the SIGUSR1 handler that notes a resize request, in an
    elastic job and on the main thread (where Python runs handlers);
    a handler of the program's own is called after it. Returns whether
    the handler is installed."""
    if _state["installed"]:
        return True
    if not elastic() or threading.current_thread() is not \
            threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGUSR1)

    def note(signum, frame):
        _state["requested"] = True
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGUSR1, note)
    # A request that comes while the interpreter shuts down (the training
    # done, Python's handlers already reset to the default action) would
    # kill a rank that finished: from then on there is nothing to stop.
    atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)
    _state["installed"] = True
    return True


def checking():
    """Whether resize requests reach this process (see install)."""
    return _state["installed"]


def requested():
    """Whether the launcher asked this rank to stop for a resize."""
    return _state["requested"]


def served():
    """The request was served in place (the job grew without stopping):
    the next one is a new request."""
    _state["requested"] = False


def announce(rank, grows_in_place=False, shrinks_in_place=None):
    """Tells the launcher, once, that this rank checks for resize requests
    (one marker line on stderr, which the launcher removes), and with
    `grows_in_place` that it grows in place under --recover-in-place
    (`hvd.elastic.run`: kerasdist/_core/grow.py); without it the launcher
    grows the job by a relaunch. `shrinks_in_place` (by default
    `grows_in_place`): that it shrinks in place
    (kerasdist/_core/shrink.py; the Trainer and `hvd.elastic.run` say
    both); without it a shrink is a relaunch."""
    if _state["announced"]:
        return
    _state["announced"] = True
    if shrinks_in_place is None:
        shrinks_in_place = grows_in_place
    words = (GROWS_IN_PLACE_WORD.decode() if grows_in_place else "") + \
        (SHRINKS_IN_PLACE_WORD.decode() if shrinks_in_place else "")
    try:
        sys.stderr.flush()
        os.write(2, RESIZABLE_MARKER +
                 f" rank={rank}{words}{_token()}\n".encode())
    except OSError:
        pass


def report_progress():
    """Tells the launcher that this rank saved progress the job's next
    attempt resumes from (a checkpoint, an elastic commit): one marker line
    on stderr, which the launcher removes. An attempt that fails after it
    is restarted at once, and its error is not taken for one a restart
    would only repeat. Outside `kerasdist run` nothing reads the line, so
    it is written only where the launcher's per-rank wrapper says it reads
    markers."""
    if os.environ.get(MARKERS_READ_ENV) != "1":
        return
    try:
        sys.stderr.flush()
        os.write(2, PROGRESS_MARKER + f"{_token()}\n".encode())
    except OSError:
        pass


def _token():
    """" token=..." of the launcher's job, which the launcher checks: a
    line the program prints cannot pass for a marker."""
    return f" token={os.environ.get(RANK_MARKER_TOKEN_ENV, '')}"
