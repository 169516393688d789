"""Environment variables that `kerasdist run` sets for every rank.

The names are fixed: the runtime reads them. Standard library only.
"""

import os.path

FUSION_THRESHOLD = "KERASDIST_FUSION_THRESHOLD"  # int bytes
CYCLE_TIME = "KERASDIST_CYCLE_TIME"  # float milliseconds
TIMELINE = "KERASDIST_TIMELINE"  # absolute file path
AUTOTUNE = "KERASDIST_AUTOTUNE"  # "1" when enabled
RESTART_ATTEMPT = "KERASDIST_RESTART_ATTEMPT"  # 0-based attempt number
MPI_HOME = "KERASDIST_MPI_HOME"  # read by the launcher only

MIB = 1024 * 1024


def build_env(
    attempt,
    fusion_threshold_mb=None,
    cycle_time_ms=None,
    timeline_filename=None,
    autotune=False,
    cwd=None,
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

    Returns:
        A dict of name -> string value, in a fixed order.
    """
    env = {}
    if fusion_threshold_mb is not None:
        env[FUSION_THRESHOLD] = str(int(round(fusion_threshold_mb * MIB)))
    if cycle_time_ms is not None:
        env[CYCLE_TIME] = repr(float(cycle_time_ms))
    if timeline_filename is not None:
        path = os.path.expanduser(timeline_filename)
        if cwd is not None:
            path = os.path.join(cwd, path)
        env[TIMELINE] = os.path.abspath(path)
    if autotune:
        env[AUTOTUNE] = "1"
    env[RESTART_ATTEMPT] = str(attempt)
    return env
