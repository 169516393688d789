"""kerasdist/_core/site_mpi.py (which launchers suit the MPI built against)
and ops/build_info.py's MPI record, on this build's real core library."""

import importlib.util
import os
import sys

from kerasdist._core import capi
from kerasdist._core import site_mpi
from kerasdist.rendezvous import conventions
from kerasdist.run import mpi_command

MPICH = {"vendor": "mpich", "version": "5.0.2", "library": "libmpi.so.12",
         "pmix": False, "launcher_dir": None}
OPENMPI = {"vendor": "openmpi", "version": "5.0.11",
           "library": "libmpi.so.40", "pmix": True, "launcher_dir": None}
HYDRA = {"PMI_FD": "9", "PMI_RANK": "1", "PMI_SIZE": "2"}
MPIRUN = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
          "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-x@1"}
SRUN_PMIX = {"PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.1.0"}


def test_launched_by_names_the_protocol_and_its_variables():
    assert site_mpi.launched_by({}) == (None, None)
    assert site_mpi.launched_by(HYDRA) == ("pmi", "PMI_FD=9, PMI_RANK=1")
    assert site_mpi.launched_by(MPIRUN) == (
        "pmix", "OMPI_COMM_WORLD_SIZE=2, PMIX_RANK=1")
    assert site_mpi.launched_by(SRUN_PMIX)[0] == "pmix"


def test_check_launch_fails_only_for_a_protocol_the_mpi_lacks():
    for env, rec in ((HYDRA, MPICH), (MPIRUN, OPENMPI), (SRUN_PMIX, OPENMPI),
                     ({}, OPENMPI), (MPIRUN, {}),
                     (SRUN_PMIX, dict(MPICH, pmix=True))):
        assert site_mpi.check_launch(env, rec) is None, (env, rec)
    line = site_mpi.check_launch(MPIRUN, MPICH)
    assert line.startswith("kerasdist was built against MPICH 5.0.2 "
                           "(libmpi.so.12), which starts from PMI-1/PMI-2, "
                           "but this process was started by a PMIx launcher "
                           "(OMPI_COMM_WORLD_SIZE=2, PMIX_RANK=1"), line
    assert "srun --mpi=pmi2" in line and "\n" not in line
    line = site_mpi.check_launch(HYDRA, OPENMPI)
    assert "Open MPI 5.0.11 (libmpi.so.40), which starts from PMIx" in line
    assert "Open MPI's mpirun" in line and "srun --mpi=pmix" in line


def test_rendezvous_conventions_need_an_mpi_that_speaks_pmi1():
    assert site_mpi.check_rendezvous("torchrun", MPICH) is None
    assert site_mpi.check_rendezvous("torchrun", {}) is None
    line = site_mpi.check_rendezvous("torchrun", OPENMPI)
    assert "cannot start from the torchrun launch convention" in line


def test_check_size_catches_a_job_of_one_per_process():
    launch_ = conventions.detect(HYDRA)
    assert site_mpi.check_size(launch_, 2, "x", HYDRA, MPICH) is None
    line = site_mpi.check_size(launch_, 1, "MPICH Version: 5.0.2", HYDRA,
                               MPICH)
    assert line.startswith("the MPI launcher started 2 processes (PMI_FD=9, "
                           "PMI_RANK=1) but MPI formed a job of 1"), line
    assert site_mpi.check_size(conventions.detect({}), 1, "x", {},
                               MPICH) is None


def test_check_loaded_names_another_vendors_libmpi():
    assert site_mpi.check_loaded("MPICH Version: 5.0.2", MPICH) is None
    assert site_mpi.check_loaded("Something else 1.0", MPICH) is None
    line = site_mpi.check_loaded("Open MPI v4.1.4, package: Debian", MPICH)
    assert line.startswith("kerasdist was built against MPICH 5.0.2 "
                           "(libmpi.so.12) but the libmpi loaded is Open MPI")


def test_openmpi_argv_exports_the_environment_and_places_the_ranks():
    argv = mpi_command.build_openmpi_argv(
        "/opt/ompi/bin/mpirun", 4, ["python", "t.py"], {"KERASDIST_X": "1"},
        hosts=[("a", 2), ("b", 2)], launcher_exec="/x/ssh", iface="lo",
        environ={"HOME": "/root", "PMIX_RANK": "0", "BASH_FUNC_f%%": "()"})
    text = " ".join(argv)
    assert argv[:6] == ["/opt/ompi/bin/mpirun", "-np", "4", "--oversubscribe",
                        "--bind-to", "none"]
    for part in ("-H a:2,b:2 --leave-session-attached --prefix /opt/ompi",
                 "--mca plm_rsh_agent /x/ssh",
                 "--mca btl_tcp_if_include 127.0.0.0/8",
                 "--mca oob_tcp_if_include 127.0.0.0/8",
                 "-x HOME -x KERASDIST_X"):
        assert part in text, (part, text)
    assert "PMIX_RANK" not in text and "BASH_FUNC" not in text
    assert argv[-2:] == ["python", "t.py"] and "_rank.py" in text


def test_build_record_of_this_build():
    spec = importlib.util.spec_from_file_location(
        "build_info", os.path.join(os.path.dirname(__file__), "..", "..",
                                   "ops", "build_info.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rec = site_mpi.record()
    include = os.path.join(os.path.dirname(os.path.dirname(
        rec.get("library_path") or os.path.join(sys.prefix, "lib", "x"))),
        "include")
    # What this build's record says is what its core links.
    again = mod.mpi_record(capi.library_path(), rec.get("launcher_dir") or "",
                           "0", ["c++", f"-I{include}"])
    assert rec["vendor"] == again["vendor"] != "unknown"
    assert rec["library"] == again["library"]
    assert rec["library"].startswith("libmpi")
    loaded = capi.text("build_info")
    assert site_mpi.VENDORS[rec["vendor"]].banner in loaded
