"""The launch conventions' parsers (conventions.py's table): each reads
one platform's variables and returns (Launch, (rank variable, size
variable)), or raises a ValueError whose one line names the variable and
what to set.

Standard library only: imported before the runtime starts.
"""

import json
import re
import shutil
import subprocess

from kerasdist.rendezvous.environment import MAX_PROCESSES
from kerasdist.rendezvous.environment import PER_HOST_ENV
from kerasdist.rendezvous.environment import Launch
from kerasdist.rendezvous.environment import host_port
from kerasdist.rendezvous.environment import integer
from kerasdist.rendezvous.environment import per_host
from kerasdist.rendezvous.environment import port_number
from kerasdist.rendezvous.environment import rank_and_size
from kerasdist.rendezvous.environment import set_variables

SAGEMAKER_PORT = 29500


def from_mpi(environ, full=True):
    """The MPI launcher's rank and size where it gives them (`full` is
    unused: MPI needs no coordinator)."""
    local = None
    for rank_name, size_name in (("PMI_RANK", "PMI_SIZE"),
                                 ("OMPI_COMM_WORLD_RANK",
                                  "OMPI_COMM_WORLD_SIZE")):
        if set_variables(environ, (rank_name, size_name)) == [rank_name,
                                                         size_name]:
            rank, size = rank_and_size(environ, rank_name, size_name,
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


def from_torchrun(environ, full=True):
    """torchrun's variables, checked against Kubeflow's node variables."""
    rank, size = rank_and_size(environ, "RANK", "WORLD_SIZE",
                                "torchrun's env:// convention")
    present = set_variables(environ, ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if present:
        local_rank, local_size = rank_and_size(
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
                       port_number(environ["MASTER_PORT"].strip(),
                                   "MASTER_PORT"))
    launch = Launch("torchrun", rank, size, local_rank, local_size,
                    coordinator)
    return _pet(environ, launch), ("RANK", "WORLD_SIZE")


def from_keras(environ, full=True):
    names = ("KERAS_DISTRIBUTION_PROCESS_ID",
             "KERAS_DISTRIBUTION_NUM_PROCESSES")
    rank, size = rank_and_size(environ, *names,
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
        coordinator = (host.strip("[]"), port_number(port, name))
    return Launch("keras", rank, size, None, None, coordinator), names



def _pet(environ, launch):
    """Checks Kubeflow's / torchrun's node variables against RANK etc.;
    returns the launch, with local rank 0 of 1 where a node runs one."""
    def number(name, minimum):
        text = environ.get(name, "").strip()
        if not text.isdigit():  # absent, "auto", "gpu", a range "1:4"
            return None
        return integer(environ, name, "", minimum)
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


def from_jax(environ, full=True):
    rank, size = rank_and_size(environ, "JAX_PROCESS_ID",
                                "JAX_NUM_PROCESSES", "JAX's convention")
    coordinator = None
    if full and size > 1:
        name = "JAX_COORDINATOR_ADDRESS"
        if environ.get(name, "").strip() == "":
            raise ValueError(
                f"JAX_PROCESS_ID and JAX_NUM_PROCESSES are set but {name} "
                f"is not; set {name} to process 0's host:port (the same on "
                f"every process).")
        coordinator = host_port(environ[name], name,
                                 "process 0's host:port")
    return (Launch("jax", rank, size, None, None, coordinator),
            ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"))


def from_kerasdist(environ, full=True):
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
        per = integer(environ, PER_HOST_ENV,
                   "the number of processes in each pod (1 or more)", 1)
    size = integer(environ, size_name, "the number of processes (1 or more)",
                minimum=1, maximum=MAX_PROCESSES)
    if size % per:
        raise ValueError(f"{size_name}={size} is not a multiple of "
                         f"{PER_HOST_ENV}={per}; set {size_name} to pods x "
                         f"{per}.")
    if rank_name == "KERASDIST_RANK":
        rank, size = rank_and_size(environ, rank_name, size_name,
                                    "kerasdist's convention")
        local_rank = local_size = None
    else:
        pods = size // per
        index = integer(environ, rank_name, f"the pod's index, 0..{pods - 1}")
        if index >= pods:
            raise ValueError(
                f"{rank_name}={index} is not below {size_name}={size}"
                + (f" / {PER_HOST_ENV}={per}" if per > 1 else "")
                + f"; set {size_name} to the Job's completions"
                + (f" x {per}" if per > 1 else "") + ".")
        rank, size, local_rank, local_size = per_host(
            environ, index, pods, rank_name)
    coordinator = None
    if full and size > 1:
        name = "KERASDIST_COORDINATOR"
        if environ.get(name, "").strip() == "":
            raise ValueError(
                f"{size_name} is set but {name} is not; set {name} to rank "
                f"0's host:port, e.g. <jobset>-<job>-0-0.<subdomain>:29500.")
        coordinator = host_port(environ[name], name, "rank 0's host:port")
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
        coordinator = host_port(str(everyone[0]), f"{name}'s first worker",
                                 "host:port")
    return Launch("tf_config", rank, len(everyone), None, None, coordinator)


def from_tf(environ, full=True):
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


def from_sagemaker(environ, full=True):
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
    rank, size, local_rank, local_size = per_host(
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


def from_slurm(environ, full=True):
    size_name = ("SLURM_STEP_NUM_TASKS" if environ.get(
        "SLURM_STEP_NUM_TASKS", "").strip() else "SLURM_NTASKS")
    rank, size = rank_and_size(environ, "SLURM_PROCID", size_name,
                                "srun's")
    local_rank = local_size = None
    if environ.get("SLURM_LOCALID", "").strip():
        local_rank = integer(environ, "SLURM_LOCALID",
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
        job = integer(environ, "SLURM_JOB_ID", "the job's id") if environ.get(
            "SLURM_JOB_ID", "").strip() else 0
        step = integer(environ, "SLURM_STEP_ID", "the step's id")
        coordinator = (host, 10000 + (job * 64 + step) % 20000)
    return (Launch("slurm", rank, size, local_rank, local_size, coordinator),
            None)


