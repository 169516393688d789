"""The `kerasdist run` launcher: N ranks of a command under MPI's mpiexec.

A leaf package: standard library only, no TensorFlow; from the rest of
kerasdist it uses only `kerasdist._core.capi` (ctypes) to learn the settings'
names from the core library, so that `kerasdist run` starts in milliseconds.
Entry point: kerasdist.run.launch.main. See docs/launcher.md.
"""
