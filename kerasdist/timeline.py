"""Record a timeline of the runtime's work: a Chrome trace written by rank 0.

The timeline has one row per tensor and a bar for each phase it goes through
(NEGOTIATE, QUEUE, MEMCPY_IN_FUSION_BUFFER, ALLREDUCE and the other
collectives, MEMCPY_OUT_FUSION_BUFFER). Open it in chrome://tracing or
https://ui.perfetto.dev, or read it with `kerasdist timeline summarize FILE`.

Start it for a whole job with `kerasdist run --timeline-filename trace.json`
(or `KERASDIST_TIMELINE=trace.json`), or for part of a run from Python:

    with kerasdist.timeline.timeline("trace.json"):
        model.fit(x, y, epochs=1)
"""

import contextlib
import ctypes
import os
import threading

from kerasdist._core import capi as _capi

_bound = False
_bind_lock = threading.Lock()


def _lib():
    global _bound
    lib = _capi.lib()
    with _bind_lock:
        if not _bound:
            try:
                lib.kerasdist_start_timeline.argtypes = [ctypes.c_char_p,
                                                         ctypes.c_int]
                lib.kerasdist_start_timeline.restype = ctypes.c_int
                lib.kerasdist_stop_timeline.argtypes = []
                lib.kerasdist_stop_timeline.restype = ctypes.c_int
            except AttributeError as e:
                raise RuntimeError(
                    "this build of kerasdist's native library has no "
                    "timeline (kerasdist_start_timeline is missing); rebuild "
                    "it with `make -C ops`.") from e
            _bound = True
    return lib


def _require_init(what):
    if not _capi.lib().kerasdist_is_initialized():
        raise RuntimeError(f"{what}: kerasdist is not initialized; call "
                           "kerasdist.init() first.")


def start_timeline(path, mark_cycles=False):
    """Starts writing a timeline of the runtime's work to `path`.

    Every rank calls it (it is cheap where it does nothing); only rank 0
    writes. The file is a JSON array of Chrome trace events, valid JSON after
    every flush (at least once a second), so a job that is killed leaves a
    readable trace. Starting again while a timeline runs closes the old file
    and opens the new one.

    Args:
        path: the file to write (created or overwritten on rank 0).
        mark_cycles: True to add a marker for every cycle of the runtime's
            background loop (useful to see batching; makes the file larger).

    Raises:
        RuntimeError: kerasdist is not initialized, or the runtime could not
            open the file (the message says why).
        TypeError: `path` is not a string or path-like.

    Example:
    >>> import kerasdist as kd
    >>> kd.init()
    >>> kd.timeline.start_timeline("trace.json")
    >>> kd.allreduce(tf.ones([4]), name="x")
    >>> kd.timeline.stop_timeline()
    """
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"start_timeline: path must be a str, got "
                        f"{type(path).__name__}.")
    if not path:
        raise ValueError("start_timeline: path must not be empty.")
    _require_init("start_timeline")
    lib = _lib()
    if lib.kerasdist_start_timeline(path.encode(), int(bool(mark_cycles))):
        raise RuntimeError(f"start_timeline({path!r}) failed: "
                           f"{_capi.last_error()}")


def stop_timeline():
    """Stops the timeline, flushing and closing its file.

    Does nothing when no timeline is running.

    Raises:
        RuntimeError: kerasdist is not initialized, or the file could not be
            written.

    Example:
    >>> kd.timeline.stop_timeline()
    """
    _require_init("stop_timeline")
    if _lib().kerasdist_stop_timeline():
        raise RuntimeError(f"stop_timeline() failed: {_capi.last_error()}")


@contextlib.contextmanager
def timeline(path, mark_cycles=False):
    """A context manager that records a timeline of its body.

    Args:
        path: the trace file (written by rank 0).
        mark_cycles: as in `start_timeline`.

    Yields:
        `path`.

    Raises:
        RuntimeError: as `start_timeline`.

    Example:
    >>> with kd.timeline.timeline("fit.json"):
    ...     model.fit(x, y, epochs=1)
    """
    start_timeline(path, mark_cycles=mark_cycles)
    try:
        yield path
    finally:
        stop_timeline()
