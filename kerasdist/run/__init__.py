"""The `kerasdist run` launcher: N ranks of a command under MPI's mpiexec.

A leaf package: standard library only, no TensorFlow; from the rest of
kerasdist it uses only `kerasdist._core.capi` (ctypes) to learn the settings'
names from the core library, `kerasdist._core.site_mpi` (the MPI built
against) and the rendezvous' protocol (the job's secret), so that
`kerasdist run` starts in milliseconds. The rendezvous that ranks started
without mpiexec join is kerasdist/rendezvous/.
Entry point: kerasdist.run.launch.main. See docs/launcher.md.
"""

import types as _types


class _CallableLauncher(_types.ModuleType):
    """`kerasdist.run` is the launcher's package and, called, Horovod's
    `horovod.run`: `kerasdist.run(fn, np=2)` (kerasdist/run/function.py)."""

    def __call__(self, fn, *args, **kwargs):
        from kerasdist.run import function
        return function.run(fn, *args, **kwargs)


# This package, as the import system holds it (a package may import itself
# while it initialises), made callable.
import kerasdist.run as _this  # noqa: E402

_this.__class__ = _CallableLauncher
del _this
