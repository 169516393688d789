"""Which launch convention started this process, read from its environment.

`detect(environ)` looks at the variables a platform sets for each process it
starts and returns a `Launch`: the convention's name, this process's rank,
the job's size, its local rank and local size where known, and the
coordinator's address for the rendezvous (kerasdist/run/rendezvous.py).
The conventions, in the order they are tried:

1. ``mpi``: an MPI launcher started the process (``kerasdist run``,
   ``mpiexec``, ``srun --mpi=pmi2``/``pmix``, Open MPI): one of
   ``PMI_FD PMI_PORT PMI_ID PMI_RANK PMI_SIZE PMIX_RANK PMIX_NAMESPACE
   OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE`` is set. MPI starts from its
   launcher's PMI as it always has; no rendezvous.
2. ``torchrun``: torchrun's (and torch's ``env://``) variables ``RANK
   WORLD_SIZE MASTER_ADDR MASTER_PORT`` plus ``LOCAL_RANK
   LOCAL_WORLD_SIZE``; also what Kubeflow's PyTorchJob and most Kubernetes
   set-ups give each pod. ``RANK`` or ``WORLD_SIZE`` marks it.
3. ``keras``: Keras' ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (comma-separated
   ``host:port``, the first is the coordinator),
   ``KERAS_DISTRIBUTION_NUM_PROCESSES``, ``KERAS_DISTRIBUTION_PROCESS_ID``.
4. ``single``: none of these: one process, rank 0 of 1.

Where several conventions are present they must agree on rank and size;
otherwise, and for any missing or malformed variable, `detect` raises a
ValueError whose one line names the variable and what to set.

Standard library only: imported before the runtime starts.
"""

import collections

MPI_VARIABLES = ("PMI_FD", "PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE",
                 "PMIX_RANK", "PMIX_NAMESPACE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
KERAS_VARIABLES = ("KERAS_DISTRIBUTION_JOB_ADDRESSES",
                   "KERAS_DISTRIBUTION_NUM_PROCESSES",
                   "KERAS_DISTRIBUTION_PROCESS_ID")

Launch = collections.namedtuple(
    "Launch", ["convention", "rank", "size", "local_rank", "local_size",
               "coordinator"])
Launch.__doc__ = """What started this process.

convention: "mpi", "torchrun", "keras" or "single".
rank, size: this process's rank in [0, size) and the job's size (None for
    "mpi" when its launcher does not say; MPI asks its PMI).
local_rank, local_size: this process's rank among those on its host and
    their number, None where the convention does not say.
coordinator: (host, port) where rank 0 serves the rendezvous, None when
    there is none to do ("mpi", "single", or a job of one).
"""


def _present(environ, names):
    return [n for n in names if environ.get(n, "") != ""]


def _int(environ, name, what, minimum=0):
    value = environ[name]
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; set {name} "
                         f"to {what}.") from None
    if number < minimum:
        raise ValueError(f"{name}={value!r} is below {minimum}; set {name} "
                         f"to {what}.")
    return number


def _port(text, name):
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{name} gives port {text!r}; set it to a TCP port "
                         f"in 1-65535 that rank 0's host can listen on.")
    return port


def _rank_and_size(environ, rank_name, size_name, what):
    """(rank, size) from two variables, both required when either is set."""
    wants = {rank_name: "this process's rank", size_name:
             "the number of processes"}
    for have, missing in ((rank_name, size_name), (size_name, rank_name)):
        if environ.get(have, "") != "" and environ.get(missing, "") == "":
            raise ValueError(
                f"{have} is set but {missing} is not; set {missing} to "
                f"{wants[missing]} ({what}).")
    size = _int(environ, size_name, "the number of processes (1 or more)",
                minimum=1)
    rank = _int(environ, rank_name,
                f"this process's rank, 0 to {size - 1}")
    if rank >= size:
        raise ValueError(f"{rank_name}={rank} is not below {size_name}="
                         f"{size}; set {rank_name} to 0..{size - 1}, or "
                         f"{size_name} to the number of processes.")
    return rank, size


def _mpi(environ):
    local = None
    for rank_name, size_name in (("PMI_RANK", "PMI_SIZE"),
                                 ("OMPI_COMM_WORLD_RANK",
                                  "OMPI_COMM_WORLD_SIZE")):
        if _present(environ, (rank_name, size_name)) == [rank_name,
                                                         size_name]:
            rank, size = _rank_and_size(environ, rank_name, size_name,
                                        "the MPI launcher's")
            break
    else:
        rank = size = None
        rank_name = size_name = None
    for lr, ls in (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                   ("OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE")):
        try:
            local = (int(environ[lr]), int(environ[ls]))
            break
        except (KeyError, ValueError):
            continue
    launch = Launch("mpi", rank, size, *(local or (None, None)), None)
    return launch, (rank_name, size_name)


def _torchrun(environ, full=True):
    rank, size = _rank_and_size(environ, "RANK", "WORLD_SIZE",
                                "torchrun's env:// convention")
    present = _present(environ, ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if present:
        local_rank, local_size = _rank_and_size(
            environ, "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "the processes on this host")
        if local_size > size:
            raise ValueError(f"LOCAL_WORLD_SIZE={local_size} is above "
                             f"WORLD_SIZE={size}; set it to the number of "
                             f"processes on this host.")
    else:
        local_rank = local_size = None
    coordinator = None
    if full and size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if environ.get(name, "").strip() == "":
                raise ValueError(
                    f"RANK and WORLD_SIZE are set but {name} is not; set "
                    f"MASTER_ADDR to rank 0's host and MASTER_PORT to a "
                    f"free port there (the same on every process).")
        coordinator = (environ["MASTER_ADDR"].strip(),
                       _port(environ["MASTER_PORT"].strip(), "MASTER_PORT"))
    return Launch("torchrun", rank, size, local_rank, local_size,
                  coordinator)


def _keras(environ, full=True):
    rank, size = _rank_and_size(environ, "KERAS_DISTRIBUTION_PROCESS_ID",
                                "KERAS_DISTRIBUTION_NUM_PROCESSES",
                                "Keras' distribution convention")
    coordinator = None
    if full and size > 1:
        name = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
        first = environ.get(name, "").split(",")[0].strip()
        host, sep, port = first.rpartition(":")
        if not first or not sep or not host:
            raise ValueError(
                f"{name}={environ.get(name, '')!r} does not start with "
                f"host:port; set it to the processes' addresses, "
                f"comma-separated, rank 0's first.")
        coordinator = (host.strip("[]"), _port(port, name))
    return Launch("keras", rank, size, None, None, coordinator)


def detect(environ):
    """Returns the `Launch` that `environ` (a mapping) describes.

    Raises:
        ValueError: a convention's variable is missing, malformed or out of
            range, or two conventions disagree on rank or size; the message
            is one line naming the variable and what to set.
    """
    found = []  # (Launch, (rank variable, size variable))
    if _present(environ, MPI_VARIABLES):
        found.append(_mpi(environ))
    if _present(environ, ("RANK", "WORLD_SIZE")):
        found.append((_torchrun(environ, full=not found),
                      ("RANK", "WORLD_SIZE")))
    if _present(environ, ("KERAS_DISTRIBUTION_PROCESS_ID",
                          "KERAS_DISTRIBUTION_NUM_PROCESSES")):
        found.append((_keras(environ, full=not found),
                      ("KERAS_DISTRIBUTION_PROCESS_ID",
                       "KERAS_DISTRIBUTION_NUM_PROCESSES")))
    if not found:
        return Launch("single", 0, 1, 0, 1, None)
    first, (first_rank, first_size) = found[0]
    for other, (rank_name, size_name) in found[1:]:
        if first.rank is None:
            continue
        if (first.rank, first.size) != (other.rank, other.size):
            raise ValueError(
                f"{first.convention} says rank {first.rank} of {first.size} "
                f"({first_rank}, {first_size}) but {other.convention} says "
                f"rank {other.rank} of {other.size} ({rank_name}, "
                f"{size_name}); unset the variables of the launcher that "
                f"did not start this process.")
    return first


def describe(launch):
    """One line for the log: convention, rank, size, local rank, coordinator."""
    local = ("?" if launch.local_rank is None
             else f"{launch.local_rank} of {launch.local_size}")
    where = ("none" if launch.coordinator is None
             else f"{launch.coordinator[0]}:{launch.coordinator[1]}")
    return (f"launch convention {launch.convention}: rank {launch.rank} of "
            f"{launch.size}, local rank {local}, coordinator {where}")
