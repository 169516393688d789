"""Jobs started across test hosts the way each platform starts them: on
each host a plain Python script starts that host's processes with exactly
the variables the platform sets (no mpiexec, no ssh), and kd.init() forms
one job. Each process checks collectives against numpy; the backends
chosen must be those of the same layout under `kerasdist run`.

Host names: the hosts are kdt0 and kdt1; the names the platforms give them
(a JobSet's pod DNS names, SageMaker's algo-1, algo-2) are added to the
cluster's hosts file as aliases of their addresses (the host names
themselves stay kdt0 and kdt1).

One cluster for the module; the launches of one wave run at once.
"""

import json
import subprocess
import sys
import time

import pytest

from tests.support.cluster import Cluster
from tests.support.cluster import require
from tests.support.cluster import run_on
from tests.support.helpers import kill_tree
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = pytest.mark.cluster

WORKER = worker_cmd("convention_cluster_worker.py")
JOBSET = ["train-workers-0-0.train", "train-workers-0-1.train"]
SAGEMAKER = ["algo-1", "algo-2"]
# On: the hierarchical backend is chosen only where MPI groups the ranks by
# host as under kerasdist run (2 per host here).
HIER = {"KERASDIST_HIERARCHICAL_ALLREDUCE": 1}
DROP = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "KERAS_DISTRIBUTION_", "JAX_",
        "SLURM_", "SM_", "PET_", "TF_CONFIG", "CLUSTER_SPEC",
        "JOB_COMPLETION_INDEX", "KERASDIST_NUM_PROCESSES",
        "KERASDIST_COORDINATOR", "KERASDIST_RANK", "TORCHELASTIC_")

# Started on each host: its processes, each with its own environment, as
# the platform's agent would; prints each one's exit code and output.
STARTER = r"""
import json, subprocess, sys, time
delay, envs, argv = json.loads(sys.argv[1])
time.sleep(delay)
procs = [subprocess.Popen(argv, env=e, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) for e in envs]
for i, p in enumerate(procs):
    out = p.communicate()[0]
    print(f"=== process {i} rc={p.returncode}\n{out}", flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        for names, host in zip(zip(JOBSET, SAGEMAKER), c.hosts):
            c.add_aliases(host, *names)
        yield c


def _base():
    env = worker_env(KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS=60, **HIER)
    for k in list(env):
        if k.startswith(DROP) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                       "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "MASTER_PORT"):
            del env[k]
    return env


def _jobs(cluster):
    """{name: [[host 0's processes' variables], [host 1's]]}."""
    def torchrun(node, local):
        return {"RANK": 2 * node + local, "WORLD_SIZE": 4, "LOCAL_RANK": local,
                "LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": "kdt0",
                "MASTER_PORT": 29611, "PET_NNODES": 2, "PET_NODE_RANK": node,
                "PET_NPROC_PER_NODE": 2, "PET_MASTER_ADDR": "kdt0",
                "PET_MASTER_PORT": 29611}
    spec = {"chief": ["kdt0:29613"], "worker": ["kdt1:29613"]}
    return {
        "torchrun": [[torchrun(n, 0), torchrun(n, 1)] for n in (0, 1)],
        "jax": [[{"JAX_COORDINATOR_ADDRESS": "kdt0:29612",
                  "JAX_NUM_PROCESSES": 2, "JAX_PROCESS_ID": n}]
                for n in (0, 1)],
        "tf_config": [[{"TF_CONFIG": json.dumps(
            {"cluster": spec, "task": {"type": t, "index": 0}})}]
            for t in ("chief", "worker")],
        "kerasdist": [[{"JOB_COMPLETION_INDEX": n,
                        "KERASDIST_NUM_PROCESSES": 2,
                        "KERASDIST_COORDINATOR": f"{JOBSET[0]}:29614"}]
                      for n in (0, 1)],
        "sagemaker": [[{"SM_HOSTS": json.dumps(SAGEMAKER),
                        "SM_CURRENT_HOST": SAGEMAKER[n], "SM_NUM_GPUS": 0}]
                      for n in (0, 1)],
        "slurm": [[{"SLURM_PROCID": n, "SLURM_NTASKS": 2,
                    "SLURM_STEP_NUM_TASKS": 2, "SLURM_LOCALID": 0,
                    "SLURM_NODEID": n, "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                    "SLURM_STEP_NODELIST": "kdt[0-1]",
                    "SLURM_JOB_NODELIST": "kdt[0-1]", "SLURM_NNODES": 2,
                    "SLURM_JOB_ID": 4242, "SLURM_STEP_ID": 0}]
                  for n in (0, 1)],
    }


def _start(cluster, jobs, delays=None, argv=WORKER):
    """Starts each job's per-host starters; {name: [Popen per host]}."""
    procs = {}
    for name, per_host in jobs.items():
        procs[name] = []
        for i, (host, envs) in enumerate(zip(cluster.hosts, per_host)):
            delay = (delays or {}).get(name, [0, 0])[i]
            full = [{**_base(), **{k: str(v) for k, v in e.items()}}
                    for e in envs]
            procs[name].append(cluster.popen(
                host, [sys.executable, "-c", STARTER,
                       json.dumps([delay, full, argv])],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
    return procs


def _wait(procs, timeout):
    """{name: [(rc, output) per process, in rank order]}."""
    deadline = time.monotonic() + timeout
    out = {}
    try:
        for name, per_host in procs.items():
            outs = []
            for p in per_host:
                text = p.communicate(
                    timeout=max(1, deadline - time.monotonic()))[0]
                for block in text.split("=== process ")[1:]:
                    head, _, body = block.partition("\n")
                    outs.append((int(head.split("rc=")[1]), body))
            out[name] = outs
    finally:
        for per_host in procs.values():
            for p in per_host:
                kill_tree(p)
    return out


def _under_run(cluster, np_, hosts):
    out = run_on(cluster, np_, hosts, WORKER, timeout=120,
                 env=worker_env(**HIER))
    assert out.returncode == 0, out.stdout[-3000:]
    return [line.split()[1] for line in out.stdout.splitlines()
            if "BACKENDS" in line][0]


def _check(name, results, size, hosts, backends):
    assert len(results) == size, (name, results)
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"{name} process {r}:\n{out}"
        local = size // hosts
        assert f"ok {r} {size} {r % local} {local} {hosts}" in out, (
            name, r, out)
        assert f"BACKENDS {backends}" in out, (name, r, backends, out)
    log = [line for line in results[0][1].splitlines()
           if "launch convention" in line]
    assert len(log) == 1 and log[0].startswith(
        f"kerasdist: launch convention {name}: rank 0 of {size}, local rank "
        f"0 of {size // hosts}"), (name, log)
    assert f"backends, first enabled wins: {backends}" in log[0], log


@pytest.mark.timeout(170)
def test_every_convention_forms_one_job_across_hosts(cluster):
    """All conventions at once (each on its own port); JAX's coordinator
    starts 20 s after the other process."""
    jobs = _jobs(cluster)
    procs = _start(cluster, jobs, delays={"jax": [20, 0]})
    try:
        two_by_two = _under_run(cluster, 4, "kdt0:2,kdt1:2")
        two_by_one = _under_run(cluster, 2, "kdt0:1,kdt1:1")
    finally:
        results = _wait(procs, timeout=140)
    assert "hier" in two_by_two.split(","), two_by_two
    assert "hier" not in two_by_one.split(","), two_by_one
    for name, per_host in jobs.items():
        size = sum(len(envs) for envs in per_host)
        _check(name, results[name], size, 2,
               two_by_two if size == 4 else two_by_one)
    coordinators = {name: [line for line in results[name][0][1].splitlines()
                           if "launch convention" in line][0]
                    for name in jobs}
    assert f"coordinator {JOBSET[0]}:29614" in coordinators["kerasdist"]
    assert "coordinator algo-1:29500" in coordinators["sagemaker"]
    assert "coordinator kdt0:" in coordinators["slurm"]


@pytest.mark.timeout(60)
def test_a_missing_coordinator_fails_in_time_across_hosts(cluster):
    jobs = {"jax": [[], [{"JAX_COORDINATOR_ADDRESS": "kdt0:29622",
                          "JAX_NUM_PROCESSES": 2, "JAX_PROCESS_ID": 1,
                          "KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS": 3}]]}
    start = time.monotonic()
    results = _wait(_start(cluster, jobs), timeout=45)
    [(rc, out)] = results["jax"]
    assert rc != 0, out
    assert out.strip().splitlines()[-1].startswith(
        "RuntimeError: kerasdist.init() failed: rank 1 of 2 found no "
        "coordinator at kdt0:29622 within 3 s"), out
    assert time.monotonic() - start < 40


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["mpi", "tcp"])
def test_node_mode_job_across_hosts(cluster, transport):
    """`kerasdist run --nnodes 2 --node-rank N` on each host (no ssh, no
    mpiexec across hosts): one job of 2 x 2 ranks, host 1's agent started
    first, with the single-node and hierarchical paths of kerasdist run;
    over MPI, and over the TCP transport (no MPI in the job), whose
    backend then carries what crosses the hosts."""
    agents = []
    env = {**_base(), "KERASDIST_TRANSPORT": transport}
    try:
        for node in (1, 0):
            agents.append(cluster.popen(
                cluster.hosts[node],
                [sys.executable, "-m", "kerasdist.run", "--nnodes", "2",
                 "--node-rank", str(node), "--master-addr", "kdt0",
                 "--master-port", str(29631 + (transport == "tcp")),
                 "--nproc-per-node", "2", *WORKER],
                env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        outs = [p.communicate(timeout=120)[0] for p in agents]
    finally:
        for p in agents:
            kill_tree(p)
    for p, out in zip(agents, outs):
        assert p.returncode == 0, out[-3000:]
    node1, node0 = outs
    for node, out, ranks in ((0, node0, (0, 1)), (1, node1, (2, 3))):
        for r in ranks:
            assert f"ok {r} 4 {r % 2} 2 2" in out, (node, r, out[-3000:])
    backends = {line.split()[-1] for out in outs
                for line in out.splitlines() if "BACKENDS" in line}
    assert len(backends) == 1, backends
    names = backends.pop().split(",")
    assert "hier" in names, outs[1][-3000:]
    assert names[-1] == transport, names


@pytest.mark.timeout(300)
def test_training_across_hosts_matches_kerasdist_run(cluster, tmp_path):
    """A Keras model trained by 2 processes started with torchrun's
    variables, one per host, over MPI and over the TCP transport, reaches
    the weights (1e-5) of the same job under `kerasdist run -np 2 -H
    kdt0:1,kdt1:1`."""
    import numpy as np
    script = worker_cmd("convention_train_worker.py")

    def torchrun(node, transport):
        return {"RANK": node, "WORLD_SIZE": 2, "LOCAL_RANK": 0,
                "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "kdt0",
                "MASTER_PORT": 29641 + (transport == "tcp"),
                "KERASDIST_TRANSPORT": transport}
    results = {}
    for transport in ("mpi", "tcp"):
        procs = _start(cluster, {transport: [[torchrun(0, transport)],
                                             [torchrun(1, transport)]]},
                       argv=script + [str(tmp_path / f"{transport}.npz")])
        results.update(_wait(procs, timeout=240))
    for transport, per_rank in results.items():
        for r, (rc, out) in enumerate(per_rank):
            assert rc == 0 and f"trained {r} 2" in out, out[-3000:]
    out = run_on(cluster, 2, "kdt0:1,kdt1:1",
                 script + [str(tmp_path / "run.npz")], timeout=240,
                 env=worker_env())
    assert out.returncode == 0, out.stdout[-3000:]
    b = np.load(tmp_path / "run.npz")
    for transport in ("mpi", "tcp"):
        a = np.load(tmp_path / f"{transport}.npz")
        assert len(a.files) == len(b.files) == 4
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5,
                                       err_msg=transport)
