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

Standard library only: imported before the runtime starts.

Over 500 lines: the table of launch conventions and their parsers, in a start-
up module that may import no other kerasdist module
(tests/unit/test_import_direction.py), so the parsers cannot live elsewhere.
"""

import collections
import json
import re
import shutil
import subprocess

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


def _present(environ, names):
    return [n for n in names if environ.get(n, "") != ""]


# The most processes in one job: far above any job that runs, low enough
# that a typo (WORLD_SIZE=1000000000) is an error at once, not a rendezvous
# that waits for them all.
MAX_PROCESSES = 1 << 20


def _int(environ, name, what, minimum=0, maximum=None):
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
                minimum=1, maximum=MAX_PROCESSES)
    rank = _int(environ, rank_name,
                f"this process's rank, 0 to {size - 1}")
    if rank >= size:
        raise ValueError(f"{rank_name}={rank} is not below {size_name}="
                         f"{size}; set {rank_name} to 0..{size - 1}, or "
                         f"{size_name} to the number of processes.")
    return rank, size


def _mpi(environ, full=True):
    """The MPI launcher's rank and size where it gives them (`full` is
    unused: MPI needs no coordinator)."""
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
    """torchrun's variables, checked against Kubeflow's node variables."""
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
    launch = Launch("torchrun", rank, size, local_rank, local_size,
                    coordinator)
    return _pet(environ, launch), ("RANK", "WORLD_SIZE")


def _keras(environ, full=True):
    names = ("KERAS_DISTRIBUTION_PROCESS_ID",
             "KERAS_DISTRIBUTION_NUM_PROCESSES")
    rank, size = _rank_and_size(environ, *names,
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
    return Launch("keras", rank, size, None, None, coordinator), names


JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                 "JAX_PROCESS_ID")
KERASDIST_VARIABLES = ("KERASDIST_NUM_PROCESSES", "KERASDIST_COORDINATOR",
                       "KERASDIST_RANK")
PORT_ENV = "KERASDIST_COORDINATOR_PORT"
PER_HOST_ENV = "KERASDIST_PROCESSES_PER_HOST"
LOCAL_RANK_ENV = "KERASDIST_LOCAL_RANK"
SAGEMAKER_PORT = 29500


def _host_port(text, name, what):
    """(host, port) of "host:port" (IPv6 in brackets), or a ValueError."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]"):
        raise ValueError(f"{name}={text!r} is not host:port; set {name} to "
                         f"{what}.")
    return host.strip("[]"), _port(port, name)


def _pet(environ, launch):
    """Checks Kubeflow's / torchrun's node variables against RANK etc.;
    returns the launch, with local rank 0 of 1 where a node runs one."""
    def number(name, minimum):
        text = environ.get(name, "").strip()
        if not text.isdigit():  # absent, "auto", "gpu", a range "1:4"
            return None
        return _int(environ, name, "", minimum)
    nnodes = number("PET_NNODES", 1)
    node = number("PET_NODE_RANK", 0)
    nproc = number("PET_NPROC_PER_NODE", 1)
    if nnodes is not None and node is not None and node >= nnodes:
        raise ValueError(f"PET_NODE_RANK={node} is not below PET_NNODES="
                         f"{nnodes}; set PET_NODE_RANK to this node's index, "
                         f"0..{nnodes - 1}.")
    if nproc is None:
        return launch
    if nnodes is not None and nnodes * nproc != launch.size:
        raise ValueError(
            f"WORLD_SIZE={launch.size} is not PET_NNODES={nnodes} x "
            f"PET_NPROC_PER_NODE={nproc}; set WORLD_SIZE to "
            f"{nnodes * nproc}, or the node variables to the job's shape.")
    if launch.local_size is None:
        if nproc > 1:
            raise ValueError(
                f"PET_NPROC_PER_NODE={nproc} but LOCAL_RANK is not set: "
                f"these are a node's variables; start its {nproc} "
                f"processes with torchrun (which sets RANK and LOCAL_RANK "
                f"for each), or set nprocPerNode to 1.")
        return launch._replace(local_rank=0, local_size=1)
    if launch.local_size != nproc:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={launch.local_size} differs from "
            f"PET_NPROC_PER_NODE={nproc}; set both to the number of "
            f"processes on this node.")
    if node is not None and node * nproc + launch.local_rank != launch.rank:
        raise ValueError(
            f"RANK={launch.rank} is not PET_NODE_RANK={node} x "
            f"PET_NPROC_PER_NODE={nproc} + LOCAL_RANK={launch.local_rank}; "
            f"set RANK to {node * nproc + launch.local_rank}, or "
            f"PET_NODE_RANK to this node's index.")
    return launch


def _jax(environ, full=True):
    rank, size = _rank_and_size(environ, "JAX_PROCESS_ID",
                                "JAX_NUM_PROCESSES", "JAX's convention")
    coordinator = None
    if full and size > 1:
        name = "JAX_COORDINATOR_ADDRESS"
        if environ.get(name, "").strip() == "":
            raise ValueError(
                f"JAX_PROCESS_ID and JAX_NUM_PROCESSES are set but {name} "
                f"is not; set {name} to process 0's host:port (the same on "
                f"every process).")
        coordinator = _host_port(environ[name], name,
                                 "process 0's host:port")
    return (Launch("jax", rank, size, None, None, coordinator),
            ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"))


def _per_host(environ, host_index, hosts, hosts_name):
    """(rank, size, local rank, local size) for hosts x
    KERASDIST_PROCESSES_PER_HOST processes."""
    per = 1
    if environ.get(PER_HOST_ENV, "").strip():
        per = _int(environ, PER_HOST_ENV,
                   "the number of processes on each host (1 or more)", 1)
    local = 0
    if per > 1 or environ.get(LOCAL_RANK_ENV, "").strip():
        if environ.get(LOCAL_RANK_ENV, "").strip() == "":
            raise ValueError(
                f"{PER_HOST_ENV}={per} but {LOCAL_RANK_ENV} is not set; set "
                f"{LOCAL_RANK_ENV} to this process's index on its host, "
                f"0..{per - 1}.")
        local = _int(environ, LOCAL_RANK_ENV,
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


def _kerasdist(environ, full=True):
    """KERASDIST_NUM_PROCESSES, KERASDIST_COORDINATOR, and the rank from
    KERASDIST_RANK or an Indexed Job's JOB_COMPLETION_INDEX."""
    size_name = "KERASDIST_NUM_PROCESSES"
    if environ.get(size_name, "").strip() == "":
        raise ValueError(
            f"KERASDIST_RANK is set but {size_name} is not; set {size_name} "
            f"to the number of processes.")
    rank_name = ("KERASDIST_RANK" if environ.get("KERASDIST_RANK", "").strip()
                 else "JOB_COMPLETION_INDEX")
    if environ.get(rank_name, "").strip() == "":
        raise ValueError(
            f"{size_name} is set but neither KERASDIST_RANK nor "
            f"JOB_COMPLETION_INDEX is; run the pods as an Indexed Job "
            f"(completionMode: Indexed) or set KERASDIST_RANK to this "
            f"process's rank.")
    per = 1
    if environ.get(PER_HOST_ENV, "").strip():
        per = _int(environ, PER_HOST_ENV,
                   "the number of processes in each pod (1 or more)", 1)
    size = _int(environ, size_name, "the number of processes (1 or more)",
                minimum=1, maximum=MAX_PROCESSES)
    if size % per:
        raise ValueError(f"{size_name}={size} is not a multiple of "
                         f"{PER_HOST_ENV}={per}; set {size_name} to pods x "
                         f"{per}.")
    if rank_name == "KERASDIST_RANK":
        rank, size = _rank_and_size(environ, rank_name, size_name,
                                    "kerasdist's convention")
        local_rank = local_size = None
    else:
        pods = size // per
        index = _int(environ, rank_name, f"the pod's index, 0..{pods - 1}")
        if index >= pods:
            raise ValueError(
                f"{rank_name}={index} is not below {size_name}={size}"
                + (f" / {PER_HOST_ENV}={per}" if per > 1 else "")
                + f"; set {size_name} to the Job's completions"
                + (f" x {per}" if per > 1 else "") + ".")
        rank, size, local_rank, local_size = _per_host(
            environ, index, pods, rank_name)
    coordinator = None
    if full and size > 1:
        name = "KERASDIST_COORDINATOR"
        if environ.get(name, "").strip() == "":
            raise ValueError(
                f"{size_name} is set but {name} is not; set {name} to rank "
                f"0's host:port, e.g. <jobset>-<job>-0-0.<subdomain>:29500.")
        coordinator = _host_port(environ[name], name, "rank 0's host:port")
    return (Launch("kerasdist", rank, size, local_rank, local_size,
                   coordinator), (rank_name, size_name))


# TF_CONFIG's task types (and Vertex's worker pools) that are workers, in
# rank order: the chief is worker 0.
_TF_ROLES = {"TF_CONFIG": (("chief", "worker"), ("ps", "evaluator")),
             "CLUSTER_SPEC": (("workerpool0", "workerpool1"),
                              ("workerpool2", "workerpool3"))}


def _tf_config(environ, name):
    text = environ[name]
    workers, others = _TF_ROLES[name]
    try:
        spec = json.loads(text)
        cluster, task = spec["cluster"], spec["task"]
        kind, index = task["type"], int(task.get("index", 0))
        lists = [cluster.get(role) or [] for role in workers]
        if not all(isinstance(l, list) for l in lists):
            raise TypeError("a role is not a list")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{name} is not a cluster spec ({type(e).__name__}: {e}); set "
            f"{name} to JSON like {{\"cluster\": {{\"{workers[1]}\": "
            f"[\"host0:port\", \"host1:port\"]}}, \"task\": {{\"type\": "
            f"\"{workers[1]}\", \"index\": 0}}}}.") from None
    if kind in others:
        raise ValueError(
            f"{name} makes this process a {kind!r} task; kerasdist runs "
            f"only {workers[0]!r} and {workers[1]!r} tasks (no parameter "
            f"servers or evaluators): start none of type {kind!r}.")
    if kind not in workers:
        raise ValueError(f"{name} has task.type {kind!r}; set it to "
                         f"{workers[0]!r} or {workers[1]!r}.")
    if len(lists[0]) > 1:
        raise ValueError(f"{name} lists {len(lists[0])} {workers[0]!r} "
                         f"tasks; list at most one (it is worker 0).")
    mine = lists[workers.index(kind)]
    if not mine:
        raise ValueError(
            f"{name} has task {kind!r} but cluster.{kind} lists no "
            f"address; list every {kind!r} task's host:port there.")
    if not 0 <= index < len(mine):
        raise ValueError(
            f"{name} has task {kind!r} index {index} but cluster."
            f"{kind} lists {len(mine)}; set task.index to 0..{len(mine) - 1}"
            f" or list this task's address.")
    everyone = lists[0] + lists[1]
    rank = index + (len(lists[0]) if kind == workers[1] else 0)
    coordinator = None
    if len(everyone) > 1:
        coordinator = _host_port(str(everyone[0]), f"{name}'s first worker",
                                 "host:port")
    return Launch("tf_config", rank, len(everyone), None, None, coordinator)


def _tf(environ, full=True):
    # Present as detect() counts presence (set and not empty): a value of
    # blanks is a malformed spec, named as such.
    names = [n for n in ("TF_CONFIG", "CLUSTER_SPEC")
             if environ.get(n, "") != ""]
    launches = [_tf_config(environ, n) for n in names]
    if len(launches) == 2 and launches[0][1:3] != launches[1][1:3]:
        raise ValueError(
            f"TF_CONFIG says rank {launches[0].rank} of {launches[0].size} "
            f"but CLUSTER_SPEC says rank {launches[1].rank} of "
            f"{launches[1].size}; unset one of them.")
    return launches[0], None


def _sagemaker(environ, full=True):
    try:
        hosts = json.loads(environ["SM_HOSTS"])
        if not (isinstance(hosts, list) and hosts and
                all(isinstance(h, str) for h in hosts)):
            raise ValueError("not a list of host names")
    except ValueError:
        raise ValueError(
            f"SM_HOSTS={environ['SM_HOSTS']!r} is not a JSON list of host "
            f"names; set it like [\"algo-1\", \"algo-2\"].") from None
    current = environ.get("SM_CURRENT_HOST", "").strip()
    if current not in hosts:
        raise ValueError(
            f"SM_CURRENT_HOST={current!r} is not in SM_HOSTS={hosts}; set "
            f"SM_CURRENT_HOST to this host's name there.")
    rank, size, local_rank, local_size = _per_host(
        environ, hosts.index(current), len(hosts), "SM_HOSTS")
    coordinator = (hosts[0], SAGEMAKER_PORT) if size > 1 else None
    return (Launch("sagemaker", rank, size, local_rank, local_size,
                   coordinator), None)


def _expand_first(nodelist):
    """The first host of a Slurm node list: "kdt[0-1],x" -> "kdt0"."""
    text = nodelist.strip()
    # The first entry: up to the first comma outside brackets.
    depth, end = 0, len(text)
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    entry = text[:end]
    if entry.count("[") != entry.count("]") or not entry:
        return None

    def first(match):  # "[01-04,07]" -> "01"
        return match.group(1).split(",")[0].split("-")[0]
    host = re.sub(r"\[([^\]]*)\]", first, entry)
    return host if re.fullmatch(r"[A-Za-z0-9._-]+", host) else None


def first_host(nodelist):
    """The first host of a Slurm node list, from `scontrol show hostnames`
    where it works, else from the bracket forms parsed here."""
    scontrol = shutil.which("scontrol")
    if scontrol and "[" in nodelist:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return _expand_first(nodelist)


def _slurm_tasks_per_node(text, node):
    """Tasks on node `node` from "2(x3),1" (SLURM_STEP_TASKS_PER_NODE)."""
    # Counted, not expanded: "2(x100000000000)" must not become a list.
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        repeat = int(m.group(2) or 1)
        if 0 <= node < repeat:
            return int(m.group(1))
        node -= repeat
    return None


def _slurm(environ, full=True):
    size_name = ("SLURM_STEP_NUM_TASKS" if environ.get(
        "SLURM_STEP_NUM_TASKS", "").strip() else "SLURM_NTASKS")
    rank, size = _rank_and_size(environ, "SLURM_PROCID", size_name,
                                "srun's")
    local_rank = local_size = None
    if environ.get("SLURM_LOCALID", "").strip():
        local_rank = _int(environ, "SLURM_LOCALID",
                          "this task's index on its node")
        node = environ.get("SLURM_NODEID", "").strip()
        if node.isdigit():
            local_size = _slurm_tasks_per_node(
                environ.get("SLURM_STEP_TASKS_PER_NODE", ""), int(node))
        if local_size is not None and local_rank >= local_size:
            raise ValueError(
                f"SLURM_LOCALID={local_rank} is not below the "
                f"{local_size} tasks SLURM_STEP_TASKS_PER_NODE gives node "
                f"{node}; start the task with srun, which sets both.")
    coordinator = None
    if size > 1:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                     "SLURM_NODELIST"):
            if environ.get(name, "").strip():
                break
        else:
            raise ValueError(
                "SLURM_PROCID is set but SLURM_STEP_NODELIST is not; start "
                "the tasks with srun (which sets it) or set it to the "
                "step's nodes, task 0's first.")
        host = first_host(environ[name])
        if host is None:
            raise ValueError(
                f"{name}={environ[name]!r} is not a node list; set it like "
                f"node[0-3] or node0,node1 (task 0's node first).")
        job = _int(environ, "SLURM_JOB_ID", "the job's id") if environ.get(
            "SLURM_JOB_ID", "").strip() else 0
        step = _int(environ, "SLURM_STEP_ID", "the step's id")
        coordinator = (host, 10000 + (job * 64 + step) % 20000)
    return (Launch("slurm", rank, size, local_rank, local_size, coordinator),
            None)


def _with_port(environ, launch):
    """The launch with KERASDIST_COORDINATOR_PORT's port, where set."""
    text = environ.get(PORT_ENV, "").strip()
    if not text or launch.coordinator is None:
        return launch
    return launch._replace(coordinator=(launch.coordinator[0],
                                        _port(text, PORT_ENV)))


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
    Convention("mpi", MPI_VARIABLES, any, _mpi, True, False),
    Convention("torchrun", ("RANK", "WORLD_SIZE"), any, _torchrun, True,
               False),
    Convention("keras", ("KERAS_DISTRIBUTION_PROCESS_ID",
                         "KERAS_DISTRIBUTION_NUM_PROCESSES"), any, _keras,
               True, True),
    Convention("jax", ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"), any, _jax,
               True, True),
    Convention("kerasdist", ("KERASDIST_NUM_PROCESSES", "KERASDIST_RANK"),
               any, _kerasdist, True, True),
    Convention("tf_config", ("TF_CONFIG", "CLUSTER_SPEC"), any, _tf, False,
               True),
    Convention("sagemaker", ("SM_HOSTS",), any, _sagemaker, False, True),
    Convention("slurm", ("SLURM_PROCID", "SLURM_STEP_ID"), all, _slurm,
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
