"""Environment variables that `kerasdist run` sets for every rank.

The runtime reads them, and their names belong to its settings table
(ops/core/config.cc). The launcher asks the core library for them through
`kerasdist._core.capi` (ctypes; it imports neither TensorFlow nor numpy) instead
of keeping a copy: loading the library costs tens of milliseconds once per
launch, where TensorFlow would cost seconds, and is done only when the ranks'
environment is built (not for `--help` or a bad flag).
"""

import os.path

MPI_HOME = "KERASDIST_MPI_HOME"  # read by the launcher only, not the runtime

MIB = 1024 * 1024

# The launcher flag behind each setting it sets, by the setting's key
# (build_env below; docs/env_vars.md's "launcher flag" column).
LAUNCHER_FLAGS = {
    "fusion_threshold": "--fusion-threshold-mb",
    "cycle_time_ms": "--cycle-time-ms",
    "timeline": "--timeline-filename",
    "autotune": "--autotune",
    "restart_attempt": "--max-restarts",
    "network_interface": "--network-interface",
}


def _name(key):
    """The variable of the core's setting `key` (e.g. "cycle_time_ms").

    Raises:
        ImportError: the core library is not built (the message says how).
    """
    # loads the core library: see above
    from kerasdist._core import capi as _capi

    return _capi.setting_name(key)


def build_env(
    attempt,
    fusion_threshold_mb=None,
    cycle_time_ms=None,
    timeline_filename=None,
    autotune=False,
    cwd=None,
    network_interface=None,
):
    """Returns the KERASDIST_* variables for every rank of one attempt.

    Args:
        attempt: 0-based attempt number (restarts count up from 0).
        fusion_threshold_mb: fusion buffer size in MiB (float allowed), or
            None to leave the runtime's default.
        cycle_time_ms: cycle time in milliseconds, or None.
        timeline_filename: timeline path, made absolute against `cwd`
            (the launcher's working directory when None), or None.
        autotune: whether to set KERASDIST_AUTOTUNE=1.
        cwd: the directory a relative timeline path is relative to.
        network_interface: the interface rank 0's heartbeat is reached
            at first (--network-interface), or None.

    Returns:
        A dict of name -> string value, in a fixed order.
    """
    env = {}
    if fusion_threshold_mb is not None:
        env[_name("fusion_threshold")] = str(
            int(round(fusion_threshold_mb * MIB)))
    if cycle_time_ms is not None:
        env[_name("cycle_time_ms")] = repr(float(cycle_time_ms))
    if timeline_filename is not None:
        path = os.path.expanduser(timeline_filename)
        if cwd is not None:
            path = os.path.join(cwd, path)
        env[_name("timeline")] = os.path.abspath(path)
    if autotune:
        env[_name("autotune")] = "1"
    if network_interface:
        env[_name("network_interface")] = network_interface
    env[_name("restart_attempt")] = str(attempt)
    return env
