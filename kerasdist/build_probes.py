"""What the native library was built with: `build_info()` and Horovod's
build probes (`mpi_built`, `nccl_built`, `cuda_built`...), read from the
library; none needs `init()`."""

from kerasdist._core import capi as _capi


def mpi_built():
    """True: the MPI backend is always built."""
    return bool(_capi.lib().kerasdist_mpi_built())


def nccl_built():
    """True if the library was built with the NCCL (GPU) backend."""
    return bool(_capi.lib().kerasdist_nccl_built())


def build_info():
    """Versions and backends the native library was built with, as a dict."""
    info = dict(line.split("=", 1) for line in
                _capi.text("build_info").splitlines() if "=" in line)
    return info


def _built(key):
    return build_info().get(key, "0") not in ("", "0")


def ccl_built():
    """False: kerasdist has no oneCCL backend (Horovod's `ccl_built`)."""
    return _built("ccl")


def gloo_built():
    """False: kerasdist has no Gloo backend; jobs without an MPI launcher
    meet at a coordinator and then run on MPI (docs/platforms.md)."""
    return _built("gloo")


def ddl_built():
    """False: kerasdist has no IBM DDL backend."""
    return _built("ddl")


def cuda_built():
    """True if the library was built with the GPU backend on CUDA (its
    build info then names the CUDA runtime: `build_info()["gpu_backend"]`,
    for example "NCCL 2.27.3, CUDA 13.0")."""
    return "CUDA" in build_info().get("gpu_backend", "")


def rocm_built():
    """False unless the GPU backend was built on ROCm, which kerasdist's
    build does not offer (read from `build_info()["gpu_backend"]`)."""
    return "ROCm" in build_info().get("gpu_backend", "")
