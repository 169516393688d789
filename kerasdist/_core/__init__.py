"""Framework-free internals: the ctypes binding of the core's C API
(`capi`), collectives on numpy arrays through the core (`host`), and the
gradient helpers every Keras backend shares (`gradients`)."""
