"""glibc's allocator on the CPU: large blocks served from mmap
(`return_large_blocks`: sharded weights, the optimizer wrapper, and
`kd.init()` on Keras' PyTorch backend) and freed memory given back
(`give_back_freed`: the start's broadcast)."""

# glibc's M_MMAP_THRESHOLD (mallopt) and the threshold set: 1 MiB.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


def return_large_blocks():
    """Has glibc serve allocations of 1 MiB or more from mmap, so that a
    freed one goes back to the system at once. By default glibc raises
    that threshold as blocks are freed, up to 32 MiB, and keeps freed
    blocks below it in its heap: with sharded weights on the CPU, where
    every layer's gathered weights and gradients come and go as blocks of
    that size, the resident set then grows to several times what is live
    (a 100M MLP under a 1536 MiB cap per rank trained 13 layers at np=4
    with PyTorch, 48 with this). Not where the process set
    MALLOC_MMAP_THRESHOLD_ itself (glibc's own variable), nor off glibc."""
    import os
    import platform

    if "MALLOC_MMAP_THRESHOLD_" in os.environ or _MALLOPT:
        return
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    import ctypes

    _MALLOPT.append(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD,
                                              MMAP_THRESHOLD))


_MALLOPT = []


def give_back_freed():
    """Has glibc give the system the free pages of its heap (malloc_trim):
    after every variable was replaced at once (the start's broadcast), the
    old values' blocks, freed below the mmap threshold, stay resident
    otherwise, and XLA's step, which takes its temporaries in one large
    block, never reuses them (JAX, where the threshold stays glibc's: the
    transformer stack's marginal peak at np=2 was 20.2 bytes a parameter
    with them, 16.7 without the broadcast). Nothing off glibc."""
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)
