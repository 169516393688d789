"""Intel MPI's mpiexec (its hydra) as the launcher's mpiexec.

Intel MPI's `mpiexec` is a hydra too and takes the flags the launcher uses
(`-genvall`, `-genv`, `-launcher-exec`, `-iface`, `-n`), with two
differences that matter here (Intel MPI 2021.19):

- `-hosts node1:1,node2:1`: a count of 1 is taken as no count at all, and
  such a host gets Intel's default number of ranks per host (all its
  cores): `-H node1:1,node2:1 -np 2` would put both ranks on node1. A
  machine file (`-machinefile`, one `host:slots` a line) is followed
  exactly, so the launcher gives Intel's mpiexec its hosts that way.
- Intel's mpiexec pins every rank to CPUs (`I_MPI_PIN`, on by default),
  which would undo `--bind-to` (core, or none); the ranks get
  `I_MPI_PIN=0` unless the environment sets `I_MPI_PIN` already, so the
  launcher's binding is the one in force, as with MPICH.

Standard library only.
"""

import os

# Ships in every Intel MPI's bin/ beside mpiexec (oneAPI, the impi-rt wheel,
# conda's impi_rt) and in no other MPI.
_MARKER = "impi_info"


def is_intel_mpiexec(mpiexec):
    """Whether `mpiexec` (a path) is Intel MPI's, by the files beside it
    (no process is started)."""
    bindir = os.path.dirname(os.path.realpath(mpiexec))
    return os.path.exists(os.path.join(bindir, _MARKER))


def machinefile_text(hosts):
    """hosts ([(host, slots), ...]) as a machine file: `host:slots` a line,
    in order (ranks fill the hosts in that order)."""
    return "".join(f"{host}:{slots}\n" for host, slots in hosts)


def write_machinefile(hosts, directory):
    """Writes machinefile_text(hosts) to DIRECTORY/machinefile; returns its
    path."""
    path = os.path.join(directory, "machinefile")
    with open(path, "w") as f:
        f.write(machinefile_text(hosts))
    return path


def rank_env(environ):
    """What the ranks get besides the launcher's own variables under Intel
    MPI: I_MPI_PIN=0 unless `environ` sets it (see the module docstring)."""
    return {} if "I_MPI_PIN" in environ else {"I_MPI_PIN": "0"}
