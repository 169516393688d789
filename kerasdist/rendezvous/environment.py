"""Reading a platform's launch variables (conventions.py): the `Launch`
record a convention's parser returns, the variables and settings they
read, and the checked readers each parser uses, whose ValueError's one
line names the variable and what to set.

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

convention: "mpi", "torchrun", "keras", "jax", "kerasdist", "tf_config",
    "sagemaker", "slurm" or "single".
rank, size: this process's rank in [0, size) and the job's size (None for
    "mpi" when its launcher does not say; MPI asks its PMI).
local_rank, local_size: this process's rank among those on its host and
    their number, None where the convention does not say.
coordinator: (host, port) where rank 0 serves the rendezvous, None when
    there is none to do ("mpi", "single", or a job of one).
"""


def set_variables(environ, names):
    return [n for n in names if environ.get(n, "") != ""]


# The most processes in one job: far above any job that runs, low enough
# that a typo (WORLD_SIZE=1000000000) is an error at once, not a rendezvous
# that waits for them all.
MAX_PROCESSES = 1 << 20


def integer(environ, name, what, minimum=0, maximum=None):
    value = environ[name]
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; set {name} "
                         f"to {what}.") from None
    if number < minimum:
        raise ValueError(f"{name}={value!r} is below {minimum}; set {name} "
                         f"to {what}.")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name}={value!r} is above {maximum}, the most "
                         f"processes kerasdist forms a job of; set {name} "
                         f"to {what}.")
    return number


def port_number(text, name):
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{name} gives port {text!r}; set it to a TCP port "
                         f"in 1-65535 that rank 0's host can listen on.")
    return port


def rank_and_size(environ, rank_name, size_name, what):
    """(rank, size) from two variables, both required when either is set."""
    wants = {rank_name: "this process's rank", size_name:
             "the number of processes"}
    for have, missing in ((rank_name, size_name), (size_name, rank_name)):
        if environ.get(have, "") != "" and environ.get(missing, "") == "":
            raise ValueError(
                f"{have} is set but {missing} is not; set {missing} to "
                f"{wants[missing]} ({what}).")
    size = integer(environ, size_name, "the number of processes (1 or more)",
                minimum=1, maximum=MAX_PROCESSES)
    rank = integer(environ, rank_name,
                f"this process's rank, 0 to {size - 1}")
    if rank >= size:
        raise ValueError(f"{rank_name}={rank} is not below {size_name}="
                         f"{size}; set {rank_name} to 0..{size - 1}, or "
                         f"{size_name} to the number of processes.")
    return rank, size


JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                 "JAX_PROCESS_ID")
KERASDIST_VARIABLES = ("KERASDIST_NUM_PROCESSES", "KERASDIST_COORDINATOR",
                       "KERASDIST_RANK")
PORT_ENV = "KERASDIST_COORDINATOR_PORT"
PER_HOST_ENV = "KERASDIST_PROCESSES_PER_HOST"
LOCAL_RANK_ENV = "KERASDIST_LOCAL_RANK"


def host_port(text, name, what):
    """(host, port) of "host:port" (IPv6 in brackets), or a ValueError."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]"):
        raise ValueError(f"{name}={text!r} is not host:port; set {name} to "
                         f"{what}.")
    return host.strip("[]"), port_number(port, name)


def per_host(environ, host_index, hosts, hosts_name):
    """(rank, size, local rank, local size) for hosts x
    KERASDIST_PROCESSES_PER_HOST processes."""
    per = 1
    if environ.get(PER_HOST_ENV, "").strip():
        per = integer(environ, PER_HOST_ENV,
                   "the number of processes on each host (1 or more)", 1)
    local = 0
    if per > 1 or environ.get(LOCAL_RANK_ENV, "").strip():
        if environ.get(LOCAL_RANK_ENV, "").strip() == "":
            raise ValueError(
                f"{PER_HOST_ENV}={per} but {LOCAL_RANK_ENV} is not set; set "
                f"{LOCAL_RANK_ENV} to this process's index on its host, "
                f"0..{per - 1}.")
        local = integer(environ, LOCAL_RANK_ENV,
                     f"this process's index on its host, 0..{per - 1}")
        if local >= per:
            raise ValueError(
                f"{LOCAL_RANK_ENV}={local} is not below {PER_HOST_ENV}="
                f"{per}; set {LOCAL_RANK_ENV} to 0..{per - 1}, or "
                f"{PER_HOST_ENV} to the processes on each host.")
    if hosts * per > MAX_PROCESSES:
        raise ValueError(
            f"{hosts_name} x {PER_HOST_ENV}={per} gives {hosts * per} "
            f"processes, above {MAX_PROCESSES}, the most processes "
            f"kerasdist forms a job of; set {PER_HOST_ENV} to the "
            f"processes on each host.")
    return host_index * per + local, hosts * per, local, per
