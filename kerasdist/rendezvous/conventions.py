"""Which launch convention started this process, read from its environment.

`detect(environ)` looks at the variables a platform sets for each process it
starts and returns a `Launch`: the convention's name, this process's rank,
the job's size, its local rank and local size where known, and the
coordinator's address for the rendezvous (kerasdist/rendezvous/client.py).
The conventions, in the order they are tried (CONVENTIONS, the table of
their names, variables and parsers that `detect` walks):

1. ``mpi``: an MPI launcher started the process (``kerasdist run``,
   ``mpiexec``, ``srun --mpi=pmi2``/``pmix``, Open MPI): one of
   ``PMI_FD PMI_PORT PMI_ID PMI_RANK PMI_SIZE PMIX_RANK PMIX_NAMESPACE
   OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE`` is set. MPI starts from its
   launcher's PMI as it always has; no rendezvous.
2. ``torchrun``: torchrun's (and torch's ``env://``) variables ``RANK
   WORLD_SIZE MASTER_ADDR MASTER_PORT`` plus ``LOCAL_RANK
   LOCAL_WORLD_SIZE``; also what Kubeflow's PyTorchJob and most Kubernetes
   set-ups give each pod. ``RANK`` or ``WORLD_SIZE`` marks it. Kubeflow's
   (and torchrun's own) node variables ``PET_NNODES PET_NODE_RANK
   PET_NPROC_PER_NODE``, where present and numeric, must agree with them.
3. ``keras``: Keras' ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (comma-separated
   ``host:port``, the first is the coordinator),
   ``KERAS_DISTRIBUTION_NUM_PROCESSES``, ``KERAS_DISTRIBUTION_PROCESS_ID``.
4. ``jax``: JAX's ``JAX_COORDINATOR_ADDRESS`` (``host:port``),
   ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (Kubeflow Trainer's JAX
   runtime).
5. ``kerasdist``: ``KERASDIST_NUM_PROCESSES`` and ``KERASDIST_COORDINATOR``
   (``host:port``), set in the manifest; the rank is ``KERASDIST_RANK``, or
   else Kubernetes' ``JOB_COMPLETION_INDEX`` (an Indexed Job, a JobSet).
6. ``tf_config``: TensorFlow's ``TF_CONFIG`` (JSON: ``cluster.chief`` and
   ``cluster.worker`` lists of ``host:port``, ``task.type``/``task.index``;
   a chief is worker 0, as in tf.distribute), or Vertex AI's
   ``CLUSTER_SPEC`` (the same with ``workerpool0`` as the chief and
   ``workerpool1`` as the workers). The first worker's address is the
   coordinator.
7. ``sagemaker``: SageMaker's ``SM_HOSTS`` (a JSON list of host names) and
   ``SM_CURRENT_HOST``: one process per host, rank = the host's place in
   the list, the coordinator the first host at port 29500.
8. ``slurm``: a task of an ``srun`` step without an MPI plugin:
   ``SLURM_STEP_ID`` with ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or
   ``SLURM_NTASKS``), ``SLURM_LOCALID``; the coordinator is the first host
   of ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``,
   ``SLURM_NODELIST``) at a port made from ``SLURM_JOB_ID`` and
   ``SLURM_STEP_ID`` (10000-29999), so that two steps on a node differ.
9. ``single``: none of these: one process, rank 0 of 1.

Where the conventions 1-5 (each set per process) are present together they
must agree on rank and size. 6-8 describe a host or a container as much as
a process (Vertex sets ``CLUSTER_SPEC`` and Slurm ``SLURM_PROCID`` also
where torchrun or mpiexec then starts the processes): they count only where
none of 1-5 is there, and then the first of them is taken. For any
missing, malformed or contradictory variable `detect` raises a ValueError
whose one line names the variable and what to set.

Two settings apply to 3-8: ``KERASDIST_COORDINATOR_PORT`` replaces the
coordinator's port (e.g. when the script also calls
``jax.distributed.initialize``, which listens on JAX's or Keras' port), and
for ``kerasdist`` and ``sagemaker``, ``KERASDIST_PROCESSES_PER_HOST`` (N
processes started on each host or pod, each with ``KERASDIST_LOCAL_RANK``
0..N-1; rank = host index x N + local rank).

Standard library only: imported before the runtime starts. The parsers
are in platforms.py, what they share in environment.py.
"""

import collections

from kerasdist.rendezvous.environment import MPI_VARIABLES
from kerasdist.rendezvous.environment import PORT_ENV
from kerasdist.rendezvous.environment import Launch
from kerasdist.rendezvous.environment import port_number
from kerasdist.rendezvous.platforms import from_jax
from kerasdist.rendezvous.platforms import from_keras
from kerasdist.rendezvous.platforms import from_kerasdist
from kerasdist.rendezvous.platforms import from_mpi
from kerasdist.rendezvous.platforms import from_sagemaker
from kerasdist.rendezvous.platforms import from_slurm
from kerasdist.rendezvous.platforms import from_tf
from kerasdist.rendezvous.platforms import from_torchrun


def _with_port(environ, launch):
    """The launch with KERASDIST_COORDINATOR_PORT's port, where set."""
    text = environ.get(PORT_ENV, "").strip()
    if not text or launch.coordinator is None:
        return launch
    return launch._replace(coordinator=(launch.coordinator[0],
                                        port_number(text, PORT_ENV)))


Convention = collections.namedtuple(
    "Convention", ["name", "variables", "match", "parse", "per_process",
                   "port_setting"])
Convention.__doc__ = """One launch convention, as `detect` looks for it.

name: the Launch's convention.
variables: the variables that mark it; `match` (any or all) of them set.
parse: (environ, full) -> (Launch, (rank variable, size variable)), the
    variables named when two conventions disagree (None for the host-wide
    conventions, which are never compared); `full` is False where an
    earlier convention was found, whose coordinator is the job's.
per_process: set per process (conventions 1-5), or host- or container-wide
    (6-8), which count only where no per-process one is present.
port_setting: KERASDIST_COORDINATOR_PORT replaces its coordinator's port.
"""

# The conventions in the order `detect` tries them (the module docstring's).
CONVENTIONS = (
    Convention("mpi", MPI_VARIABLES, any, from_mpi, True, False),
    Convention("torchrun", ("RANK", "WORLD_SIZE"), any, from_torchrun, True,
               False),
    Convention("keras", ("KERAS_DISTRIBUTION_PROCESS_ID",
                         "KERAS_DISTRIBUTION_NUM_PROCESSES"), any, from_keras,
               True, True),
    Convention("jax", ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"), any, from_jax,
               True, True),
    Convention("kerasdist", ("KERASDIST_NUM_PROCESSES", "KERASDIST_RANK"),
               any, from_kerasdist, True, True),
    Convention("tf_config", ("TF_CONFIG", "CLUSTER_SPEC"), any, from_tf, False,
               True),
    Convention("sagemaker", ("SM_HOSTS",), any, from_sagemaker, False, True),
    Convention("slurm", ("SLURM_PROCID", "SLURM_STEP_ID"), all, from_slurm,
               False, True),
)


def detect(environ):
    """Returns the `Launch` that `environ` (a mapping) describes: the first
    convention of CONVENTIONS present, which the other per-process ones
    present must agree with.

    Raises:
        ValueError: a convention's variable is missing, malformed or out of
            range, or two conventions disagree on rank or size; the message
            is one line naming the variable and what to set.
    """
    found = []  # (Convention, Launch, (rank variable, size variable))
    for convention in CONVENTIONS:
        if found and not convention.per_process:
            break  # host-wide ones count only where no per-process one is
        if convention.match(environ.get(n, "") != ""
                            for n in convention.variables):
            found.append((convention, *convention.parse(environ, not found)))
            if not convention.per_process:
                break  # the first host-wide one present
    if not found:
        return Launch("single", 0, 1, 0, 1, None)
    _check_agreement(found)
    convention, first, _ = found[0]
    return _with_port(environ, first) if convention.port_setting else first


def _check_agreement(found):
    """Two per-process conventions must give the same rank and size."""
    _, first, first_names = found[0]
    for _, other, (rank_name, size_name) in found[1:]:
        if first.rank is None:
            continue
        if (first.rank, first.size) != (other.rank, other.size):
            first_rank, first_size = first_names
            raise ValueError(
                f"{first.convention} says rank {first.rank} of {first.size} "
                f"({first_rank}, {first_size}) but {other.convention} says "
                f"rank {other.rank} of {other.size} ({rank_name}, "
                f"{size_name}); unset the variables of the launcher that "
                f"did not start this process.")


def describe(launch):
    """One line for the log: convention, rank, size, local rank, coordinator."""
    local = ("?" if launch.local_rank is None
             else f"{launch.local_rank} of {launch.local_size}")
    where = ("none" if launch.coordinator is None
             else f"{launch.coordinator[0]}:{launch.coordinator[1]}")
    return (f"launch convention {launch.convention}: rank {launch.rank} of "
            f"{launch.size}, local rank {local}, coordinator {where}")
