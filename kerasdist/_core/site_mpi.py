"""The MPI kerasdist was built against, and whether this process's launcher
is one it can start from.

ops/Makefile records the MPI the core was compiled and linked against in
_build_info.json ("mpi": vendor, version, libmpi's name and path, PMIx,
the directory of its launcher; ops/build_info.py). Each MPI starts its
processes from the protocol its launcher serves: MPICH (the mpich wheel)
from PMI-1/PMI-2 (hydra's mpiexec, `srun --mpi=pmi2`, kerasdist's own
rendezvous), Open MPI from PMIx (its mpirun, `srun --mpi=pmix`). Started by
the other kind, MPI_Init either aborts with a page of text or, worse, makes
every process rank 0 of a job of one. `check_launch` (before MPI_Init) and
`check_size` (after it) turn both into one line naming what was found and
what to run instead; `kerasdist doctor` prints the same.

A vendor is one entry of VENDORS; another MPI fits in by adding one.
Standard library only: imported before the runtime starts.
"""

import collections
import json
import os
import shutil

Vendor = collections.namedtuple(
    "Vendor", ["name", "launcher", "family", "protocols", "pmi_rendezvous",
               "banner", "abi"])
Vendor.__doc__ = """How kerasdist starts under one MPI.

name: for messages ("Open MPI").
launcher: the file name of its launcher in its bin directory.
family: the launcher's command-line dialect for `kerasdist run`: "hydra"
    (-genvall, -genv, -hosts, -n) or "openmpi" (-x, -H, -np).
protocols: what its MPI_Init starts from: "pmi" (PMI-1/PMI-2) and/or
    "pmix"; a build that links libpmix adds "pmix".
pmi_rendezvous: MPI_Init speaks PMI-1's wire protocol to PMI_PORT, which
    kerasdist's rendezvous serves (the torchrun, Keras, JAX, ... launch
    conventions and `kerasdist run --nnodes`).
banner: how its MPI_Get_library_version begins ("Open MPI v5.0.11, ...").
abi: its binary interface: a build runs on the libmpi of every vendor of
    the same abi (MPICH and Intel MPI share MPICH's, libmpi.so.12).
"""

VENDORS = {
    "mpich": Vendor("MPICH", "mpiexec", "hydra", ("pmi",), True, "MPICH",
                    "mpich"),
    "openmpi": Vendor("Open MPI", "mpirun", "openmpi", ("pmix",), False,
                      "Open MPI", "openmpi"),
    # Its hydra takes MPICH's flags (kerasdist/run/intel_mpi.py has the
    # differences); kerasdist's PMI-1 rendezvous is untested with it.
    "intelmpi": Vendor("Intel MPI", "mpiexec", "hydra", ("pmi",), False,
                       "Intel(R) MPI", "mpich"),
}
UNKNOWN = Vendor("MPI", "mpiexec", "hydra", ("pmi", "pmix"), True, "", None)

# The variables each protocol's launchers set in every process.
PMIX_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_NAMESPACE")
PMI_VARIABLES = ("PMI_FD", "PMI_PORT", "PMI_RANK", "PMI_SIZE")
PROTOCOL_LAUNCHERS = {
    "pmix": "Open MPI's mpirun or srun --mpi=pmix",
    "pmi": "MPICH's mpiexec (hydra), srun --mpi=pmi2, or kerasdist run of "
           "an MPICH build",
}
GUIDE = "docs/mpi.md, \"Your cluster's MPI\""

_NATIVE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(path=None):
    """The build's "mpi" record ({} when the build predates it)."""
    path = path or os.path.join(_NATIVE_DIR, "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f).get("mpi") or {}
    except (OSError, ValueError):
        return {}


def vendor(rec):
    return VENDORS.get(rec.get("vendor"), UNKNOWN)


def protocols(rec):
    v = vendor(rec)
    return tuple(sorted(set(v.protocols) | ({"pmix"} if rec.get("pmix")
                                           else set())))


def describe(rec):
    """ "Open MPI 5.0.11 (libmpi.so.40)", or "an unrecorded MPI"."""
    if not rec:
        return "an unrecorded MPI"
    text = vendor(rec).name
    if vendor(rec) is UNKNOWN:
        text = f"MPI ({rec.get('vendor')})"
    if rec.get("version"):
        text += f" {rec['version']}"
    if rec.get("library"):
        text += f" ({rec['library']})"
    return text


def launcher_path(rec, environ=None, prefix=None):
    """The launcher of the MPI built against: <KERASDIST_MPI_HOME>/bin, the
    recorded launcher directory, this Python's prefix (the mpich wheel),
    then PATH; None if none is found."""
    environ = os.environ if environ is None else environ
    name = vendor(rec).launcher
    dirs = []
    if environ.get("KERASDIST_MPI_HOME"):
        dirs.append(os.path.join(environ["KERASDIST_MPI_HOME"], "bin"))
    if rec.get("launcher_dir"):
        dirs.append(rec["launcher_dir"])
    if prefix:
        dirs.append(os.path.join(prefix, "bin"))
    for d in dirs:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name, path=environ.get("PATH"))


def how_to_launch(rec):
    """What starts processes of this build, for the error lines."""
    v = vendor(rec)
    where = launcher_path(rec)
    ways = [f"{v.name}'s {v.launcher}" + (f" ({where})" if where else ""),
            "kerasdist run"]
    ways.append("srun --mpi=pmix" if "pmix" in protocols(rec)
                else "srun --mpi=pmi2")
    return ", ".join(ways[:-1]) + " or " + ways[-1]


def launched_by(environ):
    """(protocol, evidence) of the MPI launcher that started this process:
    ("pmix", "PMIX_RANK=0") etc., or (None, None) for none."""
    for protocol, names in (("pmix", PMIX_VARIABLES),
                            ("pmi", PMI_VARIABLES)):
        found = [n for n in names if environ.get(n, "") != ""]
        if found:
            return protocol, ", ".join(f"{n}={environ[n]}"
                                       for n in found[:2])
    return None, None


def check_launch(environ, rec=None):
    """The one-line error (a str) when this process's MPI launcher serves a
    protocol the build's MPI cannot start from, else None. Before MPI_Init."""
    rec = record() if rec is None else rec
    protocol, evidence = launched_by(environ)
    if not rec or protocol is None or protocol in protocols(rec):
        return None
    served = "PMIx" if protocol == "pmix" else "PMI-1/PMI-2"
    needs = " or ".join("PMIx" if p == "pmix" else "PMI-1/PMI-2"
                        for p in protocols(rec))
    return (f"kerasdist was built against {describe(rec)}, which starts "
            f"from {needs}, but this process was started by a {served} "
            f"launcher ({evidence}: {PROTOCOL_LAUNCHERS[protocol]}); start "
            f"it with {how_to_launch(rec)}, or build kerasdist against that "
            f"launcher's MPI ({GUIDE}).")


def check_rendezvous(convention, rec=None):
    """The one-line error when a launch convention that meets at a
    coordinator (torchrun's, Keras', ...) cannot start this build's MPI."""
    rec = record() if rec is None else rec
    if not rec or vendor(rec).pmi_rendezvous:
        return None
    return (f"kerasdist was built against {describe(rec)}, whose MPI starts "
            f"only from its own launcher, so it cannot start from the "
            f"{convention} launch convention (that needs an MPICH build, "
            f"the default: pip install mpich and rebuild); start the "
            f"processes with {how_to_launch(rec)} instead ({GUIDE}).")


def check_size(launch, mpi_size, loaded, environ, rec=None):
    """The one-line error when the MPI launcher said launch.size processes
    but MPI formed a job of `mpi_size`: the build's MPI did not understand
    the launcher (every process alone). `loaded`: MPI's library version."""
    rec = record() if rec is None else rec
    if launch is None or launch.convention != "mpi" or launch.size is None:
        return None
    if launch.size == mpi_size:
        return None
    evidence = launched_by(environ)[1]
    return (f"the MPI launcher started {launch.size} processes ({evidence}) "
            f"but MPI "
            f"formed a job of {mpi_size}: kerasdist's MPI ({loaded}; built "
            f"against {describe(rec)}) does not speak this launcher's "
            f"protocol; start it with {how_to_launch(rec)}, or build "
            f"kerasdist against the launcher's MPI ({GUIDE}).")


def loaded_vendor(loaded):
    """The VENDORS key whose banner MPI_Get_library_version's `loaded`
    begins with, or None."""
    for key, v in VENDORS.items():
        if v.banner and loaded.strip().startswith(v.banner):
            return key
    return None


def check_loaded(loaded, rec=None):
    """The one-line problem when the libmpi loaded at run time (its
    MPI_Get_library_version, `loaded`) is another MPI than the one the
    build record names (LD_LIBRARY_PATH or another MPI's module put a
    libmpi of the same name first), else None."""
    rec = record() if rec is None else rec
    found = loaded_vendor(loaded)
    if not rec or found is None or found == rec.get("vendor"):
        return None
    if VENDORS[found].abi == vendor(rec).abi:
        return None  # e.g. an MPICH build on Intel MPI's libmpi.so.12
    return (f"kerasdist was built against {describe(rec)} but the libmpi "
            f"loaded is {VENDORS[found].name} ({loaded.strip()[:60]}): "
            f"put {rec.get('library_path') or 'the MPI it was built with'} "
            f"first (LD_LIBRARY_PATH, the site's module), or rebuild "
            f"kerasdist against the loaded MPI ({GUIDE}).")
