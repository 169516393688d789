"""Framework-free internals: the ctypes binding of the core's C API
(`capi`), collectives on numpy arrays through the core (`host`), the
gradient helpers every Keras backend shares (`gradients`); and what
`kd.init()`, the launcher and the tools share, standard library only: the
process API's one list of names (`process_api`), the build's record and
checks (`build_check`, `site_mpi`: the MPI built against), files written
whole (`files`), a rank's side of resizes (`resize`), Ray's worker
check (`ray_worker`) and Keras' backend read without Keras
(`keras_backend`)."""
