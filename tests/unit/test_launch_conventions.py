"""kerasdist.rendezvous.conventions.detect: environment in, a Launch out."""

import pytest

from kerasdist.rendezvous import client
from kerasdist.rendezvous import conventions
from kerasdist.rendezvous import platforms
from kerasdist.rendezvous import protocol
from kerasdist.rendezvous import server as rdv_server
from kerasdist.rendezvous.conventions import Launch
from kerasdist.rendezvous.conventions import detect

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500"}
KERAS = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:2345",
         "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
         "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
HYDRA = {"PMI_FD": "5", "PMI_RANK": "1", "PMI_SIZE": "4",
         "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


def with_(base, **change):
    env = dict(base)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    return env


def test_nothing_is_a_single_process():
    assert detect({"HOME": "/root"}) == Launch("single", 0, 1, 0, 1, None)


def test_torchrun():
    assert detect(TORCHRUN) == Launch("torchrun", 3, 4, 1, 2,
                                      ("node0", 29500))


def test_torchrun_without_local_variables():  # e.g. Kubeflow's PyTorchJob
    env = with_(TORCHRUN, LOCAL_RANK=None, LOCAL_WORLD_SIZE=None)
    assert detect(env) == Launch("torchrun", 3, 4, None, None,
                                 ("node0", 29500))


def test_torchrun_job_of_one_needs_no_coordinator():
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}) == Launch(
        "torchrun", 0, 1, None, None, None)


def test_keras():
    assert detect(KERAS) == Launch("keras", 1, 2, None, None,
                                   ("10.0.0.1", 1234))


def test_mpi_launcher_comes_first_and_keeps_todays_path():
    launch = detect(HYDRA)
    assert launch == Launch("mpi", 1, 4, 1, 2, None)
    # Agreeing torchrun variables change nothing.
    assert detect({**HYDRA, **with_(TORCHRUN, RANK="1")}) == launch
    for name in conventions.MPI_VARIABLES:
        assert detect({name: "1"}).convention == "mpi", name


@pytest.mark.parametrize("env, message", [
    (with_(TORCHRUN, WORLD_SIZE=None),
     "RANK is set but WORLD_SIZE is not; set WORLD_SIZE to the number of "
     "processes"),
    (with_(TORCHRUN, RANK=None),
     "WORLD_SIZE is set but RANK is not; set RANK to this process's rank"),
    (with_(TORCHRUN, RANK="4"),
     "RANK=4 is not below WORLD_SIZE=4; set RANK to 0..3"),
    (with_(TORCHRUN, RANK="one"), "RANK='one' is not an integer; set RANK"),
    (with_(TORCHRUN, RANK="-1"), "RANK='-1' is below 0; set RANK"),
    (with_(TORCHRUN, WORLD_SIZE="0"), "WORLD_SIZE='0' is below 1"),
    (with_(TORCHRUN, WORLD_SIZE="2.0"), "WORLD_SIZE='2.0' is not an integer"),
    (with_(TORCHRUN, WORLD_SIZE="1000000000"),
     "WORLD_SIZE='1000000000' is above 1048576, the most processes kerasdist "
     "forms a job of; set WORLD_SIZE to the number of processes"),
    (with_(TORCHRUN, LOCAL_WORLD_SIZE=None),
     "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not; set LOCAL_WORLD_SIZE"),
    (with_(TORCHRUN, LOCAL_RANK="2"),
     "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    (with_(TORCHRUN, LOCAL_WORLD_SIZE="8", LOCAL_RANK="0"),
     "LOCAL_WORLD_SIZE=8 is above WORLD_SIZE=4"),
    (with_(TORCHRUN, MASTER_ADDR=None),
     "RANK and WORLD_SIZE are set but MASTER_ADDR is not; set MASTER_ADDR"),
    (with_(TORCHRUN, MASTER_PORT=""),
     "RANK and WORLD_SIZE are set but MASTER_PORT is not"),
    (with_(TORCHRUN, MASTER_PORT="70000"),
     "MASTER_PORT gives port '70000'; set it to a TCP port in 1-65535"),
    (with_(KERAS, KERAS_DISTRIBUTION_JOB_ADDRESSES="10.0.0.1"),
     "KERAS_DISTRIBUTION_JOB_ADDRESSES='10.0.0.1' does not start with "
     "host:port"),
    (with_(KERAS, KERAS_DISTRIBUTION_PROCESS_ID="2"),
     "KERAS_DISTRIBUTION_PROCESS_ID=2 is not below "
     "KERAS_DISTRIBUTION_NUM_PROCESSES=2"),
    ({**TORCHRUN, **KERAS},
     "torchrun says rank 3 of 4 (RANK, WORLD_SIZE) but keras says rank 1 of "
     "2 (KERAS_DISTRIBUTION_PROCESS_ID, KERAS_DISTRIBUTION_NUM_PROCESSES); "
     "unset the variables"),
    ({**HYDRA, **TORCHRUN},
     "mpi says rank 1 of 4 (PMI_RANK, PMI_SIZE) but torchrun says rank 3 of "
     "4 (RANK, WORLD_SIZE)"),
    (with_(HYDRA, PMI_SIZE="x"), "PMI_SIZE='x' is not an integer"),
])
def test_bad_variables_are_one_line_value_errors(env, message):
    with pytest.raises(ValueError) as info:
        detect(env)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_secondary_convention_needs_no_coordinator():
    # Under an MPI launcher, torchrun's rank and size are only compared.
    env = {**HYDRA, "RANK": "1", "WORLD_SIZE": "4"}
    assert detect(env).convention == "mpi"


def test_describe():
    assert conventions.describe(detect(TORCHRUN)) == (
        "launch convention torchrun: rank 3 of 4, local rank 1 of 2, "
        "coordinator node0:29500")


def test_rendezvous_timeout_setting():
    assert protocol.timeout_from({}) == protocol.DEFAULT_TIMEOUT_S
    assert protocol.timeout_from(
        {protocol.TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="is not a positive number"):
            protocol.timeout_from({protocol.TIMEOUT_ENV: bad})


# ---- the platforms' conventions after torchrun -------------------------------

import json  # noqa: E402

PET = {**TORCHRUN, "PET_NNODES": "2", "PET_NODE_RANK": "1",
       "PET_NPROC_PER_NODE": "2"}
JAX = {"JAX_COORDINATOR_ADDRESS": "trainjob-node-0-0.trainjob:6666",
       "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
INDEXED = {"JOB_COMPLETION_INDEX": "1", "KERASDIST_NUM_PROCESSES": "2",
           "KERASDIST_COORDINATOR": "train-workers-0-0.train:29500"}
SAGEMAKER = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2",
             "SM_NUM_GPUS": "8"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_STEP_NODELIST": "kdt[0-1]", "SLURM_JOB_ID": "17",
         "SLURM_STEP_ID": "0"}


def tf_config(task_type, index, chief=True, workers=2, name="TF_CONFIG"):
    roles = ("chief", "worker") if name == "TF_CONFIG" else (
        "workerpool0", "workerpool1")
    cluster = {roles[1]: [f"w{i}:2222" for i in range(workers)],
               "ps": ["ps0:2222"]}
    if chief:
        cluster[roles[0]] = ["c0:2222"]
    return {name: json.dumps({"cluster": cluster,
                              "task": {"type": task_type, "index": index}})}


def test_kubeflow_node_variables_agree_with_torchrun():
    assert detect(PET) == Launch("torchrun", 3, 4, 1, 2, ("node0", 29500))
    # A PyTorchJob pod of one process started without torchrun.
    pod = with_(PET, LOCAL_RANK=None, LOCAL_WORLD_SIZE=None, RANK="1",
                WORLD_SIZE="2", PET_NPROC_PER_NODE="1")
    assert detect(pod) == Launch("torchrun", 1, 2, 0, 1, ("node0", 29500))
    # Non-numeric node variables (elastic ranges, "auto") are not checked.
    assert detect(with_(PET, PET_NNODES="1:4", PET_NPROC_PER_NODE="auto")
                  ).rank == 3


def test_jax():
    assert detect(JAX) == Launch("jax", 1, 2, None, None,
                                 ("trainjob-node-0-0.trainjob", 6666))


def test_indexed_job_and_jobset():
    assert detect(INDEXED) == Launch("kerasdist", 1, 2, 0, 1,
                                     ("train-workers-0-0.train", 29500))
    two_each = with_(INDEXED, KERASDIST_NUM_PROCESSES="4",
                     KERASDIST_PROCESSES_PER_HOST="2", KERASDIST_LOCAL_RANK="1")
    assert detect(two_each) == Launch("kerasdist", 3, 4, 1, 2,
                                      ("train-workers-0-0.train", 29500))
    # KERASDIST_RANK, where set, is the rank (no Indexed Job needed).
    own = with_(INDEXED, JOB_COMPLETION_INDEX=None, KERASDIST_RANK="0")
    assert detect(own).rank == 0


def test_tf_config_chief_is_worker_zero():
    assert detect(tf_config("chief", 0)) == Launch(
        "tf_config", 0, 3, None, None, ("c0", 2222))
    assert detect(tf_config("worker", 1)).rank == 2
    assert detect(tf_config("worker", 1, chief=False)) == Launch(
        "tf_config", 1, 2, None, None, ("w0", 2222))
    vertex = tf_config("workerpool1", 0, name="CLUSTER_SPEC")
    assert detect(vertex) == Launch("tf_config", 1, 3, None, None,
                                    ("c0", 2222))
    # Vertex sets both; they agree.
    assert detect({**vertex, **tf_config("worker", 0)}).rank == 1


def test_sagemaker_one_process_per_host_unless_told():
    assert detect(SAGEMAKER) == Launch("sagemaker", 1, 2, 0, 1,
                                       ("algo-1", 29500))
    more = with_(SAGEMAKER, KERASDIST_PROCESSES_PER_HOST="8",
                 KERASDIST_LOCAL_RANK="3")
    assert detect(more) == Launch("sagemaker", 11, 16, 3, 8,
                                  ("algo-1", 29500))
    assert detect(with_(SAGEMAKER, KERASDIST_COORDINATOR_PORT="7000")
                  ).coordinator == ("algo-1", 7000)


def test_srun_without_an_mpi_plugin():
    launch = detect(SLURM)
    assert launch[:5] == ("slurm", 3, 4, 1, 2)
    assert launch.coordinator[0] == "kdt0"
    assert 10000 <= launch.coordinator[1] < 30000
    # Another step of the job: another port.
    assert detect(with_(SLURM, SLURM_STEP_ID="1")).coordinator != \
        launch.coordinator
    # An sbatch script (no step) is not a task of a step.
    assert detect(with_(SLURM, SLURM_STEP_ID=None)).convention == "single"
    # srun --mpi=pmi2 sets PMI_*: MPI's path, as before.
    pmi2 = {**SLURM, "PMI_FD": "4", "PMI_RANK": "3", "PMI_SIZE": "4"}
    assert detect(pmi2).convention == "mpi"


@pytest.mark.parametrize("nodelist, first", [
    ("kdt[0-1]", "kdt0"), ("node[07-12,3]", "node07"), ("a,b[1-2]", "a"),
    ("rack[2-3]-gpu[010-011]", "rack2-gpu010"), ("single", "single"),
    ("kdt[0-1", None), ("", None),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert platforms._expand_first(nodelist) == first


def test_detect_walks_one_ordered_table_of_conventions():
    table = conventions.CONVENTIONS
    assert [c.name for c in table] == [
        "mpi", "torchrun", "keras", "jax", "kerasdist", "tf_config",
        "sagemaker", "slurm"]
    # The per-process conventions (1-5) come before the host-wide ones.
    assert [c.per_process for c in table] == [True] * 5 + [False] * 3
    assert [c.name for c in table if not c.port_setting] == ["mpi",
                                                              "torchrun"]
    samples = {"mpi": HYDRA, "torchrun": TORCHRUN, "keras": KERAS,
               "jax": JAX, "kerasdist": INDEXED,
               "tf_config": tf_config("chief", 0), "sagemaker": SAGEMAKER,
               "slurm": SLURM}
    for convention in table:
        env = samples[convention.name]
        # Each is marked by its variables, and its parser names it.
        assert convention.match(env.get(n, "") != ""
                                for n in convention.variables)
        launch, names = convention.parse(env, True)
        assert launch.convention == convention.name
        assert detect(env) == launch
        assert (names is None) == (not convention.per_process)
    # Slurm needs a step as well as a task (an sbatch script is neither).
    assert detect(with_(SLURM, SLURM_STEP_ID=None)).convention == "single"


def test_host_wide_conventions_yield_to_per_process_ones():
    # torchrun started under srun, in a Vertex or SageMaker container.
    env = {**SLURM, **tf_config("worker", 0), **SAGEMAKER, **TORCHRUN}
    assert detect(env).convention == "torchrun"
    assert detect({**SLURM, **SAGEMAKER}).convention == "sagemaker"
    assert detect({**SLURM, **tf_config("chief", 0)}).convention == \
        "tf_config"


@pytest.mark.parametrize("env, message", [
    (with_(PET, PET_NODE_RANK="2"),
     "PET_NODE_RANK=2 is not below PET_NNODES=2; set PET_NODE_RANK"),
    (with_(PET, PET_NNODES="3"),
     "WORLD_SIZE=4 is not PET_NNODES=3 x PET_NPROC_PER_NODE=2; set "
     "WORLD_SIZE to 6"),
    (with_(PET, LOCAL_RANK=None, LOCAL_WORLD_SIZE=None),
     "PET_NPROC_PER_NODE=2 but LOCAL_RANK is not set: these are a node's "
     "variables; start its 2 processes with torchrun"),
    (with_(PET, PET_NPROC_PER_NODE="4", PET_NNODES=None),
     "LOCAL_WORLD_SIZE=2 differs from PET_NPROC_PER_NODE=4"),
    (with_(PET, PET_NODE_RANK="0"),
     "RANK=3 is not PET_NODE_RANK=0 x PET_NPROC_PER_NODE=2 + LOCAL_RANK=1; "
     "set RANK to 1"),
    (with_(JAX, JAX_COORDINATOR_ADDRESS=None),
     "JAX_PROCESS_ID and JAX_NUM_PROCESSES are set but "
     "JAX_COORDINATOR_ADDRESS is not; set JAX_COORDINATOR_ADDRESS"),
    (with_(JAX, JAX_COORDINATOR_ADDRESS="node0"),
     "JAX_COORDINATOR_ADDRESS='node0' is not host:port"),
    (with_(JAX, JAX_PROCESS_ID="2"),
     "JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2"),
    (with_(JAX, JAX_NUM_PROCESSES=None),
     "JAX_PROCESS_ID is set but JAX_NUM_PROCESSES is not"),
    ({**JAX, **TORCHRUN},
     "torchrun says rank 3 of 4 (RANK, WORLD_SIZE) but jax says rank 1 of 2"),
    (with_(INDEXED, JOB_COMPLETION_INDEX=None),
     "KERASDIST_NUM_PROCESSES is set but neither KERASDIST_RANK nor "
     "JOB_COMPLETION_INDEX is; run the pods as an Indexed Job"),
    (with_(INDEXED, KERASDIST_NUM_PROCESSES=None, KERASDIST_RANK="0"),
     "KERASDIST_RANK is set but KERASDIST_NUM_PROCESSES is not"),
    (with_(INDEXED, KERASDIST_COORDINATOR=None),
     "KERASDIST_NUM_PROCESSES is set but KERASDIST_COORDINATOR is not; set "
     "KERASDIST_COORDINATOR to rank 0's host:port, e.g. "
     "<jobset>-<job>-0-0.<subdomain>:29500"),
    (with_(INDEXED, KERASDIST_COORDINATOR="train:port"),
     "KERASDIST_COORDINATOR gives port 'port'"),
    (with_(INDEXED, JOB_COMPLETION_INDEX="2"),
     "JOB_COMPLETION_INDEX=2 is not below KERASDIST_NUM_PROCESSES=2; set "
     "KERASDIST_NUM_PROCESSES to the Job's completions"),
    (with_(INDEXED, KERASDIST_NUM_PROCESSES="3",
           KERASDIST_PROCESSES_PER_HOST="2"),
     "KERASDIST_NUM_PROCESSES=3 is not a multiple of "
     "KERASDIST_PROCESSES_PER_HOST=2"),
    (with_(INDEXED, KERASDIST_NUM_PROCESSES="4",
           KERASDIST_PROCESSES_PER_HOST="2"),
     "KERASDIST_PROCESSES_PER_HOST=2 but KERASDIST_LOCAL_RANK is not set"),
    (with_(INDEXED, KERASDIST_NUM_PROCESSES="4",
           KERASDIST_PROCESSES_PER_HOST="2", KERASDIST_LOCAL_RANK="2"),
     "KERASDIST_LOCAL_RANK=2 is not below KERASDIST_PROCESSES_PER_HOST=2"),
    (with_(INDEXED, KERASDIST_COORDINATOR_PORT="0"),
     "KERASDIST_COORDINATOR_PORT gives port '0'"),
    ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not a cluster spec"),
    ({"TF_CONFIG": "  "}, "TF_CONFIG is not a cluster spec (JSONDecodeError"),
    ({"TF_CONFIG": '{"cluster": {"worker": []}, "task": {"type": "worker"}}'},
     "TF_CONFIG has task 'worker' but cluster.worker lists no address; list "
     "every 'worker' task's host:port there."),
    ({"TF_CONFIG": '{"cluster": {}}'},
     "TF_CONFIG is not a cluster spec (KeyError: 'task')"),
    (tf_config("ps", 0),
     "TF_CONFIG makes this process a 'ps' task; kerasdist runs only 'chief' "
     "and 'worker' tasks"),
    (tf_config("worker", 2),
     "TF_CONFIG has task 'worker' index 2 but cluster.worker lists 2; set "
     "task.index to 0..1"),
    (tf_config("evaluator", 0, name="CLUSTER_SPEC"),
     "CLUSTER_SPEC has task.type 'evaluator'; set it to 'workerpool0' or "
     "'workerpool1'"),
    ({**tf_config("worker", 0), **tf_config("workerpool1", 1,
                                            name="CLUSTER_SPEC")},
     "TF_CONFIG says rank 1 of 3 but CLUSTER_SPEC says rank 2 of 3"),
    (with_(SAGEMAKER, SM_HOSTS="algo-1,algo-2"),
     "SM_HOSTS='algo-1,algo-2' is not a JSON list of host names"),
    (with_(SAGEMAKER, SM_CURRENT_HOST="algo-3"),
     "SM_CURRENT_HOST='algo-3' is not in SM_HOSTS=['algo-1', 'algo-2']"),
    (with_(SAGEMAKER, KERASDIST_PROCESSES_PER_HOST="0"),
     "KERASDIST_PROCESSES_PER_HOST='0' is below 1"),
    (with_(SLURM, SLURM_NTASKS=None, SLURM_STEP_NUM_TASKS=None),
     "SLURM_PROCID is set but SLURM_NTASKS is not"),
    (with_(SLURM, SLURM_PROCID="4"),
     "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"),
    (with_(SLURM, SLURM_LOCALID="2"),
     "SLURM_LOCALID=2 is not below the 2 tasks SLURM_STEP_TASKS_PER_NODE "
     "gives node 1"),
    (with_(SLURM, SLURM_STEP_NODELIST=None),
     "SLURM_PROCID is set but SLURM_STEP_NODELIST is not"),
    (with_(SLURM, SLURM_STEP_NODELIST="kdt[0-1"),
     "SLURM_STEP_NODELIST='kdt[0-1' is not a node list"),
    (with_(SLURM, SLURM_STEP_ID="x"), "SLURM_STEP_ID='x' is not an integer"),
])
def test_platform_variables_bad_are_one_line_value_errors(env, message):
    with pytest.raises(ValueError) as info:
        detect(env)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_doctor_names_the_convention():
    from kerasdist.tools import doctor
    status, line = doctor.launch_check(INDEXED)
    assert status == doctor.OK
    assert line.startswith("launch convention kerasdist: rank 1 of 2, local "
                           "rank 0 of 1, coordinator train-workers-0-0.train:"
                           "29500"), line
    status, line = doctor.launch_check(with_(JAX, JAX_PROCESS_ID="2"))
    assert status == doctor.FAIL and "JAX_PROCESS_ID=2" in line
    assert doctor.launch_check({})[0] == doctor.INFO
    assert "MPI starts from its launcher" in doctor.launch_check(HYDRA)[1]


# ---- the rendezvous server when a platform restarts a job ----------------

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402


def _serve(port, size, timeout):
    """rank 0's rendezvous server, as kd.init() starts it; ends when its
    stdin closes (rank 0 gone) and no rank's MPI is connected."""
    return subprocess.Popen(
        [sys.executable, "-I", rdv_server.__file__, "serve", str(port),
         str(size), str(timeout)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)


def _end(server):
    server.stdin.close()
    server.wait(timeout=20)


def _hello(port, rank, size, job="unnamed", key=None):
    """Says hello as rank `rank` of `size` of job `job` (its key: that of
    a job without a secret), proving the key as join() does; returns the
    server's reply without its proof."""
    key = key or protocol.identity({protocol.JOB_ID_ENV: job})[1]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(f"cmd=kd_auth job={job} nonce=n{rank}\n".encode())
        t = protocol.tokens(protocol.read_line(s))
        assert t["cmd"] == "kd_challenge" and t["rc"] == "0", t
        proof = protocol.mac_of(key, "hello", t["nonce"], f"n{rank}", rank,
                                size)
        s.sendall(f"cmd=kd_hello rank={rank} size={size} proof={proof}\n"
                  .encode())
        return protocol.read_line(s).rpartition(" mac=")[0]


def _listening_socket():
    holder = socket.socket()
    holder.bind(("", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


@pytest.mark.timeout(60)
def test_rank_0_waits_for_a_port_an_earlier_server_holds():
    holder, port = _listening_socket()
    server = _serve(port, 1, 30)
    try:
        assert server.stdout.readline().strip() == f"waiting {port}"
        holder.close()  # the earlier run's server has ended
        assert server.stdout.readline().strip() == f"ready {port}"
        assert _hello(port, 0, 1).startswith("cmd=kd_ready rc=0 pmiid=")
    finally:
        holder.close()
        _end(server)


@pytest.mark.timeout(60)
def test_a_port_in_use_for_the_whole_timeout_is_one_error():
    holder, port = _listening_socket()
    start = time.monotonic()
    try:
        server = _serve(port, 1, 1)
        assert server.stdout.readline().strip() == f"waiting {port}"
        line = server.stdout.readline().strip()
        assert server.wait(timeout=20) == 1
    finally:
        holder.close()
    assert line.endswith("(the coordinator's port must be free on rank 0's "
                         "host)"), line
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_a_hello_to_an_earlier_runs_server_waits_for_the_next_one():
    """The earlier run's server (its job formed) still listens when the
    restarted run's rank 1 arrives: rank 1 is told so and retries, and
    joins the next run's server once that one listens."""
    holder, port = _listening_socket()
    holder.close()
    old = _serve(port, 2, 30)
    new = None
    try:
        assert old.stdout.readline().strip() == f"ready {port}"
        replies = []
        hellos = [threading.Thread(
            target=lambda r=r: replies.append(_hello(port, r, 2)))
            for r in range(2)]  # the earlier run forms
        for t in hellos:
            t.start()
        for t in hellos:
            t.join(20)
        assert [r.split()[:2] for r in replies] == [
            ["cmd=kd_ready", "rc=0"]] * 2
        assert _hello(port, 1, 2).startswith("cmd=kd_ready rc=2 msg=its job "
                                             "of 2 formed")
        joined = {}
        launch = Launch("torchrun", 1, 2, 1, 2, ("127.0.0.1", port))
        rank1 = threading.Thread(target=lambda: joined.update(
            client.join(launch, 30, environ={}, watch=False)))
        rank1.start()
        time.sleep(1.0)
        assert rank1.is_alive() and not joined  # waiting, not failed
        _end(old)
        new = _serve(port, 2, 30)
        line = new.stdout.readline().strip()
        if line.startswith("waiting"):  # the old listener not yet gone
            line = new.stdout.readline().strip()
        assert line == f"ready {port}"
        assert _hello(port, 0, 2).startswith("cmd=kd_ready rc=0 pmiid=")
        rank1.join(20)
        # PMI_ID: the one-time number MPICH's client proves itself with.
        assert int(joined.pop("PMI_ID")) > 0
        assert joined == {"PMI_PORT": f"127.0.0.1:{port}",
                          "PMI_RANK": "1", "PMI_SIZE": "2"}
    finally:
        for server in (old, new):
            if server is not None and server.poll() is None:
                _end(server)


def test_a_rendezvous_that_fails_builds_nothing_the_size_of_the_job():
    # At the deadline the server names the first missing ranks; it used to
    # build the set of all of them (gigabytes for a WORLD_SIZE of 10**9;
    # hundreds of megabytes for the 10**7 here).
    import tracemalloc

    server = rdv_server._Server(10 ** 7, 1.0)
    tracemalloc.start()
    try:
        with server.cv:
            server.fail_hello()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert server.failed and server.hello_done
    assert peak < 1 << 20, peak
