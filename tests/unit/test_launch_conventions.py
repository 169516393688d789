"""kerasdist.run.conventions.detect: environment in, launch record out."""

import pytest

from kerasdist.run import conventions
from kerasdist.run import rendezvous
from kerasdist.run.conventions import Launch
from kerasdist.run.conventions import detect

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
    assert rendezvous.timeout_from({}) == rendezvous.DEFAULT_TIMEOUT_S
    assert rendezvous.timeout_from(
        {rendezvous.TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="is not a positive number"):
            rendezvous.timeout_from({rendezvous.TIMEOUT_ENV: bad})
