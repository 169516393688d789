"""Process-level API: init, shutdown and the topology queries."""

import atexit
import threading

from kerasdist import _capi

# Reduction ops (the core's values; Horovod's numbering without Adasum).
Average = 0
Sum = 1
Min = 3
Max = 4
Product = 5

_OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max",
             Product: "Product"}
_atexit_registered = False
_lock = threading.Lock()

# init() keyword -> the runtime setting it overrides (ops/core/config.cc).
_SETTINGS = {
    "fusion_threshold": "KERASDIST_FUSION_THRESHOLD",
    "cycle_time_ms": "KERASDIST_CYCLE_TIME",
    "cache_capacity": "KERASDIST_CACHE_CAPACITY",
    "stall_check_time_seconds": "KERASDIST_STALL_CHECK_TIME_SECONDS",
    "stall_shutdown_time_seconds": "KERASDIST_STALL_SHUTDOWN_TIME_SECONDS",
    "timeline": "KERASDIST_TIMELINE",
    "timeline_mark_cycles": "KERASDIST_TIMELINE_MARK_CYCLES",
    "autotune": "KERASDIST_AUTOTUNE",
    "autotune_log": "KERASDIST_AUTOTUNE_LOG",
    "log_level": "KERASDIST_LOG_LEVEL",
    "shm_allreduce": "KERASDIST_SHM_ALLREDUCE",
    "shm_allreduce_min_bytes": "KERASDIST_SHM_ALLREDUCE_MIN_BYTES",
    "cma_allreduce": "KERASDIST_CMA_ALLREDUCE",
    "cma_min_tensor_bytes": "KERASDIST_CMA_MIN_TENSOR_BYTES",
}


def _format(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def init(comm=None, **settings):
    """Starts kerasdist on this process.

    Every rank of the job calls it once, before any collective. Calling it
    again while running does nothing; after `shutdown()` it starts afresh.

    Args:
        comm: an mpi4py communicator whose ranks form the job (default: all
            processes, `MPI.COMM_WORLD`).
        **settings: runtime settings that override the `KERASDIST_*`
            environment variables: `fusion_threshold` (bytes),
            `cycle_time_ms`, `cache_capacity`, `stall_check_time_seconds`,
            `stall_shutdown_time_seconds`, `timeline`, `timeline_mark_cycles`,
            `autotune`, `autotune_log`, `log_level`.

    Raises:
        ValueError: for an unknown setting or a malformed value.
        RuntimeError: if MPI cannot be started.

    Example:
    >>> import kerasdist as kd
    >>> kd.init()
    >>> print(kd.rank(), kd.size())
    """
    global _atexit_registered
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise ValueError(f"init() got unknown settings {unknown}; expected "
                         f"some of {sorted(_SETTINGS)}.")
    lines = [f"{_SETTINGS[k]}={_format(v)}" for k, v in settings.items()
             if v is not None]
    comm_f = 0
    if comm is not None:
        if not hasattr(comm, "py2f"):
            raise TypeError("init(comm=...) expects an mpi4py communicator, "
                            f"got {type(comm).__name__}.")
        comm_f = comm.py2f()
    lib = _capi.lib()
    with _lock:
        if lib.kerasdist_init(int(comm is not None), comm_f,
                              "\n".join(lines).encode()) != 0:
            message = _capi.last_error()
            if "expected" in message or "unknown setting" in message:
                raise ValueError(message)
            raise RuntimeError(f"kerasdist.init() failed: {message}")
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    from kerasdist import autotune  # numpy/scikit-learn only when asked for
    autotune.maybe_start()


def shutdown():
    """Stops the runtime; pending collectives fail. `init()` may follow."""
    import sys
    autotune = sys.modules.get("kerasdist.autotune")
    if autotune is not None:
        autotune.stop_autotune()
    if _capi._lib is not None or _capi.os.path.exists(_capi.library_path()):
        _capi.lib().kerasdist_shutdown()


def is_initialized():
    """True between `init()` and `shutdown()`."""
    return bool(_capi.lib().kerasdist_is_initialized())


def _query(name):
    value = getattr(_capi.lib(), "kerasdist_" + name)()
    if value < 0:
        raise RuntimeError(
            f"kerasdist is not initialized; call kerasdist.init() before "
            f"kerasdist.{name}().")
    return value


def rank():
    """This process's rank in [0, size())."""
    return _query("rank")


def size():
    """Number of ranks in the job."""
    return _query("size")


def local_rank():
    """Rank among the processes on this machine (use it to pick a GPU)."""
    return _query("local_rank")


def local_size():
    """Number of ranks on this machine."""
    return _query("local_size")


def cross_rank():
    """Index of this machine among the machines (for local_rank 0 processes)."""
    return _query("cross_rank")


def cross_size():
    """Number of machines (ranks that share this local_rank)."""
    return _query("cross_size")


def mpi_built():
    """True: the MPI backend is always built."""
    return bool(_capi.lib().kerasdist_mpi_built())


def nccl_built():
    """True if the library was built with the NCCL (GPU) backend."""
    return bool(_capi.lib().kerasdist_nccl_built())


def build_info():
    """Versions and backends the native library was built with, as a dict."""
    info = dict(line.split("=", 1) for line in
                _capi.text("build_info").splitlines() if "=" in line)
    return info


def current_settings():
    """The running runtime's effective settings, as a dict of strings."""
    return dict(line.split("=", 1) for line in
                _capi.text("current_config").splitlines() if "=" in line)
