"""The `kerasdist run` launcher: N ranks of a command under MPI's mpiexec.

A leaf package: standard library only, no TensorFlow, nothing else from
kerasdist, so that `kerasdist run` starts in milliseconds. Entry point:
kerasdist.run.launch.main. See docs/launcher.md.
"""
