"""The process API: the names every kerasdist namespace (`kerasdist`,
`kerasdist.tensorflow`, `kerasdist.jax`, `kerasdist.torch`) exports beside
its collectives, each with the module that defines it. The one list of
them; imports nothing on its own, so `import kerasdist` stays light.
"""

# public name -> the kerasdist module that defines it
PROCESS_API = {
    # The job, and Horovod's job probes.
    "init": "basics", "shutdown": "basics", "is_initialized": "basics",
    "rank": "basics", "size": "basics", "local_rank": "basics",
    "local_size": "basics", "cross_rank": "basics", "cross_size": "basics",
    "gloo_enabled": "basics", "is_homogeneous": "basics",
    "mpi_enabled": "basics", "mpi_threads_supported": "basics",
    # The reduction operations.
    "Average": "basics", "Sum": "basics", "Min": "basics", "Max": "basics",
    "Product": "basics", "Adasum": "basics",
    # Horovod's build probes.
    "mpi_built": "build_probes", "nccl_built": "build_probes",
    "ccl_built": "build_probes", "cuda_built": "build_probes",
    "ddl_built": "build_probes", "gloo_built": "build_probes",
    "rocm_built": "build_probes",
    # Python objects, the same on every framework.
    "broadcast_object": "objects", "broadcast_object_fn": "objects",
    "allgather_object": "objects",
    # Process sets.
    "ProcessSet": "process_sets", "global_process_set": "process_sets",
    "add_process_set": "process_sets", "remove_process_set": "process_sets",
}

__all__ = sorted(PROCESS_API)

