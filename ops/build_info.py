"""Writes _build_info.json: what the native libraries were built for
(ops/Makefile runs it once they are linked).

    build_info.py OUT_JSON TF JAX CORE_LIB LAUNCHER_DIR RELOCATABLE -- CXX...

TF=1 / JAX=1: records the TensorFlow / JAX versions the op libraries were
compiled against ("tensorflow", "jax"; kerasdist/_core/build_check.py compares
them with the installed ones), and always the Python and, as "mpi", the MPI
the core was compiled and linked against (kerasdist/_core/site_mpi.py reads
it: the launcher, the check of the launch at init, `kerasdist doctor`).
CXX... is the core's compile command.

The vendor and version come from mpi.h's macros (the compile command's
preprocessor), the library from the core's NEEDED entries and where the
dynamic loader finds them (ldd), PMIx from that libmpi's own dependencies.
LAUNCHER_DIR is where the MPI's launcher lies (its prefix's bin, or the
directory of the mpicxx the build used); RELOCATABLE=1 (a wheel built
against the mpich wheel) records no paths of the build machine.
Fields it cannot learn are null. Imports TensorFlow or JAX only for
TF=1 or JAX=1.
"""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

# (vendor, the macro that marks it, how its version reads): the first
# match wins, so MPICH derivatives (whose mpi.h also defines MPICH_VERSION)
# come before MPICH.
VENDORS = (
    ("intelmpi", "I_MPI_VERSION", "I_MPI_VERSION"),
    ("mvapich", "MVAPICH2_VERSION", "MVAPICH2_VERSION"),
    ("openmpi", "OMPI_MAJOR_VERSION",
     "OMPI_MAJOR_VERSION.OMPI_MINOR_VERSION.OMPI_RELEASE_VERSION"),
    ("mpich", "MPICH_VERSION", "MPICH_VERSION"),
)


def macros(compile_command):
    out = subprocess.run(compile_command + ["-dM", "-E", "-x", "c++", "-"],
                         input="#include <mpi.h>\n", capture_output=True,
                         text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"#define (\w+) (.*)", line)
        if m:
            found[m.group(1)] = m.group(2).strip().strip('"')
    return found


def vendor(defs):
    for name, marker, version in VENDORS:
        if marker in defs:
            parts = [defs.get(p, "?") for p in version.split(".")]
            return name, ".".join(parts)
    return "unknown", None


def libraries(path):
    """{soname: resolved path or None} of what ldd lists for `path`."""
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if m:
            libs[m.group(1)] = (m.group(2) if m.group(2) != "not"
                                else None)
    return libs


def mpi_record(core, launcher_dir, relocatable, compile_command):
    defs = macros(compile_command)
    name, version = vendor(defs)
    libs = libraries(core)
    mpi_libs = [s for s in libs if re.match(r"libmpi(_abi)?\.so", s)]
    soname = mpi_libs[0] if mpi_libs else None
    path = libs.get(soname) if soname else None
    pmix = bool(path) and any(s.startswith("libpmix")
                              for s in libraries(path))
    record = {
        "vendor": name,
        "version": version,
        "standard": (f"{defs['MPI_VERSION']}.{defs['MPI_SUBVERSION']}"
                     if "MPI_VERSION" in defs else None),
        "library": soname,
        # PMIx: what Open MPI's mpirun and srun --mpi=pmix offer; MPICH
        # starts from PMI-1/PMI-2 (hydra, srun --mpi=pmi2) unless built
        # with PMIx.
        "pmix": pmix or name == "openmpi",
        "library_path": None if relocatable == "1" else path,
        "launcher_dir": None if relocatable == "1" else (
            os.path.abspath(launcher_dir) if launcher_dir else None),
    }
    return record


def _build_check():
    """kerasdist/_core/build_check.py (standard library only), loaded from its
    file: importing the package would load the libraries being built."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                        "kerasdist", "_core", "build_check.py")
    spec = importlib.util.spec_from_file_location("_build_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv):
    out, tf, jax, core, launcher_dir, relocatable = argv[1:7]
    info = {"python": sys.version.split()[0]}
    # From the packages' metadata, as kerasdist/_core/build_check.py compares
    # them (an import of TensorFlow costs seconds of CPU a build).
    check = _build_check()
    for framework, wanted in (("tensorflow", tf), ("jax", jax)):
        if wanted == "1":
            info[framework] = check.installed(framework)[1] or \
                importlib.import_module(framework).__version__
    info["mpi"] = mpi_record(core, launcher_dir, relocatable,
                             argv[argv.index("--") + 1:])
    with open(out, "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main(sys.argv)
