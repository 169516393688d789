"""Unit tests of what `kerasdist run` takes from a platform's variables:
the hostfile an MPI operator names (HYDRA_HOST_FILE, I_MPI_HYDRA_HOST_FILE,
OMPI_MCA_orte_default_hostfile), in the formats Kubeflow's MPIJob writes
(mpi-operator v0.8.0, pkg/controller/mpi_job_controller.go, newConfigMap:
`host:N` for MPICH and Intel, `host slots=N` for Open MPI), and node mode
from torchrun's PET_* variables (Kubeflow Trainer's torch runtime)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.run import launch  # noqa: E402
from kerasdist.run import launch_config  # noqa: E402
from kerasdist.run import node  # noqa: E402

WORKERS = ["train-worker-0.train.default.svc",
           "train-worker-1.train.default.svc"]


def _hostfile(tmp_path, fmt, slots=2):
    path = tmp_path / "hostfile"
    path.write_text("".join(fmt.format(h, slots) + "\n" for h in WORKERS))
    return str(path)


@pytest.mark.parametrize("name, fmt", [
    ("HYDRA_HOST_FILE", "{}:{}"),
    ("I_MPI_HYDRA_HOST_FILE", "{}:{}"),
    ("OMPI_MCA_orte_default_hostfile", "{} slots={}"),
])
def test_the_platforms_hostfile_gives_hosts_and_np(tmp_path, name, fmt):
    path = _hostfile(tmp_path, fmt)
    args = launch_config.parse_args(["python", "t.py"], environ={name: path})
    assert args.platform_hostfile == (name, path)
    assert args.hosts == tuple((h, 2) for h in WORKERS)
    assert args.np == 4
    args = launch_config.parse_args(["-np", "3", "python", "t.py"],
                                    environ={name: path})
    assert args.np == 3 and args.hosts == tuple((h, 2) for h in WORKERS)


def test_flags_win_over_the_platforms_hostfile(tmp_path):
    environ = {"HYDRA_HOST_FILE": _hostfile(tmp_path, "{}:{}")}
    args = launch_config.parse_args(["-np", "1", "-H", "a:1", "x"],
                                    environ=environ)
    assert args.hosts == (("a", 1),) and args.platform_hostfile is None
    other = tmp_path / "other"
    other.write_text("b slots=3\n")
    args = launch_config.parse_args(["-np", "1", "--hostfile", str(other),
                                     "x"], environ=environ)
    assert args.hosts == (("b", 3),) and args.platform_hostfile is None


def test_hydras_variable_is_taken_before_open_mpis(tmp_path):
    hydra = _hostfile(tmp_path, "{}:{}", slots=1)
    environ = {"OMPI_MCA_orte_default_hostfile": "/nonexistent",
               "HYDRA_HOST_FILE": hydra}
    args = launch_config.parse_args(["x"], environ=environ)
    assert args.platform_hostfile == ("HYDRA_HOST_FILE", hydra)
    assert args.np == 2


@pytest.mark.parametrize("argv, text, message", [
    (["x"], None, "HYDRA_HOST_FILE=/nonexistent/hostfile: cannot read"),
    (["x"], "a slots=x\n", "slots must be a positive integer"),
    (["-np", "5", "x"], "a:2\nb:2\n",
     "-np 5 is more than the 4 slot(s) given by HYDRA_HOST_FILE="),
])
def test_a_bad_platform_hostfile_is_one_error(tmp_path, argv, text, message):
    path = "/nonexistent/hostfile"
    if text is not None:
        path = str(tmp_path / "hostfile")
        with open(path, "w") as f:
            f.write(text)
    with pytest.raises(launch_config.UsageError) as e:
        launch_config.parse_args(argv, environ={"HYDRA_HOST_FILE": path})
    assert message in str(e.value)


def test_main_logs_the_file_it_took(tmp_path, capfd):
    # The hostfile names a host that `false` cannot reach: main() stops
    # (at the remote-shell check), after saying which file it took.
    path = str(tmp_path / "hostfile")
    with open(path, "w") as f:
        f.write("nohost-kd-test-0:1\n")
    old = os.environ.get("HYDRA_HOST_FILE")
    os.environ["HYDRA_HOST_FILE"] = path
    try:
        code = launch.main(["--ssh-command", "false", sys.executable, "-c",
                            "pass"])
    finally:
        if old is None:
            os.environ.pop("HYDRA_HOST_FILE")
        else:
            os.environ["HYDRA_HOST_FILE"] = old
    err = capfd.readouterr().err
    assert f"kerasdist: hosts from HYDRA_HOST_FILE={path}: " \
           "nohost-kd-test-0:1\n" in err, err
    assert code == 1, err


PET = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
       "PET_MASTER_ADDR": "train-node-0-0.train", "PET_MASTER_PORT": "29500"}


def test_node_mode_from_the_pet_variables():
    args = launch_config.parse_args(["python", "t.py"], environ=PET)
    assert args.node == node.Plan(2, 1, 2, "train-node-0-0.train", 29500, 4)
    assert args.np == 4
    # A flag of the command line: the PET_* variables are not read.
    assert launch_config.parse_args(["-np", "2", "x"],
                                    environ=PET).node is None
    args = launch_config.parse_args(["--nproc-per-node", "1", "x"],
                                    environ=PET)
    assert args.node == node.Plan(1, 0, 1, "127.0.0.1", None, 1)


def test_pet_variables_without_a_node_rank_are_not_node_mode():
    environ = {"PET_NNODES": "2"}
    with pytest.raises(launch_config.UsageError, match="-np N is required"):
        launch_config.parse_args(["x"], environ=environ)


def test_a_bad_pet_variable_names_it():
    with pytest.raises(launch_config.UsageError) as e:
        launch_config.parse_args(["x"], environ=dict(
            PET, PET_NPROC_PER_NODE="auto"))
    text = str(e.value)
    assert text.startswith("node mode from the PET_* variables (PET_NNODES=2 "
                           "PET_NODE_RANK=1 PET_NPROC_PER_NODE=auto "), text
    assert "--nproc-per-node 'auto' is not a positive integer" in text
