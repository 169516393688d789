"""Unit tests of how the launcher drives Intel MPI's mpiexec: no processes,
no MPI (tests/cluster/test_intel_mpi.py runs the real one)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.run import intel_mpi  # noqa: E402
from kerasdist.run import mpi_command  # noqa: E402


def _bindir(path, *names):
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_text("#!/bin/sh\n")
        (path / name).chmod(0o755)
    return str(path / names[0])


def test_intel_mpiexec_is_told_by_the_files_beside_it(tmp_path):
    intel = _bindir(tmp_path / "impi" / "bin", "mpiexec", "mpiexec.hydra",
                    "impi_info")
    mpich = _bindir(tmp_path / "mpich" / "bin", "mpiexec", "hydra_pmi_proxy")
    assert intel_mpi.is_intel_mpiexec(intel)
    assert not intel_mpi.is_intel_mpiexec(mpich)
    # A link to it elsewhere (a PATH directory of links) is still Intel's.
    (tmp_path / "links").mkdir()
    os.symlink(intel, tmp_path / "links" / "mpiexec")
    assert intel_mpi.is_intel_mpiexec(str(tmp_path / "links" / "mpiexec"))


def test_hosts_go_in_a_machine_file_in_order(tmp_path):
    hosts = [("node1", 1), ("node2", 2), ("node0", 1)]
    path = intel_mpi.write_machinefile(hosts, str(tmp_path))
    assert open(path).read() == "node1:1\nnode2:2\nnode0:1\n"
    argv = mpi_command.build_mpiexec_argv("/i/mpiexec", 4, ["c"], {},
                                          hosts=hosts, python="/py",
                                          machinefile=path)
    assert "-hosts" not in argv
    assert argv[argv.index("-machinefile") + 1] == path
    assert argv.index("-machinefile") < argv.index("-n")
    # On this machine alone there are no hosts to name.
    argv = mpi_command.build_mpiexec_argv("/i/mpiexec", 2, ["c"], {},
                                          python="/py", machinefile=None)
    assert "-machinefile" not in argv and "-hosts" not in argv


def test_intel_pinning_is_off_unless_asked_for():
    assert intel_mpi.rank_env({}) == {"I_MPI_PIN": "0"}
    assert intel_mpi.rank_env({"I_MPI_PIN": "1"}) == {}
