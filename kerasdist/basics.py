"""Process-level API: init, shutdown and the topology queries."""

import atexit
import ctypes
import os
import sys
import threading

from kerasdist import autotune
from kerasdist._core import capi as _capi
from kerasdist._core import keras_backend
from kerasdist._core import ray_worker as _ray_worker
from kerasdist._core import resize as _resize
from kerasdist._core import site_mpi
from kerasdist._core import tcp_start as _tcp_start
from kerasdist.rendezvous import client
from kerasdist.rendezvous import conventions
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import watch

# Reduction ops: the core's values (ops/core/types.h; Horovod's numbering),
# asked from the library. Adasum is Horovod's: allreduce of float16/32/64 on
# a power-of-two number of ranks (ops/core/backends/adasum_backend.cc).
_reduce_ops = _capi.reduce_ops()
Average, Sum, Adasum = (_reduce_ops[k] for k in ("Average", "Sum", "Adasum"))
Min, Max, Product = (_reduce_ops[k] for k in ("Min", "Max", "Product"))

_atexit_registered = False
# The job this process joined at a coordinator (_join_launch): MPI, once
# started, serves every later init() of this process.
_joined = None
_lock = threading.Lock()
_uncaught = False  # the main thread ended with an uncaught exception


def _keywords():
    """init() keyword -> the setting it overrides (ops/core/config.cc)."""
    return {s.key: s.name for s in _capi.settings_table() if s.in_init}


def _format(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def init(comm=None, verbose=False, process_sets=None, **settings):
    """Starts kerasdist on this process.

    Every rank of the job calls it once, before any collective. Calling it
    again while running does nothing; after `shutdown()` it starts afresh,
    on the same job (MPI starts once a process).

    Under an MPI launcher (`kerasdist run`, `mpiexec`) MPI starts from it.
    Processes started by a platform (torchrun's `RANK`, `WORLD_SIZE`,
    `MASTER_ADDR`, `MASTER_PORT`, or Keras' `KERAS_DISTRIBUTION_*`) first
    meet at the coordinator and then start MPI as one job (see
    docs/platforms.md, "Without `kerasdist run`"). In a job that grows and
    shrinks (`kerasdist run --host-discovery-script`) it also installs a
    SIGUSR1 handler that notes the launcher's resize request, for the
    Trainer (docs/failures-and-elastic.md, "Growing and shrinking").

    Args:
        comm: an mpi4py communicator whose ranks form the job (default: all
            processes, `MPI.COMM_WORLD`).
        verbose: every rank prints one line to stderr once started: the
            launch convention found, its rank, size, local rank and local
            size, the coordinator, and the data paths (backends) chosen.
            Without it rank 0 alone prints that line, and only for a job
            that met at a coordinator (not under an MPI launcher).
        process_sets: Horovod's process sets to add once started (a list
            of `kerasdist.ProcessSet`, each then has its `process_set_id`),
            or "dynamic" (accepted for Horovod's code: sets can always be
            added and removed later, see kerasdist/process_sets.py).
        **settings: runtime settings that override the `KERASDIST_*`
            environment variables: `fusion_threshold` (bytes),
            `cycle_time_ms`, `cache_capacity`, `stall_check_time_seconds`,
            `stall_shutdown_time_seconds`, `deadlock_shutdown_time_seconds`,
            `timeline`, `timeline_mark_cycles`,
            `autotune`, `autotune_log`, `log_level`, `shm_allreduce`,
            `shm_allreduce_min_bytes`, `cma_allreduce`,
            `cma_min_tensor_bytes` (the "`init()` keyword" column of
            docs/env_vars.md).

    Raises:
        ValueError: for an unknown setting or a malformed value, or a
            launch convention's variable missing, malformed or disagreeing.
        RuntimeError: if MPI cannot be started, or the processes did not
            meet within KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS.

    Example:
    >>> import kerasdist as kd
    >>> kd.init()
    >>> print(kd.rank(), kd.size())
    """
    global _atexit_registered, _joined
    keywords = _keywords()
    unknown = sorted(set(settings) - set(keywords))
    if unknown:
        raise ValueError(f"init() got unknown settings {unknown}; expected "
                         f"some of {sorted(keywords)}.")
    overrides = "\n".join(f"{keywords[k]}={_format(v)}"
                          for k, v in settings.items() if v is not None)
    comm_f = 0
    if comm is not None:
        if not hasattr(comm, "py2f"):
            raise TypeError("init(comm=...) expects an mpi4py communicator, "
                            f"got {type(comm).__name__}.")
        comm_f = comm.py2f()
    # The core parses the settings (the environment's and these) as init
    # would, so a malformed one is a ValueError naming the variable.
    _capi.resolve_settings(overrides)
    lib = _capi.lib()
    with _lock:
        pmi_env, launch, tcp = {}, None, None
        if comm is None and not is_initialized():
            launch, pmi_env = _join_launch(lib)
            tcp = _tcp_start.prepare(lib, launch, pmi_env)
        starting = not is_initialized()
        saved = {k: os.environ.get(k) for k in pmi_env if not tcp}
        os.environ.update({k: v for k, v in pmi_env.items() if k in saved})
        failed = True
        try:
            failed = lib.kerasdist_init(int(comm is not None), comm_f,
                                        overrides.encode()) != 0
        finally:
            # MPI has read them; processes this one starts must not.
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if tcp:  # the meshes formed (or failed): the server is done
                tcp.done(formed=not failed)
        if failed:
            raise RuntimeError(
                f"kerasdist.init() failed: {_capi.last_error()}")
        if pmi_env:
            # Started, the heartbeat watching: from here on it, not the
            # rendezvous, reports a rank that ends (watch.started).
            watch.started()
            _joined = launch
        # After a recovery or a shrink in place the job is the survivors,
        # fewer than the launcher started; after growing in place, more.
        if launch is not None and not lib.kerasdist_recoveries() and \
                not lib.kerasdist_grows() and not lib.kerasdist_shrinks() \
                and not _tcp_start.generation():
            wrong = site_mpi.check_size(launch, size(), _mpi_loaded(lib),
                                        os.environ)
            if wrong:
                raise RuntimeError(f"kerasdist.init() failed: {wrong}")
        if starting:
            _learn_homogeneity()
        if launch is not None and (verbose or (
                pmi_env and launch.coordinator is not None
                and rank() == 0)):
            sys.stderr.write(f"kerasdist: {started_line(launch)}\n")
            sys.stderr.flush()
        elif (starting and launch is not None
              and launch.convention == "single" and size() == 1):
            sys.stderr.write(_job_of_one_hint())
            sys.stderr.flush()
        if not _atexit_registered:
            atexit.register(_at_exit)
            sys.excepthook = _noting_uncaught(sys.excepthook)
            _atexit_registered = True
    # In a job that grows and shrinks (`kerasdist run
    # --host-discovery-script`): note the launcher's resize requests.
    _resize.install()
    if starting:
        _add_init_process_sets(process_sets)
        _large_blocks_on_keras_torch()
    autotune.maybe_start()


def _large_blocks_on_keras_torch():
    """On Keras' PyTorch backend, has glibc serve blocks of 1 MiB or more
    from mmap from here on, as a DistributedOptimizer does once made
    (kerasdist/keras/sharding/malloc.py). Made after the model, it was too
    late for the model's build: the initializers' freed blocks stayed in
    glibc's heap, which the step did not reuse, a second copy of the
    weights (4 bytes a parameter) resident for good. Not on the other
    backends: TensorFlow's build leaves none, and on JAX the threshold
    slows the step (kerasdist/keras/optimizer.py). Keras' backend is read
    as Keras will choose it (KERAS_BACKEND, else keras.json), without
    importing Keras."""
    backend, _ = keras_backend.active_backend(os.environ)
    if backend == "torch":
        from kerasdist.keras.sharding.malloc import return_large_blocks
        return_large_blocks()


# Called with init()'s `process_sets` once the core has started
# (kerasdist/process_sets.py registers itself when imported: a ProcessSet
# passed to init() comes from there).
_process_set_hooks = []


def add_init_hook(hook):
    """Registers `hook(process_sets)`, called by `init()` once started
    (kerasdist/process_sets.py: Horovod's `init(process_sets=...)`)."""
    if hook not in _process_set_hooks:
        _process_set_hooks.append(hook)


def _add_init_process_sets(process_sets):
    if process_sets is None or process_sets == "dynamic":
        for hook in _process_set_hooks:
            hook(None)
        return
    if not _process_set_hooks:
        raise TypeError("init(process_sets=...) takes a list of "
                        "kerasdist.ProcessSet objects or \"dynamic\"; got "
                        f"{process_sets!r}.")
    for hook in _process_set_hooks:
        hook(process_sets)


def _join_launch(lib):
    """Reads the launch convention (kerasdist/rendezvous/conventions.py);
    where a platform rather than an MPI launcher started the job, meets the
    other processes at its coordinator (kerasdist/rendezvous/client.py) and
    returns the PMI variables for MPI_Init: (launch, {name: value}), {}
    where there is nothing to join."""
    joiner = _tcp_start.join_launch(_joined)  # KERASDIST_JOIN=1
    if joiner is not None:
        return joiner
    launch = conventions.detect(os.environ)
    tcp = _tcp_start.check(launch, _joined)  # KERASDIST_TRANSPORT=tcp
    # The MPI kerasdist was built against must speak the launcher's
    # protocol (kerasdist/_core/site_mpi.py): one line, not MPI_Init's abort
    # or a job of one on every process.
    wrong = (site_mpi.check_launch(os.environ) if launch.convention == "mpi"
             else site_mpi.check_rendezvous(launch.convention)
             if launch.coordinator is not None and not tcp else None)
    if wrong:
        raise RuntimeError(f"kerasdist.init() failed: {wrong}")
    if launch.convention == "single" and _ray_worker.in_ray_worker():
        # A Ray Train worker group without kerasdist's backend would train
        # as jobs of one, each alone (kerasdist/ray.py).
        _ray_worker.check_no_convention()
    if launch.coordinator is None:
        return launch, {}
    if _joined is not None:
        # init() after shutdown(): MPI still runs the job this process
        # joined (MPI starts once a process), so there is nothing to meet.
        if launch == _joined:
            return launch, {}
        raise RuntimeError(
            f"kerasdist.init(): this process already joined the "
            f"{_joined.convention} job of {_joined.size} as rank "
            f"{_joined.rank} (coordinator {_joined.coordinator}); MPI "
            f"starts once a process, so it cannot join the "
            f"{launch.convention} job of {launch.size} as rank "
            f"{launch.rank}. Start a new process for the other job.")
    mpi_started = ctypes.c_int(0)
    lib.MPI_Initialized(ctypes.byref(mpi_started))
    if mpi_started.value and not tcp:
        raise RuntimeError(
            f"kerasdist.init(): MPI was started before it (importing "
            f"mpi4py.MPI starts it), as a job of one, so this process "
            f"cannot join the {launch.convention} job of {launch.size}; "
            f"call kerasdist.init() before importing mpi4py.MPI.")
    timeout = protocol.timeout_from(os.environ)
    try:
        return launch, client.join(launch, timeout)
    except protocol.RendezvousError as e:
        raise RuntimeError(f"kerasdist.init() failed: {e}") from None


def _job_of_one_hint():
    """The line for a process started with no launcher at all: it trains
    alone, which is right for a try-out and a surprise otherwise."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") \
        else "train.py"
    return ("kerasdist: no launcher started this process, so it runs as a "
            "job of one; to train on N processes run `kerasdist run -np N "
            f"python {script}`.\n")


def _mpi_loaded(lib):
    """The first line of MPI_Get_library_version of the libmpi loaded."""
    for line in lib.kerasdist_build_info().decode().splitlines():
        if line.startswith("mpi_library="):
            return line.split("=", 1)[1].strip()
    return "?"


def started_line(launch):
    """The started job's line: the launch convention, rank and size as the
    runtime holds them, local rank and size (MPI's shared-memory split, not
    the convention's), the coordinator, and the backends in the order the
    runtime tries them."""
    started = launch._replace(rank=rank(), size=size(),
                              local_rank=local_rank(),
                              local_size=local_size())
    backends = _capi.lib().kerasdist_backends().decode()
    return (f"{conventions.describe(started)}; backends, first enabled "
            f"wins: {backends}")


# In the runtime's message (ops/core/controller.cc) when it failed every
# rank's collectives because none of them could ever run.
_DEADLOCK_TEXT = "deadlock: every rank is waiting for collectives"


def _noting_uncaught(hook):
    def excepthook(exc_type, exc, tb):
        global _uncaught
        _uncaught = True
        if _DEADLOCK_TEXT in str(exc):
            # Rank 0 has printed why in one line (and `kerasdist run`
            # repeats it last); each rank's traceback through Keras and the
            # framework would only bury it.
            sys.stderr.write(_deadlock_exit_line(tb))
            sys.stderr.flush()
            return
        hook(exc_type, exc, tb)
    return excepthook


def _deadlock_exit_line(tb):
    """One line for a rank that dies of the deadlock error: where in the
    user's code (the innermost frame outside kerasdist and installed or
    standard-library packages) the collective was waited for."""
    import sysconfig
    import traceback
    skip = [os.path.dirname(os.path.abspath(__file__))]
    skip += [p for p in {sysconfig.get_path("stdlib"),
                         sysconfig.get_path("purelib"),
                         sysconfig.get_path("platlib")} if p]
    where = ""
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or any(
                path.startswith(p + os.sep) for p in skip):
            continue
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno}"
    return (f"kerasdist: a collective failed{where}: the job is "
            "deadlocked, as rank 0's deadlock message says (traceback left "
            "out).\n")


def _at_exit():
    """Shuts down at exit; after an uncaught exception, ends the process.

    A rank that dies of an exception must not wait for the others: they may
    be inside a collective (kerasdist's or mpi4py's) waiting for it, and
    MPI's finalize waits for them, so nobody would ever leave. Ending the
    process at once (after the traceback, and after the atexit handlers
    registered later than `init()`) lets the launcher see the failure and
    stop the job.
    """
    if _uncaught and is_initialized() and size() > 1:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)
    shutdown()


def shutdown():
    """Stops the runtime; pending collectives fail. `init()` may follow.

    A running autotuner (started by `init()` or by `start_autotune()`) is
    stopped first: it cannot outlive the runtime it tunes.
    """
    autotune.stop_autotune()
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


def current_settings():
    """The running runtime's effective settings, as a dict of strings.

    Every `KERASDIST_*` setting (docs/env_vars.md) maps to its value as the
    runtime holds it (booleans as "1" or "0"); {} before `init()`.
    """
    return _capi.current_settings()


# ---- Horovod's job probes (build probes: kerasdist/build_probes.py) ---------

# MPI_THREAD_MULTIPLE in mpi.h: 3 in MPICH (which the core links) and Open MPI.
_MPI_THREAD_MULTIPLE = 3
_homogeneous = None  # learnt by init()


def _learn_homogeneity():
    """Learns, once per `init()`, whether every host runs as many ranks:
    one small allgather of the local sizes, which every rank of the job
    makes inside `init()` (so `is_homogeneous()` is a local query)."""
    global _homogeneous
    n = size()
    if n == 1:
        _homogeneous = True
        return
    mine = ctypes.c_int64(local_size())
    h = _capi.Handle(_capi.OP_ALLGATHER, "kerasdist.init.local_sizes",
                     _capi.DTYPES[_int64()], (1,),
                     ctypes.c_void_p(ctypes.addressof(mine)), None)
    h.wait()
    ptr, shape = h.output()
    if tuple(shape) != (n,) or not ptr:  # pragma: no cover
        raise RuntimeError(f"kerasdist.init(): the local sizes came back "
                           f"with shape {list(shape)}, expected [{n}].")
    sizes = list((ctypes.c_int64 * n).from_address(ptr))  # h still holds it
    _homogeneous = len(set(sizes)) == 1


def _int64():
    import numpy as np
    return np.dtype(np.int64)


def mpi_enabled():
    """True while the runtime runs, on MPI (every kerasdist job does);
    False before `init()` and after `shutdown()`."""
    return is_initialized()


def gloo_enabled():
    """False: no kerasdist job runs on Gloo."""
    return False


def mpi_threads_supported():
    """True if MPI runs with MPI_THREAD_MULTIPLE, so that other MPI users
    in the process (mpi4py) may call MPI next to kerasdist's thread.

    Raises:
        RuntimeError: if kerasdist is not initialized.
    """
    if not is_initialized():
        raise RuntimeError(
            "kerasdist is not initialized; call kerasdist.init() before "
            "kerasdist.mpi_threads_supported().")
    level = ctypes.c_int(-1)
    _capi.lib().MPI_Query_thread(ctypes.byref(level))
    return level.value >= _MPI_THREAD_MULTIPLE


def is_homogeneous():
    """True if every host of the job runs the same number of ranks (as
    `local_size()` counts them), learnt from all hosts during `init()`.

    Raises:
        RuntimeError: if kerasdist is not initialized.
    """
    if not is_initialized():
        raise RuntimeError(
            "kerasdist is not initialized; call kerasdist.init() before "
            "kerasdist.is_homogeneous().")
    return _homogeneous
