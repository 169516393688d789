"""The Kubernetes recipes of docs/kubernetes.md, each held to
what its platform gives the processes, on the namespace test cluster: one
test host per pod, with the pod's host name, the DNS names the platform
makes for it (in the cluster's hosts file), and exactly the platform's
variables, paths and files, as read in the platform's own source:

- Kubeflow MPIJob v2 (kubeflow/mpi-operator v0.8.0,
  pkg/controller/mpi_job_controller.go): pods `<job>-launcher` and
  `<job>-worker-<i>` (Hostname, Subdomain = the job's name); the hostfile
  in the launcher at /etc/mpi/hostfile (newConfigMap: one line per worker,
  `<job>-worker-<i>.<job>.<namespace>.svc:<slots>` for MPICH and Intel,
  `... slots=<slots>` for Open MPI); launcher variables K_MPI_JOB_ROLE,
  and per implementation HYDRA_HOST_FILE + HYDRA_LAUNCH_EXTRA_ARGS (MPICH)
  or OMPI_MCA_orte_default_hostfile, OMPI_MCA_orte_keep_fqdn_hostnames,
  OMPI_MCA_plm_rsh_args, OMPI_MCA_orte_set_default_slots (Open MPI); the
  workers run sshd, the launcher reaches them with ssh (the operator's key
  pair; here a key of the test's, named in the launcher's ssh_config).
- JobSet (kubernetes-sigs/jobset v0.12.0, pkg/controllers/
  jobset_controller.go): pods `<jobset>-<replicatedJob>-<job>-<pod>` of
  Indexed Jobs (Kubernetes sets JOB_COMPLETION_INDEX), reached at
  `<pod>.<subdomain>` (GetSubdomain: the JobSet's name by default); the
  pods carry the label jobset.sigs.k8s.io/restart-attempt (the recipe
  gives it to the process as KERASDIST_RESTART_ATTEMPT, through the
  Downward API). failurePolicy: a failed Job makes the controller delete
  every Job of the set and create them all again, with the same template
  and restart-attempt + 1; the test plays that controller.
- Kubeflow Trainer v2 (kubeflow/trainer v2.3.0, pkg/runtime/framework/
  plugins/torch/torch.go, pkg/constants/constants.go): the torch policy
  sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (from the completion
  index), PET_MASTER_ADDR=<trainjob>-node-0-0.<trainjob> and
  PET_MASTER_PORT=29500 in the `node` container, and nothing else (no
  RANK, no WORLD_SIZE): the recipe's command is `kerasdist run python
  train.py`, node mode from the PET_* variables, as torchrun reads them.
- Kubeflow PyTorchJob (kubeflow/trainer v1.9.4, the training-operator:
  pkg/controller.v1/pytorch/envvar.go and master.go): MASTER_ADDR=
  <job>-master-0 (a Service per replica), MASTER_PORT=23456 (the default
  port), PET_MASTER_ADDR, PET_MASTER_PORT, WORLD_SIZE, RANK (the Master is
  0, Worker i is i + 1), PET_NODE_RANK, PET_NNODES, PYTHONUNBUFFERED=1;
  here with Keras on torch (KERAS_BACKEND=torch).

Every job trains a small Keras model a few steps and must reach the
weights of a single process trained on the concatenated batches, 1e-5
(tests/workers/keras_backend_worker.py's fit_sgd check, run on each rank);
the JobSet's job is killed and restarted, and its Trainer must end where
the same uninterrupted job under `kerasdist run` ends.

One cluster for the module, every job at once. The Open MPI MPIJob
(mpiImplementation: OpenMPI) runs kerasdist built against Open MPI
(tests/cluster/conftest.py's openmpi_root) under `kerasdist run`, which
starts it with Open MPI's mpirun; its ranks check the collectives and a
fit (tests/workers/openmpi_worker.py, on the JAX backend: that build has
no TensorFlow op library) instead of fit_sgd.
"""

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.support import system
from tests.support.cluster import Cluster
from tests.support.cluster import processes_in
from tests.support.cluster import require
from tests.support.cluster import start_sshd
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import kill_tree
from tests.support.helpers import launch
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

# The module's jobs run in the first test's setup (about 200 s on a
# machine with 2 cores and a load of 16; less where the CPUs are free).
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

NAMESPACE = "default"
MPIJOB = "mpijob"
LAUNCHER = f"{MPIJOB}-launcher"
WORKERS = [f"{MPIJOB}-worker-{i}" for i in range(2)]
JOBSET = [f"jobset-workers-0-{i}" for i in range(2)]
TRAINJOB = [f"trainjob-node-0-{i}" for i in range(2)]
PYTORCHJOB = ["pytorchjob-master-0", "pytorchjob-worker-0"]
HOSTFILE = "/etc/mpi/hostfile"

FIT = ["--only", "fit_sgd"]
HEARTBEAT_S = 3
# From the kill to the other process's end: a dead peer's heartbeat
# connection closes at once; the rest is slack for a loaded machine.
BOUND_S = HEARTBEAT_S + 12
TIMEOUT_S = 300

# Variables of other launchers that the test's own environment may hold.
DROP = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "KERAS_DISTRIBUTION_", "JAX_",
        "SLURM_", "SM_", "PET_", "TF_CONFIG", "CLUSTER_SPEC", "HYDRA_",
        "I_MPI_", "JOB_COMPLETION_INDEX", "KERASDIST_NUM_PROCESSES",
        "KERASDIST_COORDINATOR", "KERASDIST_RANK", "KERASDIST_RESTART",
        "TORCHELASTIC_", "K_MPI_")
TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT")


def _svc(pod, subdomain):
    return f"{pod}.{subdomain}.{NAMESPACE}.svc"


def _env(pod, **platform):
    """The test's environment less other launchers' variables, the pod's
    HOSTNAME and the platform's variables."""
    env = worker_env(KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=90)
    for k in list(env):
        if k.startswith(DROP) or k in TORCH_NAMES:
            del env[k]
    env["HOSTNAME"] = pod
    env.update({k: str(v) for k, v in platform.items()})
    return env


def _private_etc(cluster, host):
    """Gives `host` an /etc of its own (an overlay on the machine's, upper
    layer in the host's /run), so files can be put where the platform puts
    them without touching the machine's; its /etc/hosts and nsswitch.conf
    stay the cluster's."""
    cluster.run(host, ["sh", "-c", " && ".join([
        "mkdir -p /run/etc-upper /run/etc-work",
        "mount -t overlay overlay -o lowerdir=/etc,upperdir=/run/etc-upper,"
        "workdir=/run/etc-work /etc",
        f"mount --bind {cluster._hosts_file} /etc/hosts",
        f"mount --bind {cluster._nsswitch} /etc/nsswitch.conf"])])


def _put(cluster, host, path, text):
    cluster.run(host, ["sh", "-c", f"mkdir -p {os.path.dirname(path)} && "
                       f"cat > {path}"], input=text)


def _stop_sshd(cluster):
    for pod in WORKERS:
        cluster.run(cluster.host(pod), ["sh", "-c", "[ -f /run/sshd.pid ] "
                                        "&& kill $(cat /run/sshd.pid); true"])


def _need_openssh():
    system.require("openssh-server", "openssh-client")


class Pod:
    """One process started in a host, as the pod's container; output to a
    file (no pipe to fill while the test waits on others)."""

    def __init__(self, cluster, name, argv, env, log):
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.proc = cluster.popen(
                cluster.host(name), argv, env=env, cwd=REPO_ROOT,
                stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()
        self.ended = None

    def poll(self):
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()
        return self.proc.returncode

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def kill(self):
        kill_tree(self.proc)
        self.proc.wait()


def _wait(pods, deadline, until_one_fails=False):
    """Polls `pods` until all ended (or, with until_one_fails, one ended
    non-zero); kills all of them when the deadline passes."""
    try:
        while True:
            codes = [p.poll() for p in pods]
            if all(c is not None for c in codes):
                return
            if until_one_fails and any(c not in (None, 0) for c in codes):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    "pods still running at the deadline: " + "; ".join(
                        f"{p.name}:\n{p.output()[-2000:]}" for p in pods
                        if p.poll() is None))
            time.sleep(0.05)
    except BaseException:
        for p in pods:
            p.kill()
        raise


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require()
    _need_openssh()
    keys = str(tmp_path_factory.mktemp("keys"))
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                        os.path.join(keys, name)], check=True)
    shutil.copy(os.path.join(keys, "client_key.pub"),
                os.path.join(keys, "authorized_keys"))
    with Cluster(names=[LAUNCHER, *WORKERS, *JOBSET, *TRAINJOB,
                        *PYTORCHJOB]) as c:
        for pod in (LAUNCHER, *WORKERS):
            c.add_aliases(c.host(pod), _svc(pod, MPIJOB))
        for pods, subdomain in ((JOBSET, "jobset"), (TRAINJOB, "trainjob")):
            for pod in pods:
                c.add_aliases(c.host(pod), f"{pod}.{subdomain}")
        # The MPIJob's launcher: the operator's hostfile goes to /etc/mpi,
        # its ssh reaches the workers' sshd (the image's ssh_config turns
        # host key checking off, as mpi-operator's base images do).
        _private_etc(c, c.host(LAUNCHER))
        _put(c, c.host(LAUNCHER), "/etc/ssh/ssh_config",
             f"Host *\n  IdentityFile {keys}/client_key\n"
             "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
             "  LogLevel ERROR\n")
        for pod in WORKERS:
            start_sshd(c, c.host(pod), keys)
        try:
            yield c
        finally:
            _stop_sshd(c)


def _mpijob_env(implementation):
    """The launcher container's variables (newLauncherPodTemplate)."""
    env = {"K_MPI_JOB_ROLE": "launcher", "NVIDIA_VISIBLE_DEVICES": "",
           "NVIDIA_DRIVER_CAPABILITIES": ""}
    if implementation == "MPICH":
        env.update(HYDRA_HOST_FILE=HOSTFILE,
                   HYDRA_LAUNCH_EXTRA_ARGS="-o ConnectionAttempts=10")
    else:
        env.update(OMPI_MCA_orte_keep_fqdn_hostnames="true",
                   OMPI_MCA_orte_default_hostfile=HOSTFILE,
                   OMPI_MCA_plm_rsh_args="-o ConnectionAttempts=10",
                   OMPI_MCA_orte_set_default_slots=1)
    return _env(LAUNCHER, **env)


def _mpijob_hostfile(implementation, slots=1):
    line = "{}:{}\n" if implementation == "MPICH" else "{} slots={}\n"
    return "".join(line.format(_svc(w, MPIJOB), slots) for w in WORKERS)


def _kerasdist_run(*argv):
    return [sys.executable, "-m", "kerasdist.run", *argv]


def _jobset_env(index, attempt):
    return _env(JOBSET[index], JOB_COMPLETION_INDEX=index,
                KERASDIST_NUM_PROCESSES=2,
                KERASDIST_COORDINATOR=f"{JOBSET[0]}.jobset:29500",
                KERASDIST_RESTART_ATTEMPT=attempt,
                KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=HEARTBEAT_S,
                KERASDIST_HEARTBEAT_INTERVAL_SECONDS=0.5)


def _trainjob_env(index):
    return _env(TRAINJOB[index], PET_NNODES=2, PET_NPROC_PER_NODE=1,
                PET_NODE_RANK=index, PET_MASTER_ADDR=f"{TRAINJOB[0]}.trainjob",
                PET_MASTER_PORT=29500, JOB_COMPLETION_INDEX=index)


def _pytorchjob_env(rank):
    return _env(PYTORCHJOB[rank], PYTHONUNBUFFERED=1,
                MASTER_ADDR=PYTORCHJOB[0], MASTER_PORT=23456,
                PET_MASTER_ADDR=PYTORCHJOB[0], PET_MASTER_PORT=23456,
                WORLD_SIZE=2, RANK=rank, PET_NODE_RANK=rank, PET_NNODES=2,
                KERAS_BACKEND="torch")


# Printed by each rank of the MPIJob before it trains: where it runs.
# (The rank: hydra's PMI_RANK, or Open MPI's OMPI_COMM_WORLD_RANK.)
WHERE = ("import os, socket; e = os.environ; print('WHERE', "
         "socket.gethostname(), e['KERASDIST_HOSTNAME'], "
         "e['K_MPI_JOB_ROLE'], e.get('PMI_RANK', "
         "e.get('OMPI_COMM_WORLD_RANK')))")


def _openmpi_job(cluster, root):
    """The MPIJob with mpiImplementation: OpenMPI: the operator's hostfile
    (`slots=` form) and variables in the launcher, and `kerasdist run` of
    kerasdist built against Open MPI (`root`, tests/cluster/conftest.py),
    which reads the hostfile from OMPI_MCA_orte_default_hostfile and starts
    the ranks with Open MPI's mpirun -H over ssh in the worker pods; each
    rank runs tests/workers/openmpi_worker.py (the collectives against
    numpy, a fit against one process): (exit code, output)."""
    _put(cluster, cluster.host(LAUNCHER), HOSTFILE,
         _mpijob_hostfile("OpenMPI"))
    env = _mpijob_env("OpenMPI")
    env["PYTHONPATH"] = os.pathsep.join([root, REPO_ROOT])
    argv = _kerasdist_run("--verbose", "sh", "-c",
                          '"$0" -c "$1" && shift && exec "$@"',
                          sys.executable, WHERE,
                          *worker_cmd("openmpi_worker.py"))
    # Its working directory is the Open MPI build's (mpirun starts the
    # ranks there too), so `python -c` and the wrapper import that build.
    proc = cluster.popen(cluster.host(LAUNCHER), argv, env=env, cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True,
                         start_new_session=True)
    try:
        text = proc.communicate(timeout=240)[0]
    finally:
        kill_tree(proc)
    return proc.returncode, text


@pytest.fixture(scope="module")
def jobs(cluster, openmpi_root, tmp_path_factory):
    """Every recipe's job at once; the JobSet's is killed in epoch 2 and
    started again by the test, as its controller would. Returns
    {name: [Pod, ...]}, with "jobset0"/"jobset1" the two attempts,
    "reference" the uninterrupted Trainer job under `kerasdist run` (a
    CompletedProcess) and "openmpi" the Open MPI MPIJob's launcher run
    (_openmpi_job: (exit code, output)), made once the MPICH job's
    launcher has ended."""
    root = tmp_path_factory.mktemp("jobs")
    fit = worker_cmd("keras_backend_worker.py", str(root), *FIT)
    trainer = worker_cmd("trainer_worker.py", "resume", str(root / "ckpt"),
                         str(root / "jobset.npy"), "--kill-in-epoch", "2",
                         "--epochs", "2")
    deadline = time.monotonic() + TIMEOUT_S
    pods = {"mpijob": [], "trainjob": [], "pytorchjob": [], "jobset0": []}
    started = []
    try:
        _put(cluster, cluster.host(LAUNCHER), HOSTFILE,
             _mpijob_hostfile("MPICH"))

        def start(job, name, argv, env):
            pod = Pod(cluster, name, argv, env, root / f"{job}.{name}.log")
            pods.setdefault(job, []).append(pod)
            started.append(pod)
            return pod

        start("mpijob", LAUNCHER, _kerasdist_run(
            "sh", "-c", '"$0" -c "$1" && shift && exec "$@"',
            sys.executable, WHERE, *fit), _mpijob_env("MPICH"))
        for i in (0, 1):
            start("jobset0", JOBSET[i], trainer, _jobset_env(i, 0))
            start("trainjob", TRAINJOB[i], _kerasdist_run(*fit),
                  _trainjob_env(i))
            start("pytorchjob", PYTORCHJOB[i], fit, _pytorchjob_env(i))
        # The uninterrupted job, on this machine, meanwhile.
        reference = {}

        def run_reference():
            reference["out"] = launch(
                2, worker_cmd("trainer_worker.py", "resume",
                              str(root / "ref"), str(root / "ref.npy"),
                              "--epochs", "2"),
                timeout=TIMEOUT_S - 30, env=worker_env())

        thread = threading.Thread(target=run_reference, daemon=True)
        thread.start()
        # The JobSet controller: once a Job has failed, the others' pods
        # end by themselves (the heartbeat); then the set is made again.
        _wait(pods["jobset0"], deadline)
        for i in (0, 1):
            start("jobset1", JOBSET[i], trainer, _jobset_env(i, 1))
        # The launcher is free again: Open MPI's form of its hostfile.
        _wait(pods["mpijob"], deadline)
        pods["openmpi"] = _openmpi_job(cluster, openmpi_root)
        _wait(started, deadline)
        thread.join(max(1, deadline - time.monotonic()))
        pods["reference"] = reference.get("out")
    except BaseException:
        for p in started:
            p.kill()
        raise
    pods["root"] = root
    t0 = min(p.started for p in started)
    print("pod end times (s):", ", ".join(
        f"{p.log.name[:-4]} {p.ended - t0:.1f}" for p in started))
    yield pods
    for p in started:
        p.kill()


def _assert_fit(job, results, logs):
    """Each rank passed fit_sgd: its weights are the single-process
    truth's on the concatenated batches (1e-5)."""
    for r, lines in enumerate(results):
        assert "OK fit_sgd" in lines and "DONE" in lines, (
            job, r, "\n".join(lines[-40:]), logs[-3000:])


def _assert_placed(implementation, name, out):
    """The hostfile was read from the variable the operator sets, one rank
    per worker (slots 1), each started over ssh in its worker pod."""
    hosts = ",".join(f"{_svc(w, MPIJOB)}:1" for w in WORKERS)
    assert f"kerasdist: hosts from {name}={HOSTFILE}: {hosts}\n" in out, (
        implementation, out[-3000:])
    for r, worker in enumerate(WORKERS):
        assert f"WHERE {worker} {worker} launcher {r}" in rank_lines(
            out, r), (implementation, r, out[-3000:])


def test_mpijob_mpich_trains_like_one_process(jobs):
    [launcher] = jobs["mpijob"]
    out = launcher.output()
    assert launcher.poll() == 0, out[-4000:]
    _assert_placed("MPICH", "HYDRA_HOST_FILE", out)
    _assert_fit("mpijob", [rank_lines(out, r) for r in (0, 1)], out)


def test_mpijob_open_mpi_runs_under_its_mpirun(jobs):
    rc, out = jobs["openmpi"]
    assert rc == 0, out[-4000:]
    _assert_placed("OpenMPI", "OMPI_MCA_orte_default_hostfile", out)
    assert "mpirun -np 2 --oversubscribe --bind-to none " in out, out[:3000]
    for r in (0, 1):
        lines = rank_lines(out, r)
        assert any(l.startswith("MPI openmpi Open MPI v5") for l in lines), (
            r, lines[-20:])
        for check in ("allreduce", "allgather", "broadcast", "fit"):
            assert f"OK {check}" in lines, (r, check, lines[-20:])
        assert lines[-1] == "DONE", (r, lines[-20:])


def test_trainjob_torch_policy_trains_like_one_process(jobs):
    for i, pod in enumerate(jobs["trainjob"]):
        out = pod.output()
        assert pod.poll() == 0, out[-4000:]
        assert (f"kerasdist: node mode from the PET_* variables: node {i} "
                f"of 2, 1 rank(s) here, master {TRAINJOB[0]}.trainjob:29500"
                in out), out[-3000:]
        _assert_fit("trainjob", [rank_lines(out, i)], out)
    head = jobs["trainjob"][0].output()
    assert (f"launch convention torchrun: rank 0 of 2, local rank 0 of 1, "
            f"coordinator {TRAINJOB[0]}.trainjob:29500") in head, head[-3000:]


def test_pytorchjob_keras_on_torch_trains_like_one_process(jobs):
    for rank, pod in enumerate(jobs["pytorchjob"]):
        out = pod.output()
        assert pod.poll() == 0, out[-4000:]
        _assert_fit("pytorchjob", [out.splitlines()], out)
    head = jobs["pytorchjob"][0].output()
    assert (f"launch convention torchrun: rank 0 of 2, local rank 0 of 1, "
            f"coordinator {PYTORCHJOB[0]}:23456") in head, head[-3000:]


def test_jobset_restart_resumes_to_the_uninterrupted_weights(jobs):
    """Attempt 0: the process of pod 1 is SIGKILLed in epoch 2; pod 0's
    ends by itself with 75 within the heartbeat's bound. Attempt 1 (the
    same variables, restart-attempt 1) resumes from the epoch-1
    checkpoint and ends with the weights of the uninterrupted job under
    `kerasdist run` (1e-5)."""
    first, second = jobs["jobset0"], jobs["jobset1"]
    out0, out1 = first[0].output(), first[1].output()
    assert first[1].poll() == -9 and "kills itself" in out1, out1[-3000:]
    assert first[0].poll() == 75, out0[-3000:]
    assert re.search(rf"kerasdist: rank 0: lost host {JOBSET[1]} \(rank 1\): "
                     r"its connection closed .*; ending this rank", out0), (
        out0[-3000:])
    assert 0 <= first[0].ended - first[1].ended < BOUND_S, (
        first[0].ended - first[1].ended)
    for pod in second:
        assert pod.poll() == 0, pod.output()[-4000:]
        assert "OK resumed_job_finished" in pod.output()
    head = second[0].output()
    assert (f"launch convention kerasdist: rank 0 of 2, local rank 0 of 1, "
            f"coordinator {JOBSET[0]}.jobset:29500") in head, head[-3000:]
    assert "restart attempt 2 (KERASDIST_RESTART_ATTEMPT=1)" in head, (
        head[-3000:])
    assert "at epoch 2 of 2" in head, head[-3000:]
    ref = jobs["reference"]
    assert ref is not None and ref.returncode == 0, (
        ref and ref.stdout[-4000:])
    root = jobs["root"]
    np.testing.assert_allclose(np.load(root / "jobset.npy"),
                               np.load(root / "ref.npy"), rtol=0, atol=1e-5)


def test_nothing_is_left_in_the_pods(cluster, jobs):
    _stop_sshd(cluster)
    for host in cluster.hosts:
        assert processes_in(cluster, host) == [], host.name
